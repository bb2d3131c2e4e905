"""The smallest useful call: causal multi-head attention on random BTNH inputs."""

import jax

import jax_sdpa

rng_q, rng_k, rng_v = jax.random.split(jax.random.key(0), 3)
query = jax.random.normal(rng_q, (2, 5, 4, 8))  # (batch, q_seq, heads, d_k)
key = jax.random.normal(rng_k, (2, 5, 2, 8))  # 2 key/value heads shared by 4 query heads (GQA)
value = jax.random.normal(rng_v, (2, 5, 2, 8))
out = jax_sdpa.dot_product_attention(query, key, value, is_causal=True)
reference = jax.nn.dot_product_attention(query, key, value, is_causal=True)
print("output shape:", out.shape)
print("output[0, :, 0, :3]:\n", out[0, :, 0, :3])
print("max |jax_sdpa - jax.nn|:", float(abs(out - reference).max()))
