"""The fused kernel on a GPU: bfloat16 correctness, then speed, in one command with a deadline.

    python benchmarks/bench_device.py              # on a GPU machine: at most --deadline seconds
    python benchmarks/bench_device.py --smoke      # on a GPU: the matrix of calls, checked
    python benchmarks/bench_device.py --lower      # anywhere: every timed call compiled for sm_90
    python benchmarks/bench_device.py --interpret  # anywhere: the correctness cases, interpreted
    python benchmarks/bench_device.py --tiles 64,64,4,2 128,32,8,3  # then other tilings, causal

On the device, first the correctness of ``implementation="pallas"`` in bfloat16 at T = 1024,
forward and gradients against ``implementation="xla"`` on the same inputs in float32: a causal
call with a soft cap, a block mask of 16 documents, 16 documents as segment ids, ALiBi over a
captured slope array with a
document mask over a captured array and sinks (every gradient, the arrays' included), and a
causal sigmoid call with its max scores; the causal call in float32 too, and the kernel's
forward+backward time beside the chunked and dense paths' in both dtypes. Then the time of B2
H16 T4096 d128 bfloat16, forward and forward+backward, medians of ``--reps`` calls: our kernel
(causal, ALiBi, 16 documents, no mask; sigmoid causal and not, and causal with the max scores
out), its Mosaic GPU port (``Pallas(backend="mosaic_gpu")``: causal, no mask, ALiBi, a
relative table, a bias per key and a bias matrix, the matrix as ``bias=`` too, beside cuDNN's
with it, 16 documents as segment ids; every correctness case is run with it too),
``jax.nn.dot_product_attention`` with ``implementation="cudnn"`` and ``"xla"``, our chunked XLA
path, and upstream ``jax.experimental.pallas.ops.gpu.attention.mha``, each as TFLOP/s (the
products a causal call needs: half the scores) and as a ratio to cuDNN, beside the machine's own
bfloat16 matrix product measured in the same run. Every case runs in its own ``try``: one
failure prints its error and the rest go on; the deadline stops the run between cases.

``--lower`` and ``--interpret`` are its rehearsal on a machine without a GPU: ``--lower``
proves that every timed call's Triton kernels compile for sm_90 and its Mosaic GPU kernels lower
and verify (``tests/lowering.py``, an abstract H100 standing in for the chip; a CPU jaxlib
cannot compile those), ``--interpret`` that the checks pass; neither says anything of
speed. ``--smoke`` runs the matrix of calls users make (``tests/matrix.py``), every gradient
checked, one line a case, at sequences of up to 1024 in 2 minutes (``--smoke --interpret``:
up to 80, in the interpreter). Times are the device's own (CUPTI), never a host sync per call.
The three modes use the tests' matrix and lowering helpers: run them from the checkout. On a lent machine whose image has JAX
but not this package (nor a network), run it from the checkout with this package's one other
dependency, pure Python, brought along::

    pip install --no-deps --target benchmarks/.deps jaxtyping wadler_lindig   # here (ignored)
    PYTHONPATH=.:benchmarks/.deps python benchmarks/bench_device.py         # there
"""

import argparse
import dataclasses
import functools
import inspect
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa as js

B, H, T, D = 2, 16, 4096, 128


def _inputs(shape, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]


def _documents(seq: int, count: int = 16):
    return jnp.arange(seq, dtype=jnp.int32) // (seq // count)


def _same_document(documents):
    return lambda b, h, i, j: documents[i] == documents[j]


