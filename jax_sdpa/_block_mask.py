"""Block masks: a mask's tiles classified once, then reused by every call that needs it.

The chunked and ring implementations skip the tiles a mask excludes entirely and drop the mask
on the tiles it allows entirely. For the built-in rules they read that from the rules' ranges;
a ``mask_mod`` function has none, so a call classifies its tiles by evaluating it on every
entry once, in the forward pass (the backward pass reads the classes). A
:class:`~jax_sdpa.BlockMask` does that evaluation ahead, once for all the layers of a model
that share the mask, as PyTorch FlexAttention's ``create_block_mask`` does.
"""

import jax.numpy as jnp
from jax import lax

from jax_sdpa import _checks
from jax_sdpa._chunked import DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q
from jax_sdpa._masks import BlockMask, MaskRule, classify_blocks
from jax_sdpa._user_functions import function_mask


def create_block_mask(
    mask_mod,
    batch: int | None,
    heads: int | None,
    q_len: int,
    kv_len: int,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    block_kv: int = DEFAULT_BLOCK_KV,
) -> BlockMask:
    """Classifies the ``(block_q, block_kv)`` tiles of ``mask_mod`` once, for many calls.

    The result is a pytree (it can enter and leave ``jax.jit``) to pass as ``mask_mod=`` to
    :func:`~jax_sdpa.dot_product_attention` and the ring functions, where it means exactly
    ``mask_mod``. Building it evaluates ``mask_mod`` on every entry, a few tiles at a time: no
    ``(q_len, kv_len)`` array is ever held. Calls read each tile's class instead of evaluating
    it again; they may use other tiles (``block_q``, ``block_kv``), at the cost of precision
    where their tiles straddle these.

    Args:
        mask_mod: ``mask_mod(batch, head, q_idx, kv_idx) -> bool`` of scalars (``True`` = may
            attend), or a built-in :class:`~jax_sdpa.MaskRule` without batch axes.
        batch: The batch size of the calls (the flattened batch), or ``None`` where the mask is
            the same for every sequence (refused if ``mask_mod`` reads its ``batch``).
        heads: The number of query heads, or ``None`` where the mask is the same for every head
            (refused if ``mask_mod`` reads its ``head``).
        q_len: Queries per sequence (a ring's whole sequence).
        kv_len: Keys per sequence.
        block_q: Queries per tile; by default the chunked implementation's.
        block_kv: Keys per tile.

    Returns:
        A :class:`~jax_sdpa.BlockMask` whose ``classes`` is an ``int8`` array
        ``(batch or 1, heads or 1, q_blocks, kv_blocks)``: 0 where the tile is empty (skipped),
        2 where it is full (computed without the mask), 1 where the mask must be evaluated.
        The head axis is 1 also where ``mask_mod`` does not read its head.

    Examples:
        >>> causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 6, 6,
        ...                            block_q=2, block_kv=2)
        >>> causal.classes[0, 0]
        Array([[1, 0, 0],
               [2, 1, 0],
               [2, 2, 1]], dtype=int8)

    References:
        Dong, Feng, Guessous, Liang & He, Flex Attention: A Programming Model for Generating
        Optimized Attention Kernels, 2024 (PyTorch's ``create_block_mask`` and ``BlockMask``).
    """
    rule = mask_mod if isinstance(mask_mod, MaskRule) else function_mask(mask_mod)
    for name, size, reads in (
        ("heads", heads, rule.per_head),
        ("batch", batch, getattr(rule, "uses_batch", False)),
    ):
        if size is None and reads:
            raise ValueError(
                f"`{name}` must be given: `mask_mod` reads its {name} argument, so one "
                f"classification cannot stand for every {name}; got None."
            )
    batch, heads = (1 if size is None else size for size in (batch, heads))
    sizes = dict(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len)
    for name, size in (sizes | dict(block_q=block_q, block_kv=block_kv)).items():
        _checks.check_positive_int(name, size)
    block_q, block_kv = min(block_q, q_len), min(block_kv, kv_len)
    head_index = jnp.arange(heads, dtype=jnp.int32)

    def sequence(b):
        return classify_blocks(rule, q_len, kv_len, block_q, block_kv, b, head_index)

    classes = lax.map(sequence, jnp.arange(batch, dtype=jnp.int32))
    return BlockMask(rule, classes, block_q, block_kv, q_len, kv_len)
