"""Generating text with a KV cache, contiguous and paged, checked against the full forward.

    python examples/generate.py [--tokens 64] [--batch 4] [--cache int8] [--kernel K]
                                [--dtype bfloat16] [--short]

A tiny decoder-only transformer in plain JAX (random weights: the tokens are noise, the point is
the cache) prefills a prompt, then generates greedily one token at a time. Each step writes its
keys and values into the cache (``jax_sdpa.update_cache`` or ``jax_sdpa.update_paged_cache``,
jitted with the cache donated) and attends only with the new query
(``jax_sdpa.dot_product_attention``, which picks its decode path, or
``jax_sdpa.paged_attention``). At every step the logits must equal those of the whole
sequence run through the model from scratch with causal attention; the tokens per second of
each cache are printed. ``--short`` is the test suite's run.

``--cache int8`` (or ``float8_e4m3fn``) stores the caches quantized (``jax_sdpa.quantize``; the
writers quantize each new token's keys and values). The full forward then rounds its keys and
values the same way, so the logits still match, within one rounding step of the format
(``tolerance``); how far they moved from the unquantized model's is printed. ``--kernel
mosaic_gpu`` (or ``triton``, or ``interpret``: the Pallas interpreter, on any machine) runs the
cached steps' attention on the fused kernel (``implementation=Pallas(...)``, and
``Paged(kernel=...)`` for the paged cache), checked against the same full forward: with an 8-bit
cache too, which the Mosaic GPU kernel reads as it is. ``--dtype bfloat16`` runs the model and
its caches in bfloat16, as the Mosaic GPU kernel takes them (in float32 it hands the call to
Triton); the heads are then 64 wide, the kernel's narrowest.
"""

import argparse
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import jax_sdpa


class Config(NamedTuple):
    vocab: int = 256
    width: int = 256
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2  # grouped-query attention: 4 query heads per key/value head
    head_dim: int = 32
    max_len: int = 1024
    cache: str = "plain"  # the model's dtype, or a jax_sdpa.quantize format
    kernel: str | None = None  # attention on the fused kernel: "mosaic_gpu", "triton", "interpret"
    dtype: str = "float32"  # the model's, and its plain caches'


def kernel(config: Config) -> "jax_sdpa.Pallas | None":
    """The fused kernel ``config.kernel`` names (the Pallas interpreter for ``"interpret"``)."""
    if config.kernel is None:
        return None
    if config.kernel == "interpret":
        return jax_sdpa.Pallas(interpret=True)
    return jax_sdpa.Pallas(backend=config.kernel)


def init(rng, config: Config) -> dict:
    """Random weights, scaled so that activations stay of order one."""
    c = config
    keys = iter(jax.random.split(rng, 4 + 6 * c.layers))

    def dense(*shape):
        return jax.random.normal(next(keys), shape) / np.sqrt(shape[0])

    layers = [
        {
            "q": dense(c.width, c.heads * c.head_dim),
            "k": dense(c.width, c.kv_heads * c.head_dim),
            "v": dense(c.width, c.kv_heads * c.head_dim),
            "o": dense(c.heads * c.head_dim, c.width),
            "up": dense(c.width, 4 * c.width),
            "down": dense(4 * c.width, c.width),
        }
        for _ in range(c.layers)
    ]
    embed = jax.random.normal(next(keys), (c.vocab, c.width))
    positions = 0.1 * jax.random.normal(next(keys), (c.max_len, c.width))
    params = {"embed": embed, "positions": positions, "layers": layers}
    return jax.tree.map(lambda x: x.astype(c.dtype), params)


def _norm(x):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _block(layer, x, attend, config: Config):
    """One pre-norm layer; ``attend(q, k, v) -> out`` is the only difference between the modes."""
    *lead, _ = x.shape
    h = _norm(x)
    q = (h @ layer["q"]).reshape(*lead, config.heads, config.head_dim)
    k = (h @ layer["k"]).reshape(*lead, config.kv_heads, config.head_dim)
    v = (h @ layer["v"]).reshape(*lead, config.kv_heads, config.head_dim)
    x = x + attend(q, k, v).reshape(*lead, -1) @ layer["o"]
    return x + jax.nn.gelu(_norm(x) @ layer["up"]) @ layer["down"]


