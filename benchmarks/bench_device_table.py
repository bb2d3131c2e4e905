"""Issue 43's table on a GPU: the Mosaic GPU kernel beside cuDNN and PyTorch's FlexAttention.

    PYTHONPATH=.:benchmarks/.deps python benchmarks/bench_device_table.py [--reps 10]
    python benchmarks/bench_device_table.py --rows 4,5   # the rows at T16384 alone
    python benchmarks/bench_device_table.py --rehearse   # anywhere: tiny shapes, interpreted
    python benchmarks/bench_device_table.py --lower      # anywhere: ours lowered for cuda

Each row forward and forward+backward (the gradients of the output's sum), bfloat16, d128:
``implementation=Pallas(backend="mosaic_gpu")``, ``jax.nn.dot_product_attention(...,
implementation="cudnn")`` where cuDNN takes the mask (causal, none, a window), and
``torch.compile(flex_attention)`` with the same mods written the same way (each library's block
mask built once, outside the timed calls). JAX's calls are timed on the device (CUPTI, median),
torch's by CUDA events around ``--reps`` calls back to back, one sync a round (median of 3
rounds): never a host sync per call. TFLOP/s count the products the mask leaves (half of a
causal call's; 3.5× the forward's for forward+backward). Rows, in the order they matter should
the deadline stop the run:

- B2 H16 T4096: causal; no mask; ALiBi over captured slopes (causal); 16 documents (a block mask);
- B1 H16 T16384: causal; a causal window of 1024 keys;
- GQA B1 N64 K8 T4096: causal; no mask.

Then the issue's targets, each met or not with its ratio: forward ≥ 1.0× cuDNN's speed and
forward+backward ≥ 0.9×, faster than FlexAttention on every row, ALiBi ≤ 1.10× plain causal,
16 documents ≥ 8× faster than no mask (forward). ``--rehearse`` runs every row at T = 128 with
the Pallas interpreter and without cuDNN (torch's rows where torch is installed), to prove the
script, not to time anything.
"""

import os

# (torch shares the GPU: JAX takes what it needs, not three quarters of the memory up front)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_device import (  # noqa: E402  (this folder is on sys.path)
    _call_seconds,
    _failure,
    _forward_backward,
    _inputs,
)

import jax_sdpa as js  # noqa: E402

D, WINDOW, DOCUMENTS = 128, 1024, 16
# name -> (batch, sequence, query heads, key/value heads)
SHAPES = {
    "B2 H16 T4096": (2, 4096, 16, 16),
    "B1 H16 T16384": (1, 16384, 16, 16),
    "GQA B1 64/8 T4096": (1, 4096, 64, 8),
}
ROWS = [
    ("B2 H16 T4096", "causal"),
    ("B2 H16 T4096", "no mask"),
    ("B2 H16 T4096", "ALiBi"),
    ("B2 H16 T4096", "16 documents"),
    ("B1 H16 T16384", "causal"),
    ("B1 H16 T16384", f"window {WINDOW}"),
    ("GQA B1 64/8 T4096", "causal"),
    ("GQA B1 64/8 T4096", "no mask"),
]


def share(mask: str, seq: int, window: int = WINDOW) -> float:
    """The share of (query, key) pairs ``mask`` leaves at length ``seq``."""
    if mask in ("causal", "ALiBi"):
        return (seq + 1) / (2 * seq)
    if mask.startswith("window"):
        return sum(min(i, window) + 1 for i in range(seq)) / seq**2
    return 1 / DOCUMENTS if mask == "16 documents" else 1.0


def documents(seq: int):
    """Each position's document: ``DOCUMENTS`` of equal length."""
    return np.arange(seq) // (seq // DOCUMENTS)


def ours(mask: str, seq: int, heads: int, kernel):
    """Our call of the row, ``(q, k, v) -> out`` on ``(B, T, N, d)`` arrays."""
    call = functools.partial(js.dot_product_attention, implementation=kernel)
    if mask == "causal":
        return functools.partial(call, is_causal=True)
    if mask == "ALiBi":
        slopes = js.mods.alibi_slopes(heads)

        def alibi(s, b, h, i, j):
            return s - slopes[h] * (i - j).astype(s.dtype)

        return functools.partial(call, is_causal=True, score_mod=alibi)
    if mask == "16 documents":  # (at the Mosaic GPU forward kernel's tiles for d ≤ 128)
        ids = jnp.asarray(documents(seq))
        same = js.create_block_mask(
            lambda b, h, i, j: ids[i] == ids[j], None, None, seq, seq, block_q=64, block_kv=128
        )
        return functools.partial(call, mask_mod=same)
    if mask.startswith("window"):
        return functools.partial(call, is_causal=True, local_window_size=(WINDOW, 0))
    return call


