"""Decoding on a GPU (issue 44): correctness, then device time against the memory's bandwidth.

    python benchmarks/bench_device_decode.py               # on a GPU: at most --deadline s
    python benchmarks/bench_device_decode.py --rehearse    # anywhere: small shapes, CPU times

First the correctness of each decode call in bfloat16 against ``implementation="xla"`` on the
same inputs in float32, at S = 2048: the default, an int8 and a float8 cache, paged caches of
pages 16 and 64 (pages shuffled, the unused ones NaN), MLA's shared latent (contiguous and paged),
and a ragged batch (decodes and a prefill chunk in one call) against its sequences attended
apart. Then the device time (CUPTI, median of ``--reps``; never a host sync per call) of B8
S32768 N32 K8 d128 bfloat16, one query per sequence, as ms, TB/s of the keys and values a call
reads and TFLOP/s of its products: the yardstick (one pass reading
the cache, the machine's bandwidth in this run), ``implementation=None`` (the decode path),
the fused kernels (Mosaic GPU and Triton: query heads packed by groups, keys split; paged
caches read page by page in the Mosaic GPU kernel, gathered for Triton), int8 and float8
caches (on the decode path, and read as they are by the Mosaic GPU kernel, paged int8 too),
paged caches, ``jax.nn`` with cuDNN and with XLA, PyTorch's SDPA if it is installed
(CUDA events around calls back to back, one sync per round); B1 S131072 and B64
S4096 with their yardsticks; MLA at B8 S32768 (128 query heads, one latent head 576 / 512: the
decode path, the Mosaic GPU kernel, paged 64 both ways); the ragged batch (8 decodes and a 2,048-token chunk) against the two
calls apart. Then each kernel of the decode call and its device time: what XLA runs around the
products. Last, ``examples/generate.py`` on the Mosaic GPU kernel in bfloat16 with an int8
cache, each step checked against the full forward. Every case runs in its own ``try``; the
deadline stops the run between cases.

On a lent machine without this package, as ``bench_device.py``::

    PYTHONPATH=.:benchmarks/.deps python benchmarks/bench_device_decode.py
"""

import argparse
import functools
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_device import (  # this folder is on sys.path
    _call_seconds,
    _failure,
    _without_turns,
    kernel_times,
)

import jax_sdpa as js

N, K, D = 32, 8, 128  # query heads, key/value heads, head width
MLA_HEADS, MLA_WIDTH, MLA_VALUES = 128, 576, 512  # DeepSeek-V3's absorbed MLA decode
HBM_TB_S = 4.8  # an H200's HBM3e, nominal
# The fused kernels' rows, ``name -> implementation`` (``main``'s: the interpreter's rehearsing).
KERNELS = {}


def _cache(batch: int, seq: int, dtype=jnp.bfloat16):
    """Keys and values ``(B, S, K, D)``, unit normal, and one query per sequence."""
    keys = jax.random.split(jax.random.key(0), 3)
    k, v = (jax.random.normal(r, (batch, seq, K, D), jnp.float32).astype(dtype) for r in keys[:2])
    q = jax.random.normal(keys[2], (batch, 1, N, D), jnp.float32).astype(dtype)
    return q, k, v, jnp.full((batch,), seq, jnp.int32)


def _paged(*caches, page: int):
    """The caches as shuffled pages in pools one page larger (their spare page NaN), a table."""
    batch, seq = caches[0].shape[:2]
    per_sequence = seq // page
    order = np.random.default_rng(0).permutation(batch * per_sequence)
    table = jnp.asarray(order.reshape(batch, per_sequence), jnp.int32)

    def pool(x):
        shape = (batch * per_sequence + 1, page, *x.shape[2:])
        spare = jnp.full(shape, jnp.nan, x.dtype)
        return spare.at[table.reshape(-1)].set(x.reshape(-1, *shape[1:]))

    return (*(pool(x) for x in caches), table)


