"""Lowering a program for a GPU or a TPU on this CPU, and checking every kernel module inside.

``jax.export(..., platforms=[platform])`` only serializes each Pallas kernel's module into its
custom call: XLA parses, verifies and compiles it on the device, where a kernel that lowered
can still fail (a Triton module whose operands disagree in type did, on an H200). So
:func:`verified_kernels` takes each kernel module out of the exported program and does here
what it can:

- ``cuda`` (Triton): parses and verifies it with jaxlib's own Triton dialect, as XLA does
  first on a GPU; then (on Linux x86-64, where Triton's wheels are) compiles it, with upstream
  Triton for an sm_90 GPU (H100, H200), through its passes, LLVM and ``ptxas`` to a cubin, and
  checks that its shared memory fits the chip. XLA compiles with its own copy of Triton's
  passes: this is the same pipeline, not the same binary.
- ``tpu`` (Mosaic): decodes it, parses it with jaxlib's Mosaic dialect, deserializes it
  (``mosaic-serde``) and verifies it. Mosaic's layout passes and its compiler live in libtpu,
  which a CPU machine does not have.
"""

import base64
import dataclasses
import functools
import json
import platform
import re
import sys
import tempfile
import warnings
from pathlib import Path

import jax
from jax import export
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import triton as jax_triton
from jax._src.lib.mlir import ir, passmanager
from jaxlib.mosaic.python import tpu as mosaic_tpu

from tests.util import abstract_devices, abstract_mesh

CUSTOM_CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
# The GPU kernels' custom calls, which an export refuses unless told (a program may hold both)
UNCHECKED = [
    export.DisabledSafetyCheck.custom_call(target)
    for target in (CUSTOM_CALLS["cuda"], "mosaic_gpu_v2")
]
# Upstream Triton's wheels are for Linux x86-64 (the test dependencies install it there): on
# other hosts the Triton modules are verified, not compiled.
CAN_COMPILE = sys.platform == "linux" and platform.machine() == "x86_64"
# An H100's and an H200's shared memory for one block (227 KiB), what a kernel may ask for.
HOPPER_SHARED_BYTES = 232_448


class KernelModuleError(AssertionError):
    """A kernel module that would not compile on the device; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class KernelModule:
    """One kernel of an exported program, parsed and verified: its name and what it needs."""

    platform: str
    name: str
    asm: str  # the verified module, printed
    num_warps: int | None = None  # Triton's
    num_stages: int | None = None
    shared_bytes: int | None = None  # once compiled (cuda)


def exported(program, *args, platform: str, mesh=None) -> str:
    """The StableHLO text of ``jax.jit(program)(*args)`` exported for ``platform`` on this CPU,
    over ``mesh`` (an abstract one, :func:`tests.util.abstract_mesh`, for a ``shard_map`` in
    ``program``) or one abstract chip."""
    with abstract_devices(mesh or abstract_mesh(platform)):
        lowered = export.export(jax.jit(program), platforms=[platform], disabled_checks=UNCHECKED)
        return lowered(*args).mlir_module()


def verified_kernels(
    program, *args, platform: str, compile: bool = True, mesh=None
) -> list[KernelModule]:
    """Every kernel of ``program`` exported for ``platform`` (over ``mesh``), :func:`verified`."""
    return verified(exported(program, *args, platform=platform, mesh=mesh), platform, compile)


def verified(stablehlo: str, platform: str, compile: bool = True) -> list[KernelModule]:
    """Every kernel module of an exported program, parsed and verified, and on ``cuda`` with
    ``compile`` compiled to a cubin for sm_90.

    Raises :class:`KernelModuleError` on the first that fails, naming it.
    """
    kernels = kernel_modules(stablehlo, platform)
    if platform == "cuda" and compile and CAN_COMPILE:
        kernels = [compiled_for_hopper(kernel) for kernel in kernels]
    return kernels


def kernel_modules(stablehlo: str, platform: str) -> list[KernelModule]:
    """The kernel modules inside an exported program, each parsed and verified."""
    context = jax_mlir.make_ir_context()
    jax_triton.dialect.register_dialect(context)
    mosaic_tpu.register_dialect(context)
    parse = _triton_kernel if platform == "cuda" else _mosaic_kernel
    with context:
        configs = []

        def find(op):  # (an op is only valid inside the walk: its attributes are read here)
            if op.name == "stablehlo.custom_call":
                target = ir.StringAttr(op.attributes["call_target_name"]).value
                if target == CUSTOM_CALLS[platform]:
                    configs.append(_backend_config(op))
            return ir.WalkResult.ADVANCE

        ir.Module.parse(stablehlo).operation.walk(find)
        return [parse(config) for config in configs]


def _backend_config(call) -> dict:
    """A kernel call's backend configuration: Triton's attributes, or Mosaic's JSON."""
    if "mhlo.backend_config" in call.attributes:  # Triton's, a dictionary of attributes
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        strings = {key: ir.StringAttr(config[key]).value_bytes for key in ("name", "ir")}
        counts = {key: ir.IntegerAttr(config[key]).value for key in ("num_warps", "num_stages")}
        return {"name": strings["name"].decode(), "ir": strings["ir"], **counts}
    name = ir.StringAttr(call.attributes["kernel_name"]).value  # (Mosaic's function: "main" in 0.6)
    return {"name": name, **json.loads(ir.StringAttr(call.attributes["backend_config"]).value)}


