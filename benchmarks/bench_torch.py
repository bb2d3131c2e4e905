"""The next mark: jax_sdpa's chunked path against PyTorch's fused CPU attention, in one process.

    python benchmarks/bench_torch.py [--reps 9] [--seqs 512,1024,2048,4096] [--out benchmarks/results]

Needs ``torch`` (not a dependency of jax_sdpa: ``pip install torch``). B1 H8 d64 float32,
causal and not, forward and forward+backward: ``jax_sdpa.dot_product_attention(...,
implementation="chunked")`` jitted, and ``torch.nn.functional.scaled_dot_product_attention`` on
``(B, N, T, d)`` tensors, which on a CPU runs PyTorch's fused flash-attention kernel (C++, each
thread on its own cache-sized block of one head). Both run interleaved with an f32 GEMM of 2048²
in each framework (``bench_speed.interleaved``: fresh random order each round, each timed call
after an untimed one of the same step). Each attention is given as a % of its own framework's
GEMM and of JAX's, from the analytic flop count of ``bench_speed``.
"""

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from bench_speed import compiled, flops, interleaved  # this folder is on sys.path as a script

import jax_sdpa

HEADS, DIM = 8, 64


def jax_step(seq: int, is_causal: bool, mode: str):
    x = jax.random.normal(jax.random.key(0), (1, seq, HEADS, DIM))
    fn = functools.partial(
        jax_sdpa.dot_product_attention, implementation="chunked", is_causal=is_causal
    )
    step, _ = compiled(fn, mode, (x, x, x))
    return functools.partial(step, x, x, x)


def torch_step(seq: int, is_causal: bool, mode: str):
    x = torch.randn(1, HEADS, seq, DIM)
    attend = functools.partial(F.scaled_dot_product_attention, is_causal=is_causal)
    if mode == "fwd":

        def step():
            with torch.no_grad():
                attend(x, x, x)

        return step
    q, k, v = (x.clone().requires_grad_() for _ in range(3))

    def step():
        torch.autograd.grad(attend(q, k, v).sum(), (q, k, v))

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--seqs", default="512,1024,2048,4096")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    a = jax.random.normal(jax.random.key(1), (2048, 2048))
    b = torch.randn(2048, 2048)
    gemms = {"jax gemm": functools.partial(jax.jit(jnp.matmul), a, a), "torch gemm": lambda: b @ b}
    print(
        f"# B1 H{HEADS} d{DIM} f32; torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"jax {jax.__version__}; median ms, % of the framework's own 2048² GEMM"
    )
    print(
        "\n| mode | T | causal | jax_sdpa chunked | torch SDPA | torch vs jax_sdpa | "
        "torch, % of JAX's GEMM | GEMM GF/s jax / torch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for mode in args.modes.split(","):
        for seq in (int(s) for s in args.seqs.split(",")):
            for is_causal in (False, True):
                steps = {
                    "jax_sdpa": jax_step(seq, is_causal, mode),
                    "torch": torch_step(seq, is_causal, mode),
                    **gemms,
                }
                median = {
                    n: float(np.median(t)) for n, t in interleaved(steps, (), args.reps).items()
                }
                rate = {fw: 2 * 2048**3 / median.pop(f"{fw} gemm") / 1e9 for fw in ("jax", "torch")}
                gflop = flops(1, HEADS, seq, DIM, is_causal, mode) / 1e9
                row = {
                    "mode": mode,
                    "seq": seq,
                    "causal": is_causal,
                    "jax_sdpa_ms": 1e3 * median["jax_sdpa"],
                    "torch_ms": 1e3 * median["torch"],
                    "jax_sdpa_pct_gemm": 100 * gflop / median["jax_sdpa"] / rate["jax"],
                    "torch_pct_gemm": 100 * gflop / median["torch"] / rate["torch"],
                    "torch_pct_jax_gemm": 100 * gflop / median["torch"] / rate["jax"],
                    "gemm_gflops": rate,
                }
                rows.append(row)
                print(
                    f"| {mode} | {seq} | {'yes' if is_causal else 'no'} | "
                    f"{row['jax_sdpa_ms']:.1f} ({row['jax_sdpa_pct_gemm']:.0f}%) | "
                    f"{row['torch_ms']:.1f} ({row['torch_pct_gemm']:.0f}%) | "
                    f"{median['jax_sdpa'] / median['torch']:.2f}× | "
                    f"{row['torch_pct_jax_gemm']:.0f}% | {rate['jax']:.0f} / {rate['torch']:.0f} |",
                    flush=True,
                )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "torch.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