def decode_calls(batch: int, seq: int, dtype=jnp.bfloat16) -> dict:
    """``name -> (fn, args, bytes read)``: the decode calls at one shape."""
    q, k, v, lengths = _cache(batch, seq, dtype)
    cache_bytes = (k.size + v.size) * k.dtype.itemsize
    ours = functools.partial(js.dot_product_attention, key_value_seq_lengths=lengths)
    calls = {
        "yardstick (read K, V)": (lambda k, v: (k.max(axis=1), v.max(axis=1)), (k, v)),
        "jax_sdpa default": (ours, (q, k, v)),
    }
    mosaic_gpu = KERNELS.get("mosaic_gpu")
    for fmt in ("int8", "float8_e4m3fn"):
        quantized = (js.quantize(k, fmt), js.quantize(v, fmt))
        calls[f"jax_sdpa {fmt}"] = (ours, (q, *quantized))
        if mosaic_gpu is not None:  # (the 8 bits read in the kernel)
            kernel = functools.partial(ours, implementation=mosaic_gpu)
            calls[f"jax_sdpa {fmt} mosaic_gpu"] = (kernel, (q, *quantized))
    for page in (16, 64):
        calls[f"jax_sdpa paged {page}"] = (
            js.paged_attention,
            (q, *_paged(k, v, page=page), lengths),
        )
        for name, pallas in KERNELS.items():  # (the pages read in the kernel, or gathered)
            paged = functools.partial(js.paged_attention, implementation=js.Paged(kernel=pallas))
            calls[f"jax_sdpa paged {page} {name}"] = (paged, (q, *_paged(k, v, page=page), lengths))
            if page == 16 and name == "mosaic_gpu":  # (and paged int8)
                *pools, table = _paged(k, v, page=page)
                pools = [js.quantize(x, "int8") for x in pools]
                calls[f"jax_sdpa paged {page} int8 {name}"] = (paged, (q, *pools, table, lengths))
    for name, pallas in KERNELS.items():  # (packed query heads, split keys: one kernel)
        calls[f"jax_sdpa {name}"] = (functools.partial(ours, implementation=pallas), (q, k, v))
    if mosaic_gpu is not None:  # (its consumers not taking turns at the tensor cores)
        calls["jax_sdpa mosaic_gpu, no turns"] = (_without_turns(ours, mosaic_gpu), (q, k, v))
    for implementation in ("cudnn", "xla"):
        nn = functools.partial(
            jax.nn.dot_product_attention,
            key_value_seq_lengths=lengths,
            implementation=implementation,
        )
        calls[f"jax.nn {implementation}"] = (nn, (q, k, v))
    sizes = {name: cache_bytes for name in calls}
    for fmt in ("int8", "float8_e4m3fn"):  # (a byte a number, and the scales)
        scales = sum(x.scale.size * x.scale.dtype.itemsize for x in calls[f"jax_sdpa {fmt}"][1][1:])
        for name in calls:
            if fmt in name:
                sizes[name] = k.size + v.size + scales
    return {name: (fn, args, sizes[name]) for name, (fn, args) in calls.items()}


def mla_calls(batch: int, seq: int, dtype=jnp.bfloat16) -> dict:
    """``name -> (fn, args, bytes read)``: MLA's decode, ``MLA_HEADS`` query heads, one latent.

    DeepSeek-V3's absorbed decode: one latent head of ``MLA_WIDTH`` features, the first
    ``MLA_VALUES`` its values (``LatentValues``), one query per sequence.
    """
    keys = jax.random.split(jax.random.key(4), 2)
    q = jax.random.normal(keys[0], (batch, 1, MLA_HEADS, MLA_WIDTH), jnp.float32).astype(dtype)
    latent = jax.random.normal(keys[1], (batch, seq, 1, MLA_WIDTH), jnp.float32).astype(dtype)
    lengths = jnp.full((batch,), seq, jnp.int32)
    values = js.LatentValues(MLA_VALUES)

    def ours(q, latent, implementation=None):
        return js.dot_product_attention(
            q, latent, values, key_value_seq_lengths=lengths, implementation=implementation
        )

    calls = {
        "yardstick (read the latent)": (lambda x: x.max(axis=1), (latent,)),
        "jax_sdpa default": (ours, (q, latent)),
    }
    if "mosaic_gpu" in KERNELS:  # (Triton's takes 576 wide heads padded to 1024: too wide)
        kernel = functools.partial(ours, implementation=KERNELS["mosaic_gpu"])
        calls["jax_sdpa mosaic_gpu"] = (kernel, (q, latent))
    pool, table = _paged(latent, page=64)

    def paged(q, pool, implementation):
        return js.paged_attention(q, pool, values, table, lengths, implementation=implementation)

    calls["jax_sdpa paged 64"] = (functools.partial(paged, implementation=None), (q, pool))
    if "mosaic_gpu" in KERNELS:
        kernel = js.Paged(kernel=KERNELS["mosaic_gpu"])
        calls["jax_sdpa paged 64 mosaic_gpu"] = (
            functools.partial(paged, implementation=kernel),
            (q, pool),
        )
    size = latent.size * latent.dtype.itemsize
    return {name: (fn, args, size) for name, (fn, args) in calls.items()}


