r"""jax_sdpa: scaled dot-product attention, ``softmax(Q Kᵀ / √d_k) V``, as pure JAX functions.

One function per step of the formula (:func:`raw_scores`, :func:`scale_scores`,
:func:`softmax_weights`, :func:`weighted_sum`), composed for one head by :func:`attention`;
:func:`dot_product_attention`, a drop-in for ``jax.nn.dot_product_attention`` and a flax
``attention_fn``, runs that composition over heads and batch (``implementation="xla"``), over
tiles in memory linear in the sequence length (``"chunked"``), against a long cache
(``"decode"``), over each query's own listed keys (``"selected"``), as a fused kernel
(``"pallas"``) or by cuDNN. :func:`paged_attention` reads a paged cache,
:func:`ragged_paged_attention` one for a batch whose sequences bring different numbers of new
queries; :func:`ring_attention` spreads one long sequence over many devices.
"""

from jax_sdpa import mods as mods
from jax_sdpa._attention import attention as attention
from jax_sdpa._block_mask import BlockMask as BlockMask
from jax_sdpa._block_mask import create_block_mask as create_block_mask
from jax_sdpa._dot_product import dot_product_attention as dot_product_attention
from jax_sdpa._dot_product import dot_product_attention_weights as dot_product_attention_weights
from jax_sdpa._dot_product import ring_attention as ring_attention
from jax_sdpa._latent import LatentValues as LatentValues
from jax_sdpa._masks import AndMask as AndMask
from jax_sdpa._masks import CausalMask as CausalMask
from jax_sdpa._masks import LengthMask as LengthMask
from jax_sdpa._masks import LocalWindowMask as LocalWindowMask
from jax_sdpa._masks import MaskRule as MaskRule
from jax_sdpa._masks import OrMask as OrMask
from jax_sdpa._masks import SegmentMask as SegmentMask
from jax_sdpa._masks import materialize_mask as materialize_mask
from jax_sdpa._online_softmax import merge_attention as merge_attention
from jax_sdpa._paged import paged_attention as paged_attention
from jax_sdpa._paged import update_cache as update_cache
from jax_sdpa._paged import update_paged_cache as update_paged_cache
from jax_sdpa._paged import update_ragged_paged_cache as update_ragged_paged_cache
from jax_sdpa._qk_clip import qk_clip as qk_clip
from jax_sdpa._quantized import Quantized as Quantized
from jax_sdpa._quantized import quantize as quantize
from jax_sdpa._ragged import ragged_paged_attention as ragged_paged_attention
from jax_sdpa._sharding import from_striped as from_striped
from jax_sdpa._sharding import ring_dot_product_attention as ring_dot_product_attention
from jax_sdpa._sharding import to_striped as to_striped
from jax_sdpa._steps import default_scale as default_scale
from jax_sdpa._steps import dropout_weights as dropout_weights
from jax_sdpa._steps import raw_scores as raw_scores
from jax_sdpa._steps import scale_scores as scale_scores
from jax_sdpa._steps import sigmoid_weights as sigmoid_weights
from jax_sdpa._steps import soft_cap_scores as soft_cap_scores
from jax_sdpa._steps import softmax_weights as softmax_weights
from jax_sdpa._steps import weighted_sum as weighted_sum
from jax_sdpa._tunables import Chunked as Chunked
from jax_sdpa._tunables import Decode as Decode
from jax_sdpa._tunables import Paged as Paged
from jax_sdpa._tunables import Pallas as Pallas
from jax_sdpa._tunables import Ring as Ring
from jax_sdpa._tunables import Selected as Selected

__version__ = "0.2.0"

__all__ = (
    "AndMask",
    "BlockMask",
    "CausalMask",
    "Chunked",
    "Decode",
    "LatentValues",
    "LengthMask",
    "LocalWindowMask",
    "MaskRule",
    "OrMask",
    "Paged",
    "Pallas",
    "Quantized",
    "Ring",
    "SegmentMask",
    "Selected",
    "attention",
    "create_block_mask",
    "default_scale",
    "dot_product_attention",
    "dot_product_attention_weights",
    "dropout_weights",
    "from_striped",
    "materialize_mask",
    "merge_attention",
    "mods",
    "paged_attention",
    "qk_clip",
    "quantize",
    "ragged_paged_attention",
    "raw_scores",
    "ring_attention",
    "ring_dot_product_attention",
    "scale_scores",
    "soft_cap_scores",
    "sigmoid_weights",
    "softmax_weights",
    "to_striped",
    "update_cache",
    "update_paged_cache",
    "update_ragged_paged_cache",
    "weighted_sum",
)