def correctness_cases(seq: int, heads: int) -> dict:
    """The checked calls, as keywords and the arrays whose gradients are checked."""
    gen = np.random.default_rng(0)
    slopes = jnp.asarray(gen.uniform(0.05, 1.0, heads), jnp.float32)
    sinks = jnp.asarray(gen.normal(size=heads), jnp.float32)
    documents = _documents(seq)
    block_mask = js.create_block_mask(
        _same_document(documents), None, None, seq, seq, block_q=128, block_kv=64
    )

    def alibi_documents(slopes, sinks):
        return dict(
            is_causal=True,
            score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j).astype(s.dtype),
            mask_mod=_same_document(documents),
            sinks=sinks,
        )

    return {
        "causal, soft cap": (lambda: dict(is_causal=True, logits_soft_cap=20.0), ()),
        "block mask, 16 documents": (lambda: dict(mask_mod=block_mask), ()),
        "segment ids, 16 documents": (
            lambda: dict(query_segment_ids=documents[None], key_value_segment_ids=documents[None]),
            (),
        ),
        "ALiBi + documents + sinks": (alibi_documents, (slopes, sinks)),
        "relative table per head": (  # (its gradient summed at q_idx − kv_idx)
            lambda table: dict(
                is_causal=True, score_mod=lambda s, b, h, i, j: s + table[h, i - j + seq]
            ),
            (jnp.asarray(gen.normal(size=(heads, 2 * seq)), jnp.float32),),
        ),
        "bias per key": (  # (its gradient summed over each tile's rows)
            lambda bias: dict(is_causal=True, score_mod=lambda s, b, h, i, j: s + bias[j]),
            (jnp.asarray(gen.normal(size=(seq,)), jnp.float32),),
        ),
        "bias matrix": (  # (a 2-D window a tile; its gradient added into memory at the tile)
            lambda bias: dict(is_causal=True, score_mod=lambda s, b, h, i, j: s + bias[i, j]),
            (jnp.asarray(gen.normal(size=(seq, seq)), jnp.float32),),
        ),
        "sigmoid causal + max scores": (
            lambda: dict(is_causal=True, normalizer="sigmoid", return_max_scores=True),
            (),
        ),
    }


def dtypes_compared(kernel, reps: int, stop: float) -> None:
    """The kernel, the chunked path and the dense one, forward+backward, bfloat16 and float32.

    B2 H16 T4096 d128 causal: what decides which ``implementation=None`` should take.
    """
    for dtype in (jnp.bfloat16, jnp.float32):
        if time.time() > stop:
            print("deadline reached: the dtypes' comparison stopped")
            return
        x = _inputs((B, T, H, D), dtype)
        attend = functools.partial(js.dot_product_attention, is_causal=True)
        paths = {"pallas": kernel, "chunked": "chunked", "xla": "xla"}
        times = {
            name: _call_seconds(
                _forward_backward(functools.partial(attend, implementation=path)), x, reps
            )
            for name, path in paths.items()
        }
        print(
            f"  {jnp.dtype(dtype).name} fwd+bwd ms: "
            + ", ".join(f"{name} {1e3 * t:.2f}" for name, t in times.items())
        )


def _first(outputs):
    """The attention output of a call that may also return row statistics."""
    return outputs[0] if isinstance(outputs, tuple) else outputs


def check(name, keywords, arrays, seq, heads, dtype, kernel, tolerance):
    """Our kernel in ``dtype`` against xla in float32 on the same inputs: worst relative error."""
    q, k, v = _inputs((1, seq, heads, D), dtype)

    def loss(implementation, q, k, v, *arrays):
        outs = js.dot_product_attention(q, k, v, implementation=implementation, **keywords(*arrays))
        out = _first(outs).astype(jnp.float32)
        return jnp.sum(out * jnp.cos(jnp.arange(out.shape[-1]))), outs

    argnums = tuple(range(1, 4 + len(arrays)))

    def run(implementation, *args):
        grad = jax.grad(loss, argnums=argnums, has_aux=True)
        return jax.jit(grad, static_argnums=0)(implementation, *args)

    grads, outs = run(kernel, q, k, v, *arrays)
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    want_grads, want = run("xla", *wide, *arrays)
    outs, want = jax.tree.leaves(outs), jax.tree.leaves(want)
    errors = [
        float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())
        for a, b in zip([*outs, *grads], [*want, *want_grads], strict=True)
    ]
    names = ["out", "max scores"][: len(outs)]
    names += ["dq", "dk", "dv", *(f"d{n}" for n in inspect.signature(keywords).parameters)]
    worst = max(errors)
    verdict = "ok" if worst <= tolerance else "FAIL"
    detail = ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errors, strict=True))
    print(f"  {name:28s} {verdict}  {detail}", flush=True)