def ragged_calls(seq: int, chunk: int, implementation=None, dtype=jnp.bfloat16) -> dict:
    """8 decodes and one ``chunk``-token prefill chunk: in one ragged call, and as two calls.

    With ``implementation`` (a :class:`jax_sdpa.Paged`) or the default.
    """
    page = 64
    q, k, v, lengths = _cache(9, seq, dtype)
    key_pages, value_pages, table = _paged(k, v, page=page)
    prefill = jax.random.normal(jax.random.key(3), (1, chunk, N, D), jnp.float32).astype(dtype)
    packed = jnp.concatenate([q[:8, 0], prefill[0]])
    starts = jnp.asarray([*range(9), 8 + chunk], jnp.int32)

    def ragged(packed, key_pages, value_pages, table):
        return js.ragged_paged_attention(
            *(packed, key_pages, value_pages, table, lengths, starts),
            max_queries=chunk,
            implementation=implementation,
        )

    def apart(packed, key_pages, value_pages, table):
        paged = functools.partial(js.paged_attention, implementation=implementation)
        decodes = paged(packed[:8, None], key_pages, value_pages, table[:8], lengths[:8])
        chunked = paged(packed[None, 8:], key_pages, value_pages, table[8:], lengths[8:])
        return jnp.concatenate([decodes[:, 0], chunked[0]])

    args = (packed, key_pages, value_pages, table)
    return {"ragged, one call": (ragged, args), "ragged, two calls": (apart, args)}


def _ragged_implementations() -> dict:
    """The ragged batch's implementations, by name: the default, and the Mosaic GPU kernel's."""
    return {"default": None, "mosaic_gpu": js.Paged(kernel=KERNELS["mosaic_gpu"])}


def check(seq: int, tolerance: float) -> None:
    """Each bfloat16 decode call against the same call in float32 on XLA's path."""
    print(f"correctness, S={seq} bfloat16, against xla in float32 (max rel. error):")
    calls = decode_calls(2, seq)
    _, (q, k, v), _ = calls["jax_sdpa default"]
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.nn.dot_product_attention(*wide, implementation="xla")
    for name, (fn, args, _) in calls.items():
        if name.startswith("jax_sdpa"):
            bound = 4 * tolerance if ("int8" in name or "float8" in name) else tolerance
            _check(name, fn, args, want, bound)
    mla = mla_calls(2, seq)
    _, (q, latent), _ = mla["jax_sdpa default"]
    wide = [x.astype(jnp.float32) for x in (q, latent)]
    want = js.dot_product_attention(*wide, wide[1][..., :MLA_VALUES], implementation="xla")
    for name, (fn, args, _) in mla.items():
        if name.startswith("jax_sdpa"):
            _check(f"MLA {name[len('jax_sdpa ') :]}", fn, args, want, tolerance)
    for label, paged in _ragged_implementations().items():
        try:  # (a sequence's 128 queries in several tiles)
            ragged = ragged_calls(seq, 128, paged)
            one, two = (np.asarray(jax.jit(f)(*args), np.float32) for f, args in ragged.values())
            error = float(np.max(np.abs(one - two)) / np.max(np.abs(two)))
            verdict = "ok" if error < tolerance else "FAILED"
            print(f"  {'ragged against apart, ' + label:34s} {verdict}  {error:.1e}")
        except Exception as error:
            print(f"  ragged, {label}: FAILED {_failure(error, 300)}")