def cudnn(mask: str):
    """jax.nn's cuDNN call of the row, or None where cuDNN takes no such mask."""
    nn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
    if mask == "causal":
        return functools.partial(nn, is_causal=True)
    if mask.startswith("window"):
        return functools.partial(nn, is_causal=True, local_window_size=(WINDOW, 0))
    return nn if mask == "no mask" else None


def flex(mask: str, shape: tuple):
    """``(forward, forward+backward)``: steps of torch's compiled FlexAttention on the row."""
    import torch
    from torch.nn.attention import flex_attention as fa

    batch, seq, heads, kv_heads = shape
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(batch, heads, seq, D, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, seq, D, device=device, dtype=torch.bfloat16) for _ in "kv")
    slopes = torch.from_numpy(np.asarray(js.mods.alibi_slopes(heads))).to(device)
    ids = torch.from_numpy(documents(seq)).to(device)
    rules = {
        "causal": lambda b, h, i, j: i >= j,
        "ALiBi": lambda b, h, i, j: i >= j,
        "16 documents": lambda b, h, i, j: ids[i] == ids[j],
        f"window {WINDOW}": lambda b, h, i, j: (i >= j) & (i - j <= WINDOW),
    }
    block_mask = None
    if mask in rules:
        block_mask = fa.create_block_mask(rules[mask], None, None, seq, seq, device=device)
    score_mod = (lambda s, b, h, i, j: s - slopes[h] * (i - j)) if mask == "ALiBi" else None
    attend = torch.compile(fa.flex_attention, dynamic=False)
    gqa = dict(enable_gqa=True) if kv_heads != heads else {}

    def forward():
        with torch.no_grad():
            attend(q, k, v, score_mod=score_mod, block_mask=block_mask, **gqa)

    inputs = [x.detach().requires_grad_() for x in (q, k, v)]

    def forward_backward():
        out = attend(*inputs, score_mod=score_mod, block_mask=block_mask, **gqa)
        torch.autograd.grad(out, inputs, torch.ones_like(out))

    return forward, forward_backward


def _torch_seconds(step, reps: int) -> float:
    """One call's seconds: CUDA events around ``reps`` calls back to back (median of 3)."""
    import torch

    step()  # compiles
    if not torch.cuda.is_available():  # (a rehearsal)
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    rounds = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / reps / 1e3)
    return float(np.median(rounds))


def time_row(shape: tuple, mask: str, kernel, reps: int, rehearse: bool) -> dict:
    """``{(who, backward): seconds}`` of one row: ours, cuDNN's, FlexAttention's."""
    batch, seq, heads, kv_heads = shape
    shape_name = f"B{batch} N{heads} K{kv_heads} T{seq}"
    q = _inputs((batch, seq, heads, D), jnp.bfloat16, seed=1)[0]
    k, v = _inputs((batch, seq, kv_heads, D), jnp.bfloat16)[:2]
    calls = {"ours": ours(mask, seq, heads, kernel)}
    if not rehearse and cudnn(mask) is not None:
        calls["cuDNN"] = cudnn(mask)
    seconds = {}
    for who, fn in calls.items():
        for backward in (False, True):
            program = _forward_backward(fn) if backward else jax.jit(fn)
            try:
                seconds[who, backward] = _call_seconds(program, (q, k, v), reps)
            except Exception as error:  # one case's failure must not lose the others
                print(f"  {shape_name} {mask} {who}: {_failure(error, 200)}", flush=True)
    try:
        steps = flex(mask, shape)
    except Exception as error:  # (torch not installed, say)
        print(f"  {shape_name} {mask} flex: {_failure(error, 200)}", flush=True)
        steps = ()
    for backward, step in enumerate(steps):
        try:
            seconds["flex", bool(backward)] = _torch_seconds(step, reps)
        except Exception as error:
            print(f"  {shape_name} {mask} flex: {_failure(error, 200)}", flush=True)
    return seconds


def print_row(shape_name: str, shape: tuple, mask: str, seconds: dict) -> None:
    batch, seq, heads, _ = shape
    forward = 4 * batch * heads * seq * seq * D * share(mask, seq)
    for backward in (False, True):
        flops = forward * (3.5 if backward else 1.0)
        cells = []
        for who in ("ours", "cuDNN", "flex"):
            s = seconds.get((who, backward))
            cells.append("-" if s is None else f"{s * 1e3:.3f} ({flops / s / 1e12:.0f})")
        mine = seconds.get(("ours", backward))
        ratios = [
            "-"
            if mine is None or (who, backward) not in seconds
            else f"{seconds[who, backward] / mine:.2f}×"
            for who in ("cuDNN", "flex")
        ]
        print(
            f"{shape_name + ' ' + mask:32s} {'fwd+bwd' if backward else 'fwd':8s} "
            + " ".join(f"{c:>18s}" for c in cells + [""])
            + " ".join(f"{r:>10s}" for r in ratios),
            flush=True,
        )