def flops(causal: bool, backward: bool) -> float:
    forward = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
    return forward * (3.5 if backward else 1.0)


def timed_calls(kernel) -> dict:
    """The timed calls: ``name -> (fn(q, k, v), causal)``.

    The block mask is made with the kernel's tiles; its TFLOP/s count a full call's products
    (compare its time with "no mask").
    """
    slopes = js.mods.alibi_slopes(H)
    documents = _documents(T)
    tiles = dict(block_q=kernel.block_q, block_kv=kernel.block_kv)
    block_mask = js.create_block_mask(_same_document(documents), None, None, T, T, **tiles)
    # (at the Mosaic GPU forward kernel's tiles for d ≤ 128, whose classes it reads as they are)
    sides = dict(block_q=64, block_kv=128)
    mosaic_block_mask = js.create_block_mask(_same_document(documents), None, None, T, T, **sides)
    segments = jnp.broadcast_to(documents, (B, T))
    ours = functools.partial(js.dot_product_attention, implementation=kernel)

    def alibi(s, b, h, i, j):
        return s - slopes[h] * (i - j).astype(s.dtype)

    # A learned relative-position table per head (its gradient summed at q_idx − kv_idx).
    table = jnp.linspace(-1.0, 1.0, H * 2 * T, dtype=jnp.float32).reshape(H, 2 * T)

    def relative(s, b, h, i, j):
        return s + table[h, i - j + T].astype(s.dtype)

    # A learned bias per key (its gradient each tile's sums over its rows, added at the keys).
    key_bias = jnp.linspace(-1.0, 1.0, T, dtype=jnp.float32)

    def per_key(s, b, h, i, j):
        return s + key_bias[j].astype(s.dtype)

    # A learned bias matrix (a 2-D window a tile; its gradient added into memory at the tile).
    matrix = jnp.linspace(-1.0, 1.0, T * T, dtype=jnp.float32).reshape(T, T)

    def bias_matrix(s, b, h, i, j):
        return s + matrix[i, j].astype(s.dtype)

    bias_array = matrix[None, None].astype(jnp.bfloat16)  # (jax.nn's bias=, cuDNN's dtype)

    nn = functools.partial(jax.nn.dot_product_attention, is_causal=True)
    # In the order they matter, should the deadline stop the run: the kernel against cuDNN and
    # our own chunked path first.
    mosaic = functools.partial(js.dot_product_attention, implementation=_mosaic_gpu(kernel))
    calls = {
        "pallas causal": (functools.partial(ours, is_causal=True), True),
        "jax.nn cudnn causal": (functools.partial(nn, implementation="cudnn"), True),
        # The Mosaic GPU kernel (issue 43): forward and both backward kernels its own.
        "mosaic_gpu causal": (functools.partial(mosaic, is_causal=True), True),
        "mosaic_gpu no mask": (mosaic, False),
        # Its forward kernel's consumers taking turns at the tensor cores (the ping-pong) or not
        "mosaic_gpu causal, no turns": (
            _without_turns(
                functools.partial(js.dot_product_attention, is_causal=True), _mosaic_gpu(kernel)
            ),
            True,
        ),
        "jax.nn cudnn no mask": (
            functools.partial(nn, is_causal=False, implementation="cudnn"),
            False,
        ),
        "mosaic_gpu causal ALiBi": (
            functools.partial(mosaic, is_causal=True, score_mod=alibi),
            True,
        ),
        "mosaic_gpu causal relative table": (
            functools.partial(mosaic, is_causal=True, score_mod=relative),
            True,
        ),
        "mosaic_gpu causal bias per key": (
            functools.partial(mosaic, is_causal=True, score_mod=per_key),
            True,
        ),
        "mosaic_gpu causal bias matrix": (
            functools.partial(mosaic, is_causal=True, score_mod=bias_matrix),
            True,
        ),
        # jax.nn's own bias argument, the same matrix (read as the score_mod's is), and cuDNN's.
        "mosaic_gpu causal bias= array": (
            functools.partial(mosaic, is_causal=True, bias=bias_array),
            True,
        ),
        "jax.nn cudnn causal bias= array": (
            functools.partial(nn, implementation="cudnn", bias=bias_array),
            True,
        ),
        "mosaic_gpu 16 documents (segment ids)": (
            functools.partial(mosaic, query_segment_ids=segments, key_value_segment_ids=segments),
            False,
        ),
        "mosaic_gpu 16 documents (block mask)": (
            functools.partial(mosaic, mask_mod=mosaic_block_mask),
            False,
        ),
        "chunked causal": (
            functools.partial(js.dot_product_attention, is_causal=True, implementation="chunked"),
            True,
        ),
        "pallas causal ALiBi": (functools.partial(ours, is_causal=True, score_mod=alibi), True),
        "pallas no mask": (ours, False),
        "pallas 16 documents": (functools.partial(ours, mask_mod=block_mask), False),
    }
    try:
        from jax.experimental.pallas.ops.gpu import attention as upstream

        calls["upstream mha causal"] = (
            lambda q, k, v: upstream.mha(q, k, v, segment_ids=None, causal=True),
            True,
        )
    except ImportError as error:
        print(f"  upstream mha: not importable ({error})")
    calls |= {
        "pallas causal sigmoid": (
            functools.partial(ours, is_causal=True, normalizer="sigmoid"),
            True,
        ),
        "pallas sigmoid no mask": (functools.partial(ours, normalizer="sigmoid"), False),
        "pallas causal max scores": (
            functools.partial(ours, is_causal=True, return_max_scores=True),
            True,
        ),
        "jax.nn xla causal": (functools.partial(nn, implementation="xla"), True),
        # The defaults, side by side: ours must never be slower than jax.nn's.
        "jax_sdpa default causal": (
            functools.partial(js.dot_product_attention, is_causal=True),
            True,
        ),
        "jax.nn default causal": (nn, True),
    }
    return calls


