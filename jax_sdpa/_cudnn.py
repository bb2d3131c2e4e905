"""``implementation="cudnn"``: the call handed to ``jax.nn``'s cuDNN kernel, after our checks.

Only for what ``jax.nn.dot_product_attention`` takes (its arguments, the mask rules it has as
flags), and only on a CUDA GPU; anything else is refused with the arguments it does not take.
"""

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa._call import Config, Inputs
from jax_sdpa._heads import Result
from jax_sdpa._jax_compat import JAX_NN_GIVES_LSE, mapped_by_vmap
from jax_sdpa._masks import AndMask, CausalMask, LengthMask, LocalWindowMask, MaskRule
from jax_sdpa._online_softmax import SIGMOID
from jax_sdpa._steps import accumulation_dtype


def _rule_parts(rule: MaskRule | None) -> tuple[MaskRule, ...]:
    if rule is None:
        return ()
    return rule.rules if isinstance(rule, AndMask) else (rule,)


def _offset(rule: MaskRule) -> bool:
    """Whether ``rule`` moves its diagonal: an offset, or one per sequence."""
    return getattr(rule, "offset", 0) != 0 or getattr(rule, "offsets", None) is not None


def _beyond_jax_nn(inputs: Inputs, config: Config) -> list[str]:
    """The arguments of the call that ``jax.nn.dot_product_attention`` does not take."""
    parts = _rule_parts(inputs.arrays.rule)
    used = {
        "more than one batch axis": inputs.query.ndim > 4,
        "causal_alignment='bottom_right'": any(_offset(r) for r in parts),
        "logits_soft_cap": config.formula.soft_cap is not None,
        "segment ids or mask_mod": any(
            not isinstance(r, (CausalMask, LocalWindowMask, LengthMask)) for r in parts
        ),
        "score_mod": config.formula.score_mod is not None,
        "sinks": inputs.arrays.sinks is not None,
        "normalizer='sigmoid'": config.formula.normalizer is SIGMOID,
        "return_max_scores": config.max_scores,
        "dropout_rate": inputs.arrays.dropout_rng is not None,
        "module": config.output != "attention",
        "precision": config.formula.precision is not None,
        # (cuDNN's window is a left one, the right side given only by a causal mask)
        "a window's right side without is_causal, or with lengths": any(
            isinstance(r, LocalWindowMask) and r.right != 0 for r in parts
        )
        and not (_has(parts, CausalMask) and not _has(parts, LengthMask)),
        "a window with a negative side": any(
            isinstance(r, LocalWindowMask) and min(r.left, r.right) < 0 for r in parts
        ),
    }
    return [name for name, on in used.items() if on]


def _has(parts: tuple[MaskRule, ...], kind: type) -> bool:
    return any(isinstance(r, kind) for r in parts)


def cudnn_unsupported(inputs: Inputs, config: Config) -> str | None:
    backend = jax.default_backend()
    if backend != "gpu":
        return (
            f"`implementation='cudnn'` needs a CUDA GPU with cuDNN; JAX's backend is {backend!r}. "
            "Use implementation=None or 'xla'."
        )
    used = _beyond_jax_nn(inputs, config)
    if used:
        return f"`implementation='cudnn'` supports only jax.nn's arguments; got {', '.join(used)}."
    if not JAX_NN_GIVES_LSE:
        return (
            f"`implementation='cudnn'` needs JAX 0.7 or later (jax.nn's `return_residual`); "
            f"JAX is {jax.__version__}. Use implementation=None or 'xla'."
        )
    return None


def cudnn_by_default(inputs: Inputs, config: Config) -> bool:
    """Whether ``implementation=None`` hands a call cuDNN takes to it: where cuDNN's result is ours.

    That is on a CUDA GPU with cuDNN's flash attention (compute capability 8.0 or above), not
    under a ``jax.vmap`` of the call (jax.nn's cuDNN batches only axis 0 of every input), where
    every row has a key, provably (no array mask or bias, whose rows may hold none, no lengths;
    a window only with a causal mask, and then ``T = S``, so that each row keeps its diagonal),
    the log-sum-exp is not returned (cuDNN's has no gradient), and the inputs are what cuDNN
    takes on every such GPU (float16 or bfloat16, ``d_k = d_v ≤ 128``, a multiple of 8).
    """
    arrays, (*_, seq_q, _, width) = inputs.arrays, inputs.query.shape
    parts = _rule_parts(arrays.rule)
    values = inputs.values_like
    dtypes = {x.dtype for x in (inputs.query, inputs.key, values)}
    causal = _has(parts, CausalMask)
    rows_keep_a_key = all(
        isinstance(r, CausalMask) or (isinstance(r, LocalWindowMask) and causal) for r in parts
    ) and (not parts or seq_q == inputs.key.shape[-3])
    return (
        flash_attention_device()
        and not mapped_by_vmap(inputs)
        and rows_keep_a_key
        and arrays.bias is None
        and arrays.mask is None
        and not config.residual
        and dtypes <= {jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)}
        and len(dtypes) == 1
        and width == values.shape[-1]
        and width <= 128
        and width % 8 == 0
    )


def flash_attention_device() -> bool:
    """Whether JAX's first device is a CUDA GPU with cuDNN's flash attention (sm_80 or later).

    (A ROCm GPU names its architecture there, ``"gfx90a"``: not a version.)
    """
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    version = capability.split(".")
    return all(part.isdigit() for part in version) and tuple(map(int, version)) >= (8, 0)


def _jax_nn_arguments(inputs: Inputs, config: Config) -> dict:
    """The call in ``jax.nn.dot_product_attention``'s own arguments (mask rules as flags)."""
    arrays = inputs.arrays
    kwargs = dict(
        query=inputs.query,
        key=inputs.key,
        value=inputs.value,
        bias=arrays.bias,
        mask=arrays.mask,
        scale=config.formula.scale,
    )
    for rule in _rule_parts(arrays.rule):
        if isinstance(rule, CausalMask):
            kwargs["is_causal"] = True
        elif isinstance(rule, LocalWindowMask):
            kwargs["local_window_size"] = (rule.left, rule.right)
        elif isinstance(rule, LengthMask):
            lengths = (rule.q_length, rule.kv_length)
            kwargs["query_seq_lengths"], kwargs["key_value_seq_lengths"] = (
                None if x is None else jnp.reshape(x, (-1,)).astype(jnp.int32) for x in lengths
            )
    return kwargs


def run_cudnn(inputs: Inputs, config: Config) -> Result:
    out, lse = jax.nn.dot_product_attention(
        **_jax_nn_arguments(inputs, config), implementation="cudnn", return_residual=True
    )
    # jax.nn's cuDNN backward drops the log-sum-exp's cotangent: say so rather than be wrong.
    lse = lax.stop_gradient(lse.astype(accumulation_dtype(lse.dtype)))
    return Result(out, lse, None)