def print_targets(table: dict) -> None:
    """The issue's targets on the measured rows: met or missed, with the ratio."""

    def line(what, ratio, bound, at_least=True):
        if ratio is None:
            return print(f"  {what}: not measured")
        met = ratio >= bound if at_least else ratio <= bound
        print(f"  {what}: {'met' if met else 'MISSED'} ({ratio:.2f}×)")

    def speed(row, backward, other):  # our speed over theirs: their time over ours
        s = table.get(row, {})
        if ("ours", backward) in s and (other, backward) in s:
            return s[other, backward] / s["ours", backward]
        return None

    print("\ntargets:")
    for row in table:
        name = " ".join(row)
        for backward, bound in ((False, 1.0), (True, 0.9)):
            if speed(row, backward, "cuDNN") is not None:
                passes = "fwd+bwd" if backward else "fwd"
                line(f"{name} {passes} ≥ {bound}× cuDNN", speed(row, backward, "cuDNN"), bound)
            if speed(row, backward, "flex") is not None:
                passes = "fwd+bwd" if backward else "fwd"
                line(f"{name} {passes} faster than flex", speed(row, backward, "flex"), 1.0)
    first = "B2 H16 T4096"
    for backward in (False, True):
        alibi, causal = (
            table.get((first, m), {}).get(("ours", backward)) for m in ("ALiBi", "causal")
        )
        ratio = None if alibi is None or causal is None else alibi / causal
        line(f"ALiBi ≤ 1.10× plain causal ({'fwd+bwd' if backward else 'fwd'})", ratio, 1.10, False)
    plain, docs = (
        table.get((first, m), {}).get(("ours", False)) for m in ("no mask", "16 documents")
    )
    line(
        "16 documents ≥ 8× faster than no mask (fwd)",
        None if None in (plain, docs) else plain / docs,
        8.0,
    )


def lower_rows(rows) -> None:
    """Each row's calls of ours lowered for cuda at full size, their Mosaic GPU kernels verified
    (``tests/lowering.py``: on any machine)."""
    from tests.lowering import mosaic_gpu_kernels

    kernel = js.Pallas(backend="mosaic_gpu")
    for shape_name, mask in rows:
        batch, seq, heads, kv_heads = SHAPES[shape_name]
        q = jax.ShapeDtypeStruct((batch, seq, heads, D), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((batch, seq, kv_heads, D), jnp.bfloat16)
        fn = ours(mask, seq, heads, kernel)
        for backward in (False, True):
            program = _forward_backward(fn) if backward else fn
            passes = "fwd+bwd" if backward else "fwd"
            try:
                count = len(mosaic_gpu_kernels(program, q, k, k))
                print(f"  {shape_name:18s} {mask:14s} {passes:8s} {count} kernels lower and verify")
            except Exception as error:  # one case's failure must not lose the others
                print(f"  {shape_name:18s} {mask:14s} {passes:8s} FAILS: {_failure(error, 300)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--deadline", type=float, default=230.0, help="seconds, then stop")
    parser.add_argument("--rehearse", action="store_true", help="tiny shapes, any machine")
    parser.add_argument("--lower", action="store_true", help="lower ours for cuda, run nothing")
    parser.add_argument(
        "--rows", help="which rows, as their indices in the list above (0,4,5): all by default"
    )
    args = parser.parse_args()
    rows = ROWS if args.rows is None else [ROWS[int(i)] for i in args.rows.split(",")]
    if args.lower:
        return lower_rows(rows)
    stop = time.time() + args.deadline
    kernel = js.Pallas(interpret=True) if args.rehearse else js.Pallas(backend="mosaic_gpu")
    print(f"jax {jax.__version__}, devices {jax.devices()}, {kernel}")
    if args.rehearse:
        print("a rehearsal: every row at T = 128, interpreted, no cuDNN (its times mean nothing)")
    print(
        f"\n{'row':32s} {'pass':8s} {'ours ms (TFLOP/s)':>18s} {'cuDNN':>18s} {'flex':>18s} "
        f"{'cuDNN/ours':>10s} {'flex/ours':>10s}"
    )
    table = {}
    for shape_name, mask in rows:
        if time.time() > stop:
            print("deadline reached: the remaining rows were not run")
            break
        shape = SHAPES[shape_name]
        if args.rehearse:  # (every row at T = 128)
            shape = (*shape[:1], 128, *shape[2:])
        table[shape_name, mask] = time_row(shape, mask, kernel, args.reps, args.rehearse)
        print_row(shape_name, shape, mask, table[shape_name, mask])
    print_targets(table)


if __name__ == "__main__":
    main()
