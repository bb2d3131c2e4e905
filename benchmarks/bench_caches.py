"""Serving caches: quantized, shared-latent and paged caches, and attention over selected keys.

    python benchmarks/bench_caches.py [--reps 5] [--seqs 8192,32768] [--prefill 8192]

Decoding (T = 1) reads the whole cache for one token, so its speed is bytes per second: every
row is a ratio to a yardstick measured in the same interleaved loop (``bench_speed.interleaved``),
a jitted reduction over the same bytes. Two yardsticks, both printed: ``k.sum(1), v.sum(1)`` (two
outputs, the issue's) and ``k.sum(1) + v.sum(1)`` (one, BENCHMARKS' decode section's).

- B4 N32 K8 d128, kv lengths S, S − 100, S/2, S − 7: the float32 cache; int8 and float8 caches
  (``jax_sdpa.quantize``) and a bfloat16 one, against it; paged caches of pages 16 and 128;
  top-k attention (``key_indices``, k = 2048 per query) against the full decode.
- MLA (absorbed decode): N = 128 query heads, one latent head of 576 features whose first 512
  are the values (``LatentValues(512)``), against one pass of the yardstick over the latent cache.
- Prefill (B1 N8 d64, T = S = ``--prefill``, the chunked path, forward): a block list with 1/16
  of the key blocks per query block (``BlockMask.from_kv_blocks``) against no mask.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from bench_decode import B, cache, paged, queries  # this folder is on sys.path
from bench_speed import interleaved

import jax_sdpa as js

TOP_K = 2048


def decode_steps(seq: int) -> dict:
    """Each timed step, a function of no arguments, at kv length ``seq``."""
    k, v, lengths = cache(B, seq)
    q = queries(B, 1)
    attend = jax.jit(functools.partial(js.dot_product_attention, key_value_seq_lengths=lengths))
    two = jax.jit(lambda k, v: (k.sum(axis=1), v.sum(axis=1)))
    one = jax.jit(lambda k, v: k.sum(axis=1) + v.sum(axis=1))
    steps = {
        "yardstick (2 sums)": functools.partial(two, k, v),
        "yardstick (1 sum)": functools.partial(one, k, v),
        "float32": functools.partial(attend, q, k, v),
        "bfloat16": functools.partial(
            attend, q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
        ),
    }
    for fmt in ("int8", "float8_e4m3fn"):
        steps[fmt] = functools.partial(attend, q, js.quantize(k, fmt), js.quantize(v, fmt))
    for page_size in (16, 128):
        key_pages, value_pages, table = paged(k, v, page_size)
        pages = jax.jit(js.paged_attention)
        steps[f"paged {page_size}"] = functools.partial(
            pages, q, key_pages, value_pages, table, lengths
        )
    # Top-k: the indices an indexer would pick, here random and sorted, within each length.
    picks = jax.random.randint(jax.random.key(2), (B, 1, TOP_K), 0, lengths[:, None, None])
    selected = jax.jit(lambda q, k, v, i: js.dot_product_attention(q, k, v, key_indices=i))
    steps["top-k"] = functools.partial(selected, q, k, v, picks)
    return steps


def mla_steps(seq: int) -> dict:
    latent = jax.random.normal(jax.random.key(0), (B, seq, 1, 576), jnp.float32)
    q = jax.random.normal(jax.random.key(1), (B, 1, 128, 576), jnp.float32)
    attend = jax.jit(lambda q, c: js.dot_product_attention(q, c, js.LatentValues(512)))
    # The same flops as the two products (128 heads against the B·S latent rows), as two plain
    # matrix products: what this machine's GEMM does with them.
    gemm = jax.jit(lambda a, c: (a @ c.reshape(-1, 576).T) @ c.reshape(-1, 576)[:, :512])
    return {
        "yardstick": functools.partial(jax.jit(lambda c: c.sum(axis=1)), latent),
        "GEMM": functools.partial(gemm, q[0, 0], latent),
        "MLA": functools.partial(attend, q, latent),
    }


def prefill_steps(seq: int) -> dict:
    block = js.Chunked().block_kv
    blocks = seq // block
    q, k, v = (jax.random.normal(jax.random.key(i), (1, seq, 8, 64), jnp.float32) for i in range(3))
    listed = max(1, blocks // 16)
    lists = jax.random.randint(jax.random.key(3), (1, 1, blocks, listed), 0, blocks)
    counts = jnp.full((1, 1, blocks), listed, jnp.int32)
    block_mask = js.BlockMask.from_kv_blocks(
        counts, lists, q_len=seq, kv_len=seq, block_q=js.Chunked().block_q, block_kv=block
    )
    attend = jax.jit(functools.partial(js.dot_product_attention, implementation="chunked"))
    masked = jax.jit(
        lambda q, k, v, m: js.dot_product_attention(q, k, v, mask_mod=m, implementation="chunked")
    )
    return {
        "no mask": functools.partial(attend, q, k, v),
        f"{listed} of {blocks} blocks": functools.partial(masked, q, k, v, block_mask),
    }


def medians(steps: dict, reps: int) -> dict:
    for step in steps.values():
        jax.block_until_ready(step())
    return {n: float(np.median(x)) for n, x in interleaved(steps, (), reps).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seqs", default="8192,32768")
    parser.add_argument("--prefill", type=int, default=8192)
    args = parser.parse_args()
    print(f"# jax {jax.__version__}; median ms; ratios to the float32 cache unless said\n")
    print(
        "| S | yardstick 2 sums / 1 sum (ms) | float32 (% of each) | int8 speed-up | float8 "
        "speed-up | bf16 / f32 time | paged 16 / contiguous | paged 128 / contiguous "
        f"| top-{TOP_K} speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for seq in map(int, args.seqs.split(",")):
        t = medians(decode_steps(seq), args.reps)
        f32, two, one = t["float32"], t["yardstick (2 sums)"], t["yardstick (1 sum)"]
        print(
            f"| {seq} | {1e3 * two:.1f} / {1e3 * one:.1f} | {1e3 * f32:.1f} "
            f"({100 * two / f32:.0f}% / {100 * one / f32:.0f}%) | {f32 / t['int8']:.2f}× "
            f"| {f32 / t['float8_e4m3fn']:.2f}× | {t['bfloat16'] / f32:.2f}× "
            f"| {t['paged 16'] / f32:.2f}× | {t['paged 128'] / f32:.2f}× "
            f"| {f32 / t['top-k']:.2f}× |",
            flush=True,
        )
    seq = max(map(int, args.seqs.split(",")))
    t = medians(mla_steps(seq), args.reps)
    flops = 2 * B * 128 * seq * (576 + 512)
    print(
        f"\nMLA (B{B} N128, one latent head 576 / 512, S = {seq}): {1e3 * t['MLA']:.1f} ms, "
        f"{t['MLA'] / t['yardstick']:.2f}× one pass of the yardstick over the latent cache "
        f"({1e3 * t['yardstick']:.1f} ms); {flops / t['MLA'] / 1e9:.0f} GFLOP/s, "
        f"{t['MLA'] / t['GEMM']:.2f}× two plain matrix products of the same flops "
        f"({flops / t['GEMM'] / 1e9:.0f} GFLOP/s: the GEMM limit)",
        flush=True,
    )
    t = medians(prefill_steps(args.prefill), args.reps)
    (plain, full), (listed, part) = t.items()
    print(
        f"\nPrefill B1 N8 d64 T = S = {args.prefill}, chunked forward: {plain} "
        f"{1e3 * full:.0f} ms, {listed} {1e3 * part:.0f} ms: {full / part:.1f}× faster"
    )


if __name__ == "__main__":
    main()