class _NoTurns(js.Pallas):
    """A Mosaic GPU kernel whose forward consumers take no turns at the tensor cores.

    (Its own class: JAX's caches of traces, keyed by the tunables, keep its programs apart from
    the kernel's, which take turns: :class:`jax_sdpa._kernels.pipeline.Turns`.)
    """


def _without_turns(fn, kernel):
    """``fn(*args, implementation=kernel)``, the forward kernel's consumers taking no turns."""
    from jax_sdpa._kernels import mosaic_gpu

    fields = {f.name: getattr(kernel, f.name) for f in dataclasses.fields(kernel)}
    untaken = _NoTurns(**fields)

    def call(*args):  # (traced so: the kernel is made as it is traced)
        made = mosaic_gpu.warp_specialized
        mosaic_gpu.warp_specialized = lambda *a, **kw: made(*a, **(kw | {"alternate": False}))
        try:
            return fn(*args, implementation=untaken)
        finally:
            mosaic_gpu.warp_specialized = made

    return call


def _mosaic_gpu(kernel):
    """``kernel`` as the Mosaic GPU kernel, or (JAX before 0.11) ``kernel``, saying so."""
    try:
        return dataclasses.replace(kernel, backend="mosaic_gpu")
    except ValueError as error:
        print(f"  mosaic_gpu: {error} (its rows run the Triton kernel)")
        return kernel


