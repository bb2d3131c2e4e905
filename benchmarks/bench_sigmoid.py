"""Sigmoid attention and the max-score output on the chunked path: time and memory against softmax.

    python benchmarks/bench_sigmoid.py [--seq 4096] [--reps 5] [--memory-seq 65536]

B1 H8 d64 float32, causal and not, forward and forward+backward, every variant interleaved in
one loop (``bench_speed.interleaved``: fresh random order each round, medians): the chunked
path with the softmax, with the sigmoid, and each with ``return_max_scores=True``. Ratios are to
the softmax chunked call of the same mode (for "sigmoid + max", to the sigmoid call); the
targets are sigmoid ≤ 1.0× and max scores ≤ 1.03×. A float32 GEMM timed in the same loop gives
the machine's own yardstick. Then the memory of one sigmoid forward at ``--memory-seq`` (one
head), target ≤ 64 MiB: its RSS growth in a fresh process (as ``bench_memory.rss``), which
reads about 0 when the allocator already holds enough freed pages, and what XLA's compiler
counts for the output and temporaries.
"""

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_speed import compiled, interleaved  # noqa: E402

import jax_sdpa  # noqa: E402

VARIANTS = {
    "softmax": {},
    "sigmoid": {"normalizer": "sigmoid"},
    "softmax + max": {"return_max_scores": True},
    "sigmoid + max": {"normalizer": "sigmoid", "return_max_scores": True},
}


def attention(is_causal: bool, **keywords):
    """The chunked call; with ``return_max_scores``, ``(out, max_scores)``."""
    return functools.partial(
        jax_sdpa.dot_product_attention, implementation="chunked", is_causal=is_causal, **keywords
    )


def speed(seq: int, is_causal: bool, mode: str, reps: int) -> dict:
    keys = jax.random.split(jax.random.key(0), 3)
    args = [jax.random.normal(r, (1, seq, 8, 64), jnp.float32) for r in keys]
    steps = {
        name: compiled(attention(is_causal, **keywords), mode, args)[0]
        for name, keywords in VARIANTS.items()
    }
    a, b = (jax.random.normal(r, (2048, 2048), jnp.float32) for r in keys[:2])
    gemm = jax.jit(jnp.matmul)
    steps["gemm"] = lambda *_: gemm(a, b)
    times = {name: float(np.median(t)) for name, t in interleaved(steps, args, reps).items()}
    return times


def rss_child(seq: int) -> None:
    """In a fresh process: the RSS growth of one sigmoid forward (one head, d = 64)."""
    from bench_memory import _status_kib

    fn = jax.jit(attention(False, normalizer="sigmoid"))
    shape = jax.ShapeDtypeStruct((1, seq, 1, 64), jnp.float32)
    step = fn.lower(shape, shape, shape).compile()
    args = [
        jax.block_until_ready(jax.random.normal(jax.random.key(i), shape.shape)) for i in (0, 1, 2)
    ]
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    seconds = time.perf_counter() - start
    analysis = step.memory_analysis()
    xla_mib = (analysis.output_size_in_bytes + analysis.temp_size_in_bytes) / 2**20
    rss_mib = (_status_kib("VmHWM") - before) / 1024
    print(json.dumps({"rss_mib": rss_mib, "xla_mib": xla_mib, "seconds": seconds}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--memory-seq", type=int, default=65536)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return rss_child(args.child)
    print(f"# B1 H8 T{args.seq} d64 float32, chunked; median ms, interleaved ({jax.devices()[0]})")
    print(
        "| causal | mode | softmax | sigmoid | ratio | softmax + max | ratio | sigmoid + max "
        "| ratio | f32 GEMM 2048³ |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for is_causal in (False, True):
        for mode in ("fwd", "fwd+bwd"):
            t = speed(args.seq, is_causal, mode, args.reps)
            ms = {name: 1e3 * x for name, x in t.items()}
            print(
                f"| {is_causal} | {mode} | {ms['softmax']:.1f} | {ms['sigmoid']:.1f} "
                f"| {t['sigmoid'] / t['softmax']:.3f} | {ms['softmax + max']:.1f} "
                f"| {t['softmax + max'] / t['softmax']:.3f} | {ms['sigmoid + max']:.1f} "
                f"| {t['sigmoid + max'] / t['sigmoid']:.3f} "
                f"| {ms['gemm']:.1f} ({2 * 2048**3 / t['gemm'] / 1e9:.0f} GFLOP/s) |",
                flush=True,
            )
    child = subprocess.run(
        [sys.executable, __file__, "--child", str(args.memory_seq)],
        capture_output=True,
        text=True,
        check=True,
    )
    memory = json.loads(child.stdout.strip().splitlines()[-1])
    print(
        f"\n# sigmoid forward, one head, T = {args.memory_seq} (target ≤ 64 MiB): RSS growth "
        f"{memory['rss_mib']:.1f} MiB, XLA's output + temporaries {memory['xla_mib']:.1f} MiB, "
        f"{memory['seconds']:.2f} s"
    )


if __name__ == "__main__":
    main()