def _triton_kernel(config: dict) -> KernelModule:
    name = config["name"]
    module = _parsed(name, config["ir"])
    asm = module.operation.get_asm(enable_debug_info=False)
    return KernelModule("cuda", name, asm, config["num_warps"], config["num_stages"])


def _mosaic_kernel(config: dict) -> KernelModule:
    body = base64.b64decode(config["custom_call_config"]["body"])
    context = ir.Context.current
    context.allow_unregistered_dialects = True  # until deserialized: versioned op names
    try:
        module = _parsed("tpu_custom_call", body, verify=False)
        passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(
            module.operation
        )
    finally:
        context.allow_unregistered_dialects = False
    name = config["name"]
    if not module.operation.verify():
        raise KernelModuleError(f"Mosaic kernel {name} does not verify.")
    return KernelModule("tpu", name, module.operation.get_asm(enable_debug_info=False))


def _parsed(name: str, source: bytes, verify: bool = True):
    try:
        module = ir.Module.parse(source)
    except Exception as error:  # MLIR's diagnostics, which XLA would print on the device
        raise KernelModuleError(f"kernel {name} does not parse: {error}") from None
    if verify and not module.operation.verify():
        raise KernelModuleError(f"kernel {name} does not verify.")
    return module


def compiled_for_hopper(kernel: KernelModule) -> KernelModule:
    """``kernel`` compiled by upstream Triton and ``ptxas`` for sm_90; its shared memory."""
    shared = _hopper_shared_bytes(kernel.asm, kernel.num_warps, kernel.num_stages)
    if shared > HOPPER_SHARED_BYTES:
        raise KernelModuleError(
            f"Triton kernel {kernel.name} asks for {shared} bytes of shared memory; an sm_90 "
            f"block has {HOPPER_SHARED_BYTES}."
        )
    return dataclasses.replace(kernel, shared_bytes=shared)


@functools.cache
def _hopper_shared_bytes(asm: str, num_warps: int, num_stages: int) -> int:
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ttir"
        path.write_text(asm)
        target = GPUTarget("cuda", 90, 32)
        options = dict(num_warps=num_warps, num_stages=num_stages)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Triton's own notices about its defaults
                compiled = triton.compile(str(path), target=target, options=options)
        except Exception as error:
            name = asm.split("@", 1)[1].split(" ", 1)[0] if "@" in asm else "?"
            raise KernelModuleError(f"Triton kernel {name} does not compile: {error}") from None
    return compiled.metadata.shared


def mosaic_gpu_kernels(program, *args, operands: list | None = None, mesh=None) -> list[str]:
    """Every Mosaic GPU kernel module of ``program`` exported for ``cuda``, parsed (Mosaic GPU's
    dialect registered), deserialized and verified, printed.

    What XLA does next on a GPU (its C++ passes to NVVM, PTX and a cubin) a CPU jaxlib cannot:
    the lowering has already run Mosaic GPU's layout inference and its shared-memory check.
    ``operands``: a list to append each kernel call's operand types to (printed, one string a
    call), as the program passes them. ``mesh``: as :func:`exported` takes it.
    """
    from jax._src.lib import mosaic_gpu_dialect
    from jax.experimental.mosaic.gpu import core as mosaic_gpu_core

    with abstract_devices(mesh or abstract_mesh("cuda")):
        program = export.export(jax.jit(program), platforms=["cuda"], disabled_checks=UNCHECKED)
        stablehlo = program(*args).mlir_module()
    context = jax_mlir.make_ir_context()
    mosaic_gpu_dialect.register_dialect(context)
    # (MLIR's gpu dialect and the others a module names: JAX 0.11's context loads none of them)
    context.append_dialect_registry(jax_mlir.upstream_dialects)
    context.load_all_available_dialects()
    with context:
        bodies = []

        def find(op):
            if op.name == "stablehlo.custom_call":
                if ir.StringAttr(op.attributes["call_target_name"]).value == "mosaic_gpu_v2":
                    config = ir.DictAttr(op.attributes["mhlo.backend_config"])
                    bodies.append(ir.StringAttr(config["module"]).value_bytes)
                    if operands is not None:
                        operands.append(", ".join(str(x.type) for x in op.operands))
            return ir.WalkResult.ADVANCE

        ir.Module.parse(stablehlo).operation.walk(find)
        kernels = []
        for body in bodies:
            context.allow_unregistered_dialects = True  # until deserialized: versioned names
            try:
                module = _parsed("mosaic_gpu_v2", body, verify=False)
                module = mosaic_gpu_core._run_serde_pass(module, serialize=False)
            except KernelModuleError as error:
                if "#gpu<" not in str(error):
                    raise
                # JAX 0.11's Python bindings cannot read back the gpu dialect's attributes its
                # lowering wrote: the module lowered (to NVVM), its op names are all we read.
                kernels.append(
                    " ".join(sorted(set(re.findall(r"[a-z_]+\.[a-z_.]+", body.decode("latin-1")))))
                )
                continue
            finally:
                context.allow_unregistered_dialects = False
            if not module.operation.verify():
                raise KernelModuleError("a Mosaic GPU kernel does not verify.")
            kernels.append(module.operation.get_asm(enable_debug_info=False))
        return kernels