def _failure(error: Exception, width: int) -> str:
    """A case's error in one line: its type and the first ``width`` characters of its message."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:width]}"


def _call_seconds(fn, args, reps: int) -> float:
    """The time of one call ``fn(*args)`` on the device: the median of CUPTI's counts on a GPU.

    Elsewhere (a rehearsal on a CPU), the mean of ``reps`` calls back to back with one sync.
    Never one host sync per call: its round trip would add to every sub-millisecond kernel.
    """
    jax.block_until_ready(fn(*args))  # compile and warm up
    if jax.default_backend() == "gpu":
        from jax.experimental.mosaic.gpu import profiler

        _, milliseconds = profiler.measure(fn, iterations=reps)(*args)
        if milliseconds is None:
            raise RuntimeError("CUPTI saw no kernel run: nothing to time.")
        return float(np.median(milliseconds)) / 1e3
    start = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(reps)])
    return (time.perf_counter() - start) / reps


def kernel_times(fn, args: tuple) -> list[tuple[str, float]]:
    """Each kernel ``fn(*args)`` runs on a GPU and its device milliseconds, longest first."""
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(*args))
    _, kernels = profiler.measure(fn, aggregate=False)(*args)
    return sorted(kernels or [], key=lambda kernel: -kernel[1])


def _forward_backward(fn):
    """The gradients of the output's sum, and what else the call returns (the max scores).

    A result nobody reads, XLA does not compute: so the program returns it, as a training step
    that records the max scores does.
    """

    def loss(q, k, v):
        out, *rest = jax.tree.leaves(fn(q, k, v))
        return out.astype(jnp.float32).sum(), rest

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))


def gemm_tflops(reps: int) -> float:
    """The machine's own bfloat16 matrix product, 8192³, as TFLOP/s."""
    a, b = _inputs((8192, 8192), jnp.bfloat16)[:2]
    seconds = _call_seconds(jax.jit(jnp.matmul), (a, b), reps)
    return 2 * 8192**3 / seconds / 1e12


def time_all(kernel, reps: int, stop: float) -> None:
    q, k, v = _inputs((B, T, H, D), jnp.bfloat16)
    print(f"bfloat16 matrix product 8192³: {gemm_tflops(reps):.0f} TFLOP/s (this machine)")
    rows, cudnn = [], {}
    for name, (fn, causal) in timed_calls(kernel).items():
        for backward in (False, True):
            if time.time() > stop:
                print("deadline reached: the remaining cases were not run")
                return _print(rows, cudnn)
            program = _forward_backward(fn) if backward else jax.jit(fn)
            try:
                seconds = _call_seconds(program, (q, k, v), reps)
            except Exception as error:  # one case's failure must not lose the others
                print(f"  {name} {'fwd+bwd' if backward else 'fwd'}: {_failure(error, 300)}")
                continue
            tflops = flops(causal, backward) / seconds / 1e12
            if name == "jax.nn cudnn causal":
                cudnn[backward] = tflops
            rows.append((name, backward, seconds, tflops))
    _print(rows, cudnn)


# The calls whose kernels are listed one by one: what runs around ours (layout transposes, a
# block mask's lists) shows there.
BROKEN_DOWN = ("pallas causal", "jax.nn cudnn causal", "pallas 16 documents")


def print_kernel_times(kernel) -> None:
    """Each kernel's device time in a few calls, forward and forward+backward (on a GPU)."""
    q, k, v = _inputs((B, T, H, D), jnp.bfloat16)
    calls = timed_calls(kernel)
    print("\nkernels, device ms (CUPTI, one call):")
    for name in BROKEN_DOWN:
        fn, _ = calls[name]
        for backward in (False, True):
            program = _forward_backward(fn) if backward else jax.jit(fn)
            try:
                kernels = kernel_times(program, (q, k, v))
            except Exception as error:  # one case's failure must not lose the others
                print(f"  {name} {'fwd+bwd' if backward else 'fwd'}: {_failure(error, 200)}")
                continue
            total = sum(ms for _, ms in kernels)
            listed = ", ".join(f"{kernel_name[:40]} {ms:.3f}" for kernel_name, ms in kernels[:6])
            passes = "fwd+bwd" if backward else "fwd"
            print(f"  {name:22s} {passes:8s} {total:.3f} in {len(kernels)}: {listed}")