def _logits(params, x):
    return _norm(x) @ params["embed"].T


@functools.partial(jax.jit, static_argnames="config")
def full_forward(params, tokens, config: Config):
    """Logits of every position, from scratch: causal attention over the whole sequence."""
    x = params["embed"][tokens] + params["positions"][: tokens.shape[1]]

    def attend(q, k, v):
        if config.cache != "plain":  # as the cache stores them (float8: with the cache's scale)
            k, v = (rounded(x, config) for x in (k, v))
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True)

    for layer in params["layers"]:
        x = _block(layer, x, attend, config)
    return _logits(params, x)


def rounded(x, config: Config):
    """``x`` as a cache of ``config.cache`` stores it: quantized and back."""
    scale = None if config.cache == "int8" else FLOAT8_SCALE
    return jax_sdpa.quantize(x, config.cache, scale=scale).dequantize()


# A float8 cache's scale is fixed when it is made: one that covers this model's keys and values.
FLOAT8_SCALE = 8 / 448


def empty_cache(shape, config: Config):
    """A cache of zeros in ``config.cache``'s format."""
    if config.cache == "plain":
        return jnp.zeros(shape, config.dtype)
    scale = None if config.cache == "int8" else FLOAT8_SCALE
    return jax_sdpa.quantize(jnp.zeros(shape, config.dtype), config.cache, scale=scale)


def contiguous_step(params, cache, tokens, lengths, config: Config):
    """Logits of ``tokens`` (B, T), the positions ``lengths − T`` onwards, with a contiguous cache.

    ``cache`` holds ``(B, max_len, K, H)`` keys and values per layer; ``lengths`` counts the
    positions once these tokens are in.
    """
    t = tokens.shape[1]
    x = params["embed"][tokens] + params["positions"][lengths[:, None] - t + jnp.arange(t)]
    new_cache = []
    for layer, (key_cache, value_cache) in zip(params["layers"], cache, strict=True):

        def attend(q, k, v, layer_cache=(key_cache, value_cache)):
            written = jax_sdpa.update_cache(*layer_cache, k, v, lengths - t)
            new_cache.append(written)

            def at_the_end(batch, head, q_idx, kv_idx):  # the queries end at the length
                return kv_idx <= q_idx + lengths[batch] - t

            return jax_sdpa.dot_product_attention(
                q,
                *written,
                key_value_seq_lengths=lengths,
                mask_mod=at_the_end,
                implementation=kernel(config),
            )

        x = _block(layer, x, attend, config)
    return _logits(params, x), new_cache


def paged_step(params, pages, table, tokens, lengths, config: Config):
    """The same with a paged cache: ``pages`` holds each layer's key and value pools."""
    t = tokens.shape[1]
    x = params["embed"][tokens] + params["positions"][lengths[:, None] - t + jnp.arange(t)]
    new_pages = []
    for layer, layer_pages in zip(params["layers"], pages, strict=True):

        def attend(q, k, v, layer_pages=layer_pages):
            written = jax_sdpa.update_paged_cache(*layer_pages, k, v, table, lengths - t)
            new_pages.append(written)
            pallas = kernel(config)
            paged = None if pallas is None else jax_sdpa.Paged(kernel=pallas)
            return jax_sdpa.paged_attention(q, *written, table, lengths, implementation=paged)

        x = _block(layer, x, attend, config)
    return _logits(params, x), new_pages


def tolerance(full, config: Config) -> float:
    """float32 rounding; with a quantized cache, 2^-8 of the logits' largest; bfloat16's, 2^-6.

    The cached step and the full forward compute each key and value in another order, so they
    differ in the last bit; where that tips an element to the neighbouring 8-bit value, it moves
    by one step of the format, and the logits with it. The bound is half an int8 step (1/127 of
    a row's largest) relative to the logits' largest, 2^-8; measured: up to 1.2e-4 (int8). In
    bfloat16 the two orders differ by its own rounding, a few of its steps (2^-8 each) of the
    logits' largest: measured (``--short``) 1.3e-3 with a bfloat16 cache and 5.1e-3 (int8),
    5.2e-3 (float8) with an 8-bit one on the XLA paths.
    """
    if config.dtype == "bfloat16":
        return 2.0**-6 * float(jnp.abs(full).max())
    if config.cache == "plain":
        return 2e-4
    return 2.0**-8 * float(jnp.abs(full).max())