def _check(name: str, fn, args, want, bound: float) -> None:
    """Prints whether ``fn(*args)`` is finite and within ``bound`` of ``want`` (max rel.)."""
    try:
        out = np.asarray(jax.jit(fn)(*args), np.float32)
        error = float(np.max(np.abs(out - want)) / np.max(np.abs(want)))
        verdict = "ok" if np.all(np.isfinite(out)) and error < bound else "FAILED"
        print(f"  {name:34s} {verdict}  {error:.1e} (bound {bound:.0e})", flush=True)
    except Exception as error:  # one case's failure must not lose the others
        print(f"  {name}: FAILED {_failure(error, 300)}")


def _torch_seconds(batch: int, seq: int, reps: int) -> float:
    """PyTorch's SDPA (``enable_gqa``) on the same shape: CUDA events, calls back to back."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(batch, N, 1, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, K, seq, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    with torch.no_grad():
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        rounds = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            end.record()
            torch.cuda.synchronize()
            rounds.append(start.elapsed_time(end) / reps / 1e3)
    return float(np.median(rounds))


def time_shape(title: str, calls: dict, names, reps: int, stop: float, flops: float) -> dict:
    """The device time of each named call (all if ``names`` is None), printed; ``name -> s``.

    As ms, TB/s of the bytes each reads, against the yardstick's (the first row) and the HBM's
    nominal rate, and the TFLOP/s of the call's ``flops``.
    """
    print(f"\n{title}:")
    print(
        f"{'call':34s} {'ms':>8s} {'TB/s':>7s} {'% yardstick':>12s} {'% of 4.8':>9s} "
        f"{'TFLOP/s':>8s}"
    )
    seconds, yardstick = {}, None
    for name, (fn, args, size) in calls.items():
        if names is not None and name not in names:
            continue
        if time.time() > stop:
            print("deadline reached: the remaining cases were not run")
            break
        try:
            seconds[name] = _call_seconds(jax.jit(fn), args, reps)
        except Exception as error:  # one case's failure must not lose the others
            print(f"  {name}: {_failure(error, 300)}")
            continue
        rate = size / seconds[name] / 1e12
        yardstick = yardstick or rate
        tflops = "" if name.startswith("yardstick") else f"{flops / seconds[name] / 1e12:8.1f}"
        print(
            f"{name:34s} {seconds[name] * 1e3:8.3f} {rate:7.2f} {100 * rate / yardstick:11.0f}% "
            f"{100 * rate / HBM_TB_S:8.0f}% {tflops}",
            flush=True,
        )
    return seconds


def time_decode(batch: int, seq: int, names, reps: int, stop: float) -> dict:
    """:func:`time_shape` of :func:`decode_calls` (the products' flops: ``4·B·N·S·D``)."""
    title = f"B{batch} S{seq} N{N} K{K} d{D} bfloat16, one query a sequence"
    flops = 4 * batch * N * seq * D
    return time_shape(title, decode_calls(batch, seq), names, reps, stop, flops)


def time_mla(batch: int, seq: int, reps: int, stop: float) -> dict:
    """:func:`time_shape` of :func:`mla_calls` (flops ``2·B·N·S·(576 + 512)``)."""
    title = (
        f"MLA B{batch} S{seq}: {MLA_HEADS} query heads, one latent head {MLA_WIDTH}/{MLA_VALUES},"
        " bfloat16"
    )
    flops = 2 * batch * MLA_HEADS * seq * (MLA_WIDTH + MLA_VALUES)
    return time_shape(title, mla_calls(batch, seq), None, reps, stop, flops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--deadline", type=float, default=230.0, help="seconds, then stop")
    parser.add_argument("--rehearse", action="store_true", help="small shapes, any machine")
    args = parser.parse_args()
    stop = time.time() + args.deadline
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    rehearse = args.rehearse
    for backend in ("mosaic_gpu", "triton"):
        KERNELS[backend] = js.Pallas(interpret=True) if rehearse else js.Pallas(backend=backend)
    check(256 if rehearse else 2048, 2e-2)
    big = (2, 1024) if rehearse else (8, 32768)
    seconds = time_decode(*big, None, args.reps, stop)
    if not rehearse and time.time() < stop:
        try:
            torch = _torch_seconds(*big, args.reps)
            size = 2 * big[0] * big[1] * K * D * 2
            print(f"{'torch SDPA (enable_gqa)':34s} {torch * 1e3:8.3f} {size / torch / 1e12:7.2f}")
        except Exception as error:
            print(f"  torch SDPA: {_failure(error, 200)}")
    for shape in ((1, 2048), (8, 256)) if rehearse else ((1, 131072), (64, 4096)):
        names = ("yardstick (read K, V)", "jax_sdpa default", "jax_sdpa mosaic_gpu", "jax.nn cudnn")
        time_decode(*shape, names, args.reps, stop)
    time_mla(*((2, 512) if rehearse else (8, 32768)), args.reps, stop)
    if time.time() < stop:
        print("\nragged: 8 decodes and a prefill chunk, one call against two:")
        shape = (256, 64) if rehearse else (8192, 2048)
        for label, paged in _ragged_implementations().items():
            for name, (fn, call_args) in ragged_calls(*shape, paged).items():
                try:
                    ms = _call_seconds(jax.jit(fn), call_args, args.reps) * 1e3
                    print(f"  {label:10s} {name:20s} {ms:8.3f} ms")
                except Exception as error:
                    print(f"  {label} {name}: {_failure(error, 300)}")
    for name in ("jax_sdpa default", "jax_sdpa mosaic_gpu"):
        if jax.default_backend() != "gpu" or time.time() > stop:
            break
        try:
            fn, call_args, _ = decode_calls(*big)[name]
            kernels = kernel_times(jax.jit(fn), call_args)
            listed = ", ".join(f"{kernel[:40]} {ms:.3f}" for kernel, ms in kernels[:6])
            print(f"\n{name}'s kernels, device ms: {listed}")
        except Exception as error:
            print(f"  {name}'s kernels: {_failure(error, 300)}")
    summary = ", ".join(
        f"{name} {seconds[name] * 1e3:.3f} ms"
        for name in ("jax_sdpa default", "jax_sdpa mosaic_gpu", "jax.nn cudnn")
        if name in seconds
    )
    print(f"\nsummary, B{big[0]} S{big[1]}: {summary}")
    if time.time() < stop:
        _generation("interpret" if rehearse else "mosaic_gpu", stop)


def _generation(kernel: str, stop: float) -> None:
    """``examples/generate.py --short`` on the kernel, bfloat16, an int8 cache: each step checked.

    (Its cached steps' attention against the full forward, contiguous and paged.)
    """
    example = Path(__file__).resolve().parent.parent / "examples" / "generate.py"
    flags = ["--short", "--kernel", kernel, "--dtype", "bfloat16", "--cache", "int8"]
    print(f"\ngeneration: examples/generate.py {' '.join(flags)}")
    try:
        run = subprocess.run(
            [sys.executable, str(example), *flags],
            capture_output=True,
            text=True,
            timeout=max(1.0, stop - time.time()),
            check=False,
        )
        lines = [line for line in run.stdout.splitlines() if "tokens/s" in line or "cache" in line]
        print("\n".join(f"  {line}" for line in lines))
        if run.returncode != 0:  # (a step off the full forward, or the two caches' tokens)
            print(f"  FAILED (exit {run.returncode}): {run.stderr[-300:]}")
    except Exception as error:  # (past the deadline: subprocess.TimeoutExpired)
        print(f"  generation: {_failure(error, 300)}")


if __name__ == "__main__":
    main()