def _print(rows, cudnn) -> None:
    print(f"\nB{B} H{H} T{T} d{D} bfloat16, median of calls")
    print(f"{'call':26s} {'pass':8s} {'ms':>9s} {'TFLOP/s':>8s} {'vs cuDNN':>9s}")
    for name, backward, seconds, tflops in rows:
        ratio = f"{tflops / cudnn[backward]:.2f}" if backward in cudnn else "-"
        print(
            f"{name:26s} {'fwd+bwd' if backward else 'fwd':8s} {seconds * 1e3:9.2f} "
            f"{tflops:8.1f} {ratio:>9s}"
        )
    _print_targets({(name, backward): seconds for name, backward, seconds, _ in rows})


# The kernel issue's targets: (what, numerator, denominator, bound); ratios of times, the first
# call's over the second's, in both passes.
TARGETS = (
    ("≥ 50 % of cuDNN's TFLOP/s (fwd; 40 % fwd+bwd)", "jax.nn cudnn causal", "pallas causal"),
    ("≥ 5× our chunked path", "chunked causal", "pallas causal"),
    ("ALiBi ≤ 1.15× plain causal", "pallas causal ALiBi", "pallas causal"),
    ("16 documents ≥ 8× faster than no mask", "pallas no mask", "pallas 16 documents"),
    ("at least as fast as upstream mha", "upstream mha causal", "pallas causal"),
    ("sigmoid ≤ 1.0× softmax, causal", "pallas causal sigmoid", "pallas causal"),
    ("sigmoid ≤ 1.0× softmax, no mask", "pallas sigmoid no mask", "pallas no mask"),
    ("max scores ≤ 1.03× without", "pallas causal max scores", "pallas causal"),
    ("mosaic_gpu ≥ 1.0× cuDNN (fwd; 0.9× fwd+bwd)", "jax.nn cudnn causal", "mosaic_gpu causal"),
    ("mosaic_gpu ≥ 1.0× cuDNN, no mask", "jax.nn cudnn no mask", "mosaic_gpu no mask"),
    ("mosaic_gpu ALiBi ≤ 1.10× plain causal", "mosaic_gpu causal ALiBi", "mosaic_gpu causal"),
    (
        "mosaic_gpu relative table ≤ 1.3× plain causal (fwd+bwd)",
        "mosaic_gpu causal relative table",
        "mosaic_gpu causal",
    ),
    (
        "mosaic_gpu 16 documents ≥ 8× faster than no mask",
        "mosaic_gpu no mask",
        "mosaic_gpu 16 documents (block mask)",
    ),
    ("our default ≥ 1.0× jax.nn's default", "jax.nn default causal", "jax_sdpa default causal"),
)


def _print_targets(seconds: dict) -> None:
    print("\ntargets (time of the first call over the second's):")
    for what, first, second in TARGETS:
        for backward in (False, True):
            pair = (first, backward), (second, backward)
            if all(key in seconds for key in pair):
                ratio = seconds[pair[0]] / seconds[pair[1]]
                passes = "fwd+bwd" if backward else "fwd"
                print(f"  {what:48s} {passes:8s} {first} / {second} = {ratio:.2f}")


def time_tiles(tiles: list[str], reps: int, stop: float) -> None:
    """The causal call, forward and forward+backward, with each ``q,kv,warps,stages`` tiling."""
    q, k, v = _inputs((B, T, H, D), jnp.bfloat16)
    print(f"\ntilings, causal (B{B} H{H} T{T} d{D} bfloat16, median of calls):")
    print(
        f"{'block_q,block_kv,warps,stages':30s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'fwd+bwd ms':>11s} {'TFLOP/s':>8s}"
    )
    for tiling in tiles:
        if time.time() > stop:
            print("deadline reached: the remaining tilings were not run")
            return
        block_q, block_kv, warps, stages = map(int, tiling.split(","))
        kernel = js.Pallas(block_q, block_kv, num_warps=warps, num_stages=stages)
        fn = functools.partial(js.dot_product_attention, is_causal=True, implementation=kernel)
        row = []
        for backward in (False, True):
            program = _forward_backward(fn) if backward else jax.jit(fn)
            try:
                seconds = _call_seconds(program, (q, k, v), reps)
                row += [f"{seconds * 1e3:8.2f}", f"{flops(True, backward) / seconds / 1e12:8.1f}"]
            except Exception as error:
                row += [_failure(error, 120)]
        print(f"{tiling:30s} {' '.join(row)}", flush=True)