def generate(step, state, params, prompt, steps: int, config: Config, check: bool, name: str):
    """Prefill, then greedy tokens one by one; each step's logits checked against the full run."""
    tokens = prompt
    lengths = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)
    logits, state = step(params, state, prompt, lengths)
    generating = 0.0  # seconds in the steps, not in the checks
    for _ in tqdm(range(steps), desc=name, leave=False):
        if check:  # every position so far, from scratch: the last ones are this step's
            # Padded to a multiple of 64 (fewer shapes to compile): causal, so the padding
            # after the tokens changes none of their logits.
            padded = jnp.pad(tokens, ((0, 0), (0, -tokens.shape[1] % 64)))
            full = full_forward(params, padded, config)[:, : tokens.shape[1]]
            full = full[:, -logits.shape[1] :]
            np.testing.assert_allclose(logits, full, rtol=2e-4, atol=tolerance(full, config))
        start = time.perf_counter()
        new = jnp.argmax(logits[:, -1], axis=-1)[:, None].astype(tokens.dtype)
        tokens = jnp.concatenate([tokens, new], axis=1)
        lengths = lengths + 1
        logits, state = jax.block_until_ready(step(params, state, new, lengths))
        generating += time.perf_counter() - start
    return tokens, steps * prompt.shape[0] / generating


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=40)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--cache", default="plain", choices=["plain", "int8", "float8_e4m3fn"])
    parser.add_argument("--short", action="store_true", help="a few tokens, as the test suite")
    parser.add_argument(
        "--kernel",
        choices=["mosaic_gpu", "triton", "interpret"],
        help="the cached steps' attention on the fused kernel",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    config = Config(
        head_dim=32 if args.dtype == "float32" else 64,
        max_len=128 if args.short else 1024,
        cache=args.cache,
        kernel=args.kernel,
        dtype=args.dtype,
    )
    steps = 6 if args.short else args.tokens
    params = init(jax.random.key(0), config)
    prompt = jax.random.randint(jax.random.key(1), (args.batch, args.prompt), 0, config.vocab)
    shape = (args.batch, config.max_len, config.kv_heads, config.head_dim)
    cache = [(empty_cache(shape, config), empty_cache(shape, config)) for _ in range(config.layers)]
    contiguous = jax.jit(functools.partial(contiguous_step, config=config), donate_argnums=1)
    pages_per_sequence = config.max_len // args.page_size
    pool = (args.batch * pages_per_sequence, args.page_size, config.kv_heads, config.head_dim)
    # Pages handed out in a shuffled order, as an allocator that reuses freed pages would.
    order = np.random.default_rng(0).permutation(pool[0])
    table = jnp.asarray(order.reshape(args.batch, pages_per_sequence), jnp.int32)
    pages = [(empty_cache(pool, config), empty_cache(pool, config)) for _ in range(config.layers)]
    paged = jax.jit(
        lambda params, pages, tokens, lengths: paged_step(
            params, pages, table, tokens, lengths, config
        ),
        donate_argnums=(1,),
    )
    results = {}
    for name, step, state in (("contiguous", contiguous, cache), ("paged", paged, pages)):
        check = args.short or args.tokens <= 64
        tokens, rate = generate(step, state, params, prompt, steps, config, check, name)
        results[name] = tokens
        checked = " (each step checked against the full forward)" if check else ""
        print(f"{name:10s}: {steps} tokens × {args.batch} sequences, {rate:.0f} tokens/s{checked}")
    np.testing.assert_array_equal(results["contiguous"], results["paged"])
    print("generated (sequence 0):", np.asarray(results["paged"][0, args.prompt :]).tolist())
    if config.cache != "plain":
        tokens = results["paged"]
        padded = jnp.pad(tokens, ((0, 0), (0, -tokens.shape[1] % 64)))
        logits = [
            full_forward(params, padded, c)[:, : tokens.shape[1]]
            for c in (config, config._replace(cache="plain"))
        ]
        moved = float(jnp.abs(logits[0] - logits[1]).max() / jnp.abs(logits[1]).max())
        print(
            f"{config.cache} cache: logits off the unquantized model's by {moved:.1e} of their "
            "largest"
        )
    return results


if __name__ == "__main__":
    main()
