"""Decoding against a KV cache: jax_sdpa's decode path against the memory-bandwidth yardstick.

    python benchmarks/bench_decode.py [--reps 5] [--seqs 8192,32768]
    python benchmarks/bench_decode.py --seqs ""  # the ragged batch and S = 1024 alone

B4 N32 K8 d128 float32, kv lengths per sequence (S, S − 100, S/2, S − 7), everything of one
cache length interleaved in one loop (``bench_speed.interleaved``: fresh random order each
round, each timed call after an untimed one of the same step). The yardstick is a jitted
reduction over the same keys and values (``k.sum(1) + v.sum(1)``): a pass over the cache at the
speed this machine reads memory, measured in the same loop. Rows:

- T = 1, batch 4: ``jax_sdpa.dot_product_attention`` (``implementation=None``, which picks
  ``"decode"``), ``jax.nn.dot_product_attention`` (``"xla"``), PyTorch's SDPA (boolean mask,
  ``enable_gqa``, its own ``(B, K, S, H)`` cache layout) if torch is installed;
- the same paged (``paged_attention``, pages of 16 and 128 in a shuffled page table);
- batch 1 (one sequence: its keys split over the cores);
- T = 16 (speculative decoding, chunked prefill), bottom-right causal, against jax.nn;
- a bfloat16 cache against the float32 one;
- S = 1024 against the dense path (``"xla"``);
- a ragged batch (``ragged_paged_attention``: 8 decoding steps and a 256-query chunk) in one
  call against its two calls apart.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from bench_device_decode import ragged_calls  # this folder is on sys.path as a script
from bench_speed import interleaved

import jax_sdpa

B, N, K, H = 4, 32, 8, 128

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the torch column is left out
    torch = None


def cache(batch, seq, dtype=jnp.float32):
    rngs = jax.random.split(jax.random.key(0), 2)
    k, v = (jax.random.normal(r, (batch, seq, K, H), dtype) for r in rngs)
    lengths = jnp.array([seq, seq - 100, seq // 2, seq - 7][:batch], jnp.int32)
    return k, v, lengths


def queries(batch, t, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(1), (batch, t, N, H), dtype)


def paged(k, v, page_size):
    """The contiguous cache cut into pages, in a shuffled pool, and its page table."""
    batch, seq = k.shape[:2]
    per_sequence = seq // page_size
    order = np.random.default_rng(0).permutation(batch * per_sequence)
    table = jnp.asarray(order.reshape(batch, per_sequence), jnp.int32)
    pool = [jnp.zeros((batch * per_sequence, page_size, K, H), x.dtype) for x in (k, v)]
    pool = [
        p.at[table.reshape(-1)].set(x.reshape(-1, page_size, K, H))
        for p, x in zip(pool, (k, v), strict=True)
    ]
    return (*pool, table)


def steps_for(seq: int) -> tuple[dict, dict]:
    """The timed steps (each a function of no arguments) and the bytes each reads."""
    k, v, lengths = cache(B, seq)
    q = queries(B, 1)
    ours = jax.jit(functools.partial(jax_sdpa.dot_product_attention, key_value_seq_lengths=lengths))
    nn = jax.jit(
        functools.partial(
            jax.nn.dot_product_attention, key_value_seq_lengths=lengths, implementation="xla"
        )
    )
    yardstick = jax.jit(lambda k, v: k.sum(axis=1) + v.sum(axis=1))
    steps = {
        "yardstick": functools.partial(yardstick, k, v),
        "jax_sdpa": functools.partial(ours, q, k, v),
        "jax.nn": functools.partial(nn, q, k, v),
    }
    for page_size in (16, 128):
        key_pages, value_pages, table = paged(k, v, page_size)
        attend = jax.jit(jax_sdpa.paged_attention)
        steps[f"paged {page_size}"] = functools.partial(
            attend, q, key_pages, value_pages, table, lengths
        )
    k1, v1, lengths1 = cache(1, seq)
    steps["yardstick B1"] = functools.partial(yardstick, k1, v1)
    ours1 = jax.jit(
        functools.partial(jax_sdpa.dot_product_attention, key_value_seq_lengths=lengths1)
    )
    steps["jax_sdpa B1"] = functools.partial(ours1, queries(1, 1), k1, v1)
    q16 = queries(B, 16)
    causal = {"is_causal": True, "causal_alignment": "bottom_right"}
    steps["jax_sdpa T16"] = functools.partial(
        jax.jit(functools.partial(jax_sdpa.dot_product_attention, **causal)), q16, k, v
    )
    # jax.nn has no bottom-right causal: the same mask, as an array.
    bottom_right = _bottom_right(16, seq)[None, None]
    steps["jax.nn T16"] = functools.partial(
        jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=bottom_right)), q16, k, v
    )
    kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    steps["jax_sdpa bf16"] = functools.partial(ours, q.astype(jnp.bfloat16), kb, vb)
    if torch is not None:
        tq = torch.from_numpy(np.asarray(q)).transpose(1, 2).contiguous()
        tk, tv = (torch.from_numpy(np.asarray(x)).transpose(1, 2).contiguous() for x in (k, v))
        mask = torch.from_numpy(np.asarray(jnp.arange(seq)[None, :] < lengths[:, None]))
        mask = mask[:, None, None, :]

        def torch_step():
            with torch.no_grad():
                F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)

        steps["torch"] = torch_step
    return steps


def _bottom_right(t: int, s: int):
    return jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t)


def short_steps(seq: int = 1024) -> dict:
    k, v, lengths = cache(B, seq)
    q = queries(B, 1)
    attend = functools.partial(jax_sdpa.dot_product_attention, key_value_seq_lengths=lengths)
    return {
        "jax_sdpa": functools.partial(jax.jit(attend), q, k, v),
        "xla": functools.partial(jax.jit(functools.partial(attend, implementation="xla")), q, k, v),
    }


def ragged_steps(seq: int = 2048, chunk: int = 256) -> dict:
    """8 decoding steps and a ``chunk``-query prefill chunk (pages of 64), float32: one
    ``ragged_paged_attention`` call, and ``paged_attention`` twice, apart
    (``bench_device_decode.ragged_calls``, the device's)."""
    calls = ragged_calls(seq, chunk, dtype=jnp.float32)
    return {
        name.removeprefix("ragged, "): functools.partial(jax.jit(fn), *args)
        for name, (fn, args) in calls.items()
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seqs", default="8192,32768")
    args = parser.parse_args()
    print(
        f"# B{B} N{N} K{K} d{H}, T = 1 unless said; jax {jax.__version__}"
        + (
            ""
            if torch is None
            else f", torch {torch.__version__} ({torch.get_num_threads()} threads)"
        )
        + "; median ms"
    )
    print(
        "\n| S | yardstick (GB/s) | jax_sdpa (% of yardstick) | jax.nn / jax_sdpa | torch / jax_sdpa "
        "| paged 16 / contiguous | paged 128 / contiguous | B1: jax_sdpa (% of its yardstick) "
        "| T16: jax.nn / jax_sdpa | bf16 / f32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seq in map(int, filter(None, args.seqs.split(","))):  # (--seqs "": none)
        steps = steps_for(seq)
        for step in steps.values():
            jax.block_until_ready(step())
        t = {n: float(np.median(x)) for n, x in interleaved(steps, (), args.reps).items()}
        gigabytes = 2 * B * seq * K * H * 4 / 1e9
        ours = t["jax_sdpa"]
        torch_ratio = "—" if "torch" not in t else f"{t['torch'] / ours:.2f}×"
        print(
            f"| {seq} | {1e3 * t['yardstick']:.1f} ({gigabytes / t['yardstick']:.1f}) "
            f"| {1e3 * ours:.1f} ({100 * t['yardstick'] / ours:.0f}%) | {t['jax.nn'] / ours:.2f}× "
            f"| {torch_ratio} | {t['paged 16'] / ours:.2f}× | {t['paged 128'] / ours:.2f}× "
            f"| {1e3 * t['jax_sdpa B1']:.1f} ({100 * t['yardstick B1'] / t['jax_sdpa B1']:.0f}%) "
            f"| {t['jax.nn T16'] / t['jax_sdpa T16']:.2f}× | {t['jax_sdpa bf16'] / ours:.2f}× |",
            flush=True,
        )
    steps = ragged_steps()
    for step in steps.values():
        jax.block_until_ready(step())
    t = {n: float(np.median(x)) for n, x in interleaved(steps, (), args.reps).items()}
    print(
        f"\nragged, 8 decoding steps and a 256-query chunk (S 2048, pages of 64): one call "
        f"{1e3 * t['one call']:.1f} ms, two calls {1e3 * t['two calls']:.1f} ms: "
        f"{t['one call'] / t['two calls']:.2f}× the two calls' time"
    )
    t = {n: float(np.median(x)) for n, x in interleaved(short_steps(), (), args.reps).items()}
    print(
        f"\nS = 1024: jax_sdpa {1e3 * t['jax_sdpa']:.2f} ms, dense (xla) {1e3 * t['xla']:.2f} ms: "
        f"{t['xla'] / t['jax_sdpa']:.2f}× the dense path's speed"
    )


if __name__ == "__main__":
    main()