# Forward and every gradient against implementation="xla" in float32 at the highest precision,
# relative to each result's largest entry (float32 inputs: the kernel's products in TF32).
SMOKE_TOLERANCE = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 1e-2}
# No sequence is longer: small sizes that keep the lengths no tile divides (63, 65, 1000); in the
# interpreter (a CPU), shorter still.
SMOKE_LENGTH = {"device": 1024, "interpreter": 80}
SMOKE_SECONDS = 120.0  # the smoke's default deadline


def smoke(kernel, stop: float) -> None:
    """The matrix of calls users make (``tests/matrix.py``), run: one line per case.

    Each case's forward and every gradient (queries, keys, values, the arrays it closes over)
    in its dtype, against ``implementation="xla"`` on the same inputs in float32. The cases are
    compiled and run by 8 threads at once (XLA compiles off the interpreter lock) and printed in
    order; at the deadline the cases not started are cancelled.
    """
    from tests.matrix import CASES, gradients, shrunk

    def prepared(index: int, case):
        shapes = case.inputs()
        keys = jax.random.split(jax.random.key(index), len(shapes))
        # Queries, keys, values unit normal; the arrays a call closes over (slopes, sinks,
        # tables) in [0.05, 1), as ALiBi's slopes are (BENCHMARKS.md: mixed signs).
        args = [
            jax.random.normal(k, x.shape, jnp.float32)
            for k, x in zip(keys[:3], shapes[:3], strict=True)
        ]
        args += [
            jax.random.uniform(k, x.shape, jnp.float32, 0.05, 1.0)
            for k, x in zip(keys[3:], shapes[3:], strict=True)
        ]
        args = [x.astype(shape.dtype) for x, shape in zip(args, shapes, strict=True)]
        wide = [x.astype(jnp.float32) for x in args]  # the same values
        ours = jax.jit(gradients(case, kernel)).lower(*args).compile()
        with jax.default_matmul_precision("highest"):
            reference = jax.jit(gradients(case, "xla")).lower(*wide).compile()
        return ours(*args), reference(*wide)

    length = SMOKE_LENGTH["interpreter" if kernel.interpret else "device"]
    cases = {name: shrunk(case, length) for name, case in CASES.items()}
    start = time.time()
    with ThreadPoolExecutor(max_workers=8) as pool:
        runs = {
            name: pool.submit(prepared, n, case) for n, (name, case) in enumerate(cases.items())
        }
        passed = 0
        for name, run in runs.items():
            if time.time() > stop:
                pool.shutdown(wait=False, cancel_futures=True)
                print("deadline reached: the remaining cases were not run")
                break
            try:
                line, ok = _compared(cases[name], *run.result())
            except Exception as error:  # one case's failure must not lose the others
                line, ok = f"FAIL  {_failure(error, 200)}", False
            passed += ok
            print(f"  {name:46s} {line}", flush=True)
    print(f"smoke: {passed} of {len(cases)} cases ok in {time.time() - start:.0f} s")


def _compared(case, ours, reference) -> tuple[str, bool]:
    """One case's line: the worst error, and where, relative to each result's largest entry.

    A result that is 0 in the reference (``dq`` at T = S = 1, where the softmax of one key is
    constant) is compared against the case's largest entry.
    """
    (grads, outs), (want_grads, want) = ours, reference
    names = ["out", "max scores"][: len(jax.tree.leaves(outs))] + ["dq", "dk", "dv"]
    names += [f"d(array {n})" for n in range(len(grads) - 3)]
    got, expected = [*jax.tree.leaves(outs), *grads], [*jax.tree.leaves(want), *want_grads]
    largest = [float(jnp.abs(x).max()) for x in expected]
    errors = {
        name: float(jnp.abs(a.astype(jnp.float32) - b).max()) / (scale or max(largest))
        for name, a, b, scale in zip(names, got, expected, largest, strict=True)
    }
    worst = max(errors, key=errors.get)
    ok = errors[worst] <= SMOKE_TOLERANCE[jnp.dtype(case.dtype).name]
    return (
        f"{'ok' if ok else 'FAIL':4s}  worst {errors[worst]:.1e} ({worst}), out {errors['out']:.1e}",
        ok,
    )


