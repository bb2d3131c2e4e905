"""Your own attention variant, here and in PyTorch's FlexAttention, forward, in one process.

    python benchmarks/bench_flex.py [--reps 5] [--seq 4096]

Needs ``torch`` (not a dependency of jax_sdpa: ``pip install torch``). B1 H8 d64 float32 on the
CPU, forward only (FlexAttention has no CPU backward): ``torch.compile(flex_attention)`` against
``jax_sdpa.dot_product_attention(..., implementation="chunked")`` jitted, with the same mods
written the same way (ALiBi as a ``score_mod``, causal as a ``mask_mod``; each library's own
``create_block_mask`` for the causal cases, built once outside the timed calls), and
``torch.nn.functional.scaled_dot_product_attention`` (no mods: its fused kernel) for scale. All
run interleaved (``bench_speed.interleaved``: fresh random order each round, each timed call
after an untimed one of the same step).
"""

import argparse
import functools

import jax
import numpy as np
import torch
import torch.nn.functional as F
from bench_speed import interleaved  # this folder is on sys.path as a script
from torch.nn.attention import flex_attention as flex

import jax_sdpa
from jax_sdpa import mods

HEADS, DIM = 8, 64


def jax_steps(seq: int) -> dict:
    x = jax.random.normal(jax.random.key(0), (1, seq, HEADS, DIM))
    slopes = mods.alibi_slopes(HEADS)

    def alibi(score, batch, head, q_idx, kv_idx):
        return score + slopes[head] * (kv_idx - q_idx).astype(score.dtype)

    def causal(batch, head, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = jax_sdpa.create_block_mask(causal, None, None, seq, seq)
    sdpa = functools.partial(jax_sdpa.dot_product_attention, implementation="chunked")
    variants = {
        "plain": sdpa,
        "alibi": functools.partial(sdpa, score_mod=alibi),
        "causal": functools.partial(sdpa, mask_mod=block_mask),
        "alibi+causal": functools.partial(sdpa, score_mod=alibi, mask_mod=block_mask),
    }
    steps = {name: functools.partial(jax.jit(fn), x, x, x) for name, fn in variants.items()}
    for step in steps.values():
        jax.block_until_ready(step())
    return steps


def torch_steps(seq: int) -> dict:
    x = torch.randn(1, HEADS, seq, DIM)
    slopes = torch.from_numpy(np.asarray(mods.alibi_slopes(HEADS)))

    def alibi(score, batch, head, q_idx, kv_idx):
        return score + slopes[head] * (kv_idx - q_idx)

    def causal(batch, head, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = flex.create_block_mask(causal, None, None, seq, seq, device="cpu")
    attend = torch.compile(flex.flex_attention)
    variants = {
        "flex plain": {},
        "flex alibi": {"score_mod": alibi},
        "flex causal": {"block_mask": block_mask},
        "flex alibi+causal": {"score_mod": alibi, "block_mask": block_mask},
    }

    def step(fn, **kwargs):
        with torch.no_grad():
            fn(x, x, x, **kwargs)

    steps = {name: functools.partial(step, attend, **kw) for name, kw in variants.items()}
    steps["sdpa plain"] = functools.partial(step, F.scaled_dot_product_attention)
    steps["sdpa causal"] = functools.partial(step, F.scaled_dot_product_attention, is_causal=True)
    for fn in steps.values():
        fn()  # compiles
    return steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    steps = {**jax_steps(args.seq), **torch_steps(args.seq)}
    median = {n: 1e3 * float(np.median(t)) for n, t in interleaved(steps, (), args.reps).items()}
    print(
        f"# T = {args.seq}, B1 H{HEADS} d{DIM} f32, forward; jax {jax.__version__}, torch "
        f"{torch.__version__} ({torch.get_num_threads()} threads); median ms of {args.reps}"
    )
    print(
        "\n| variant | jax_sdpa chunked | torch.compile(flex_attention) | flex / jax_sdpa | "
        "torch SDPA (no mods) |"
    )
    print("|---|---|---|---|---|")
    for name in ("plain", "alibi", "causal", "alibi+causal"):
        ours, theirs = median[name], median[f"flex {name}"]
        sdpa = median["sdpa causal" if "causal" in name else "sdpa plain"]
        print(f"| {name} | {ours:.0f} | {theirs:.0f} | {theirs / ours:.2f}× | {sdpa:.0f} |")


if __name__ == "__main__":
    main()
