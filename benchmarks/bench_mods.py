"""What a score_mod, a mask_mod or sinks cost on the chunked path, against the same call without.

    python benchmarks/bench_mods.py [--reps 7] [--seqs 1024,4096] [--modes fwd,fwdbwd]

B1 H8 d64 float32, ``implementation="chunked"``, everything of one sequence length interleaved in
one loop (``bench_speed.interleaved``: fresh random order each round, each timed call after an
untimed one of the same step); ratios are against the plain call of the same loop:

- ALiBi as a ``score_mod`` (``jax_sdpa.mods.alibi``) against no mod, causal and not;
- a causal ``mask_mod`` written as a lambda against ``is_causal=True``;
- ``sinks`` against no sinks;
- a document mask (16 documents, causal, as a ``mask_mod``) against no mask at all: the ratio
  block skipping would bring (16 documents: 1/16 of the tiles); the same mask as a
  ``jax_sdpa.create_block_mask`` built once, outside the timed calls.

``--ratios documents`` (names from the first column of ``RATIOS``) times only those.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from bench_speed import compiled, inputs, interleaved  # this folder is on sys.path as a script

import jax_sdpa
from jax_sdpa import mods

HEADS, DIM = 8, 64


def variants(seq: int) -> dict:
    sdpa = functools.partial(jax_sdpa.dot_product_attention, implementation="chunked")
    alibi = mods.alibi(mods.alibi_slopes(HEADS))
    doc = jnp.repeat(jnp.arange(16), seq // 16)[None]
    documents = mods.and_masks(mods.document_mask(doc), lambda b, h, i, j: j <= i)
    block_mask = jax_sdpa.create_block_mask(documents, 1, None, seq, seq)
    return {
        "plain": sdpa,
        "alibi": functools.partial(sdpa, score_mod=alibi),
        "causal": functools.partial(sdpa, is_causal=True),
        "alibi+causal": functools.partial(sdpa, score_mod=alibi, is_causal=True),
        "causal lambda": functools.partial(sdpa, mask_mod=lambda b, h, i, j: j <= i),
        "sinks": functools.partial(sdpa, sinks=jnp.zeros(HEADS)),
        "documents": functools.partial(sdpa, mask_mod=documents),
        "block mask": functools.partial(sdpa, mask_mod=block_mask),
    }


# (name, baseline): each variant's time over its baseline's, in the same loop.
RATIOS = [
    ("alibi", "plain"),
    ("alibi+causal", "causal"),
    ("causal lambda", "causal"),
    ("sinks", "plain"),
    ("documents", "plain"),
    ("block mask", "plain"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seqs", default="1024,4096")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--ratios", default=",".join(n for n, _ in RATIOS))
    args = parser.parse_args()
    ratios = [(n, b) for n, b in RATIOS if n in args.ratios.split(",")]
    names = {name for pair in ratios for name in pair}
    print(f"# jax {jax.__version__}, B1 H{HEADS} d{DIM} f32, chunked; median ms, ratio to baseline")
    print("\n| T | mode | " + " | ".join(f"{n} / {b}" for n, b in ratios) + " |")
    print("|---|---|" + "---|" * len(ratios))
    for seq in map(int, args.seqs.split(",")):
        data = inputs(1, HEADS, seq, DIM)
        for mode in args.modes.split(","):
            chosen = {name: fn for name, fn in variants(seq).items() if name in names}
            steps = {name: compiled(fn, mode, data)[0] for name, fn in chosen.items()}
            times = {n: float(np.median(t)) for n, t in interleaved(steps, data, args.reps).items()}
            cells = [
                f"{1e3 * times[n]:.0f} / {1e3 * times[b]:.0f} = {times[n] / times[b]:.2f}×"
                for n, b in ratios
            ]
            print(f"| {seq} | {mode} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