def lower_all(kernel) -> None:
    """Every timed call of ours lowered for cuda at full size, each kernel module verified and
    compiled for sm_90 (``tests/lowering.py``): on any machine."""
    from tests.lowering import mosaic_gpu_kernels, verified_kernels

    x = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    for name, (fn, _) in timed_calls(kernel).items():
        if not name.startswith(("pallas", "mosaic_gpu")):
            continue
        for backward in (False, True):
            program = _forward_backward(fn) if backward else fn
            passes = "fwd+bwd" if backward else "fwd"
            try:
                kernels = verified_kernels(program, x, x, x, platform="cuda")
                mosaic = mosaic_gpu_kernels(program, x, x, x) if name.startswith("mosaic") else []
                if not kernels and not mosaic:
                    raise RuntimeError("no kernel in the exported program")
                parts = [f"{k.name} compiles ({k.shared_bytes} B shared)" for k in kernels]
                parts += [f"{len(mosaic)} Mosaic GPU kernels lower and verify"] * bool(mosaic)
                print(f"  {name:24s} {passes:8s} {', '.join(parts)}", flush=True)
            except Exception as error:  # one case's failure must not lose the others
                print(f"  {name:24s} {passes:8s} FAILS: {_failure(error, 300)}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lower", action="store_true", help="lower for cuda, run nothing")
    parser.add_argument("--interpret", action="store_true", help="checks in the interpreter")
    parser.add_argument("--smoke", action="store_true", help="only the matrix of calls, checked")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--deadline",
        type=float,
        help=f"seconds for the run (220; with --smoke {SMOKE_SECONDS:.0f})",
    )
    parser.add_argument("--block-q", type=int, default=64)
    parser.add_argument("--block-kv", type=int, default=64)
    parser.add_argument(
        "--tiles",
        nargs="*",
        default=[],
        help="then time the causal call with each tiling, as block_q,block_kv,warps,stages",
    )
    args = parser.parse_args()
    stop = time.time() + (args.deadline or (SMOKE_SECONDS if args.smoke else 220.0))
    kernel = js.Pallas(block_q=args.block_q, block_kv=args.block_kv, interpret=args.interpret)
    print(f"jax {jax.__version__}, devices {jax.devices()}, {kernel}")
    if args.lower:
        return lower_all(kernel)
    if args.smoke:
        return smoke(kernel, stop)
    seq, heads, dtype, tolerance = (
        (256, 4, jnp.float32, 1e-5) if args.interpret else (1024, H, jnp.bfloat16, 3e-2)
    )
    print(f"correctness, T={seq} {jnp.dtype(dtype).name}, against xla in float32:")
    mosaic = _mosaic_gpu(kernel)
    for name, (keywords, arrays) in correctness_cases(seq, heads).items():
        for label, tried in ((name, kernel), (f"{name} [mosaic_gpu]", mosaic)):
            try:
                check(label, keywords, arrays, seq, heads, dtype, tried, tolerance)
            except Exception:  # one case's failure must not lose the others
                print(f"  {label}: FAILED\n{traceback.format_exc(limit=3)}")
    if not args.interpret:
        try:  # float32 inputs: the products in TF32 (Triton's default precision), as XLA's
            keywords, _ = correctness_cases(seq, heads)["causal, soft cap"]
            check("causal, soft cap, float32", keywords, (), seq, heads, jnp.float32, kernel, 1e-2)
            dtypes_compared(kernel, args.reps, stop)
        except Exception:
            print(f"  float32: FAILED\n{traceback.format_exc(limit=3)}")
        time_all(kernel, args.reps, stop)
        if jax.default_backend() == "gpu" and time.time() < stop:
            print_kernel_times(kernel)
        time_tiles(args.tiles, args.reps, stop)


if __name__ == "__main__":
    main()
