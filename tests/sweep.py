"""A seeded random sweep over configurations, each checked against the float64 reference.

A case is a :class:`Structure` (everything a compiled program depends on: the implementation,
shapes, tiles, which arguments are given, which mods, x64) and data drawn for it (queries, keys
and values, bias, mask, lengths, segment ids, sinks, the arrays the mods close over, cotangents).
Each structure is compiled once and run on several draws of data, so a case costs a run, not a
compile. For every case:

- the output and the log-sum-exp equal the reference's (``tests/reference.py``, float64 NumPy),
  rows with no allowed key are exactly 0, and nothing is NaN;
- every gradient of ``f = ⟨out, d_out⟩ + ⟨lse, d_lse⟩`` (queries, keys, values, bias, sinks,
  every array a score_mod closes over) equals the reference's hand-derived backward; an array a
  mod closes over gets the reference's gradient of the scores times the mod's central difference;
- where ``jax.nn.dot_product_attention`` takes the call, its output on rows with a key equals
  ours, and its gradients of ``⟨out, d_out⟩`` on those rows equal the reference's (a second
  oracle for the hand-derived backward).

A failure names the case and the command that runs it again, e.g.
``python -m tests.sweep chunked 12 12003`` (implementation, structure seed, data seed).
"""

import contextlib
import dataclasses
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa as js
from tests import reference as ref
from tests.util import broadcast_shape, enable_x64, nn_attention

IMPLEMENTATIONS = ("xla", "chunked", "decode", "paged", "ring")
SCORE_MODS = (None, "alibi", "table", "per_sequence", "scaled", "capped")
MASK_MODS = (None, "causal", "prefix", "document", "band", "by_head")
RELATIVE = 6  # the "table" mod has one entry per relative position in [−6, 6]


@dataclasses.dataclass(frozen=True)
class Structure:
    """What one compiled program depends on (hashable: programs are cached by it)."""

    implementation: str
    batch: int
    seq_q: int
    seq_kv: int
    heads: int
    kv_heads: int
    d_k: int
    d_v: int
    block_q: int = 512
    block_kv: int = 512
    is_causal: bool = False
    bottom_right: bool = False
    window: tuple | None = None
    q_lengths: bool = False
    kv_lengths: bool = False
    segments: bool = False
    mask: tuple | None = None  # the mask's shape (axes of 1 broadcast)
    bias: tuple | None = None
    soft_cap: float | None = None
    scale: float | None = None
    sinks: bool = False
    score_mod: str | None = None
    mask_mod: str | None = None
    block_mask: tuple | None = None  # (block_q, block_kv) of a BlockMask of the mask_mod
    residual: bool = False
    sigmoid: bool = False  # normalizer="sigmoid" (never with sinks)
    x64: bool = False
    float64: bool = False
    page_size: int = 0  # paged: the pages of each sequence, in a pool with spare pages
    pages: int = 0
    mesh: tuple = ()  # ring: ((axis, size), ...) with "seq" among them
    layout: str = "contiguous"

    @property
    def dtype(self):
        return np.float64 if self.float64 else np.float32


def _broadcast_shape(gen, full):
    """A random broadcastable shape: some trailing axes of ``full``, each kept or set to 1."""
    return broadcast_shape(full, gen.random(int(gen.integers(1, len(full) + 1))) < 0.6)


def draw_structure(implementation: str, seed: int, x64: bool | None = None) -> Structure:
    """A random structure for ``implementation`` (``x64=None``: on or off at random)."""
    gen = np.random.default_rng(seed)

    def pick(*options):
        return options[int(gen.integers(len(options)))]

    def chance(p):
        return bool(gen.random() < p)

    kv_heads = pick(1, 2)
    heads = kv_heads * pick(1, 2, 3)
    d_k = pick(4, 8, 16)
    drawn_x64, drawn_float64 = chance(0.5), chance(0.3)  # drawn always: the same stream after
    x64 = drawn_x64 if x64 is None else x64
    base = dict(
        implementation=implementation,
        batch=pick(1, 2, 3),
        heads=heads,
        kv_heads=kv_heads,
        d_k=d_k,
        d_v=pick(d_k, 3, 12),
        x64=x64,
        float64=x64 and drawn_float64,
        soft_cap=pick(None, None, float(gen.uniform(1, 8))),
        scale=pick(None, None, float(gen.uniform(0.1, 1.5))),
        sinks=chance(0.3),
        score_mod=pick(*SCORE_MODS),
        mask_mod=pick(*MASK_MODS),
        residual=chance(0.5),
    )
    if implementation == "paged":
        page_size, pages = int(gen.integers(1, 9)), int(gen.integers(1, 7))
        # paged_attention has no bias, mask, lengths of its own kind or segment ids.
        structure = Structure(
            **base,
            seq_q=int(gen.integers(1, 5)),
            seq_kv=page_size * pages,
            block_kv=int(gen.integers(1, 33)),
            is_causal=chance(0.7),
            window=pick(None, (int(gen.integers(0, 9)), int(gen.integers(0, 3)))),
            page_size=page_size,
            pages=pages,
        )
        return _normalized(structure, chance)
    if implementation == "ring":
        mesh = pick((("seq", 2),), (("seq", 4),), (("seq", 8),), (("batch", 2), ("seq", 4)))
        if kv_heads == 2:
            mesh = pick(mesh, (("seq", 4), ("heads", 2)), (("batch", 2), ("seq", 2), ("heads", 2)))
        shards, layout = dict(mesh)["seq"], pick("contiguous", "striped")
        seq = shards * (2 if layout == "striped" else 1) * int(gen.integers(1, 7))
        base["batch"] = 2 if dict(mesh).get("batch") else base["batch"]
        extra = dict(mesh=mesh, layout=layout, seq_q=seq, seq_kv=seq)
    elif implementation == "decode":
        extra = dict(seq_q=int(gen.integers(1, 5)), seq_kv=int(gen.integers(1, 160)))
    elif implementation in ("chunked", "pallas"):
        extra = dict(seq_q=int(gen.integers(1, 100)), seq_kv=int(gen.integers(1, 100)))
    else:
        extra = dict(seq_q=int(gen.integers(1, 40)), seq_kv=int(gen.integers(1, 40)))
    full = (base["batch"], heads, extra["seq_q"], extra["seq_kv"])
    causal = chance(0.5)
    window = pick(
        None, int(gen.integers(0, 8)), (int(gen.integers(0, 12)), int(gen.integers(0, 4)))
    )
    mask_mod = base["mask_mod"]
    blocks = (int(gen.integers(8, 65)), int(gen.integers(8, 65)))
    if implementation == "pallas":
        blocks = (pick(16, 32), pick(16, 32))  # Triton's tiles: powers of two ≥ 16
    structure = Structure(
        **base,
        **extra,
        block_q=blocks[0] if implementation != "ring" else int(gen.integers(1, 17)),
        block_kv=blocks[1] if implementation != "ring" else int(gen.integers(1, 17)),
        is_causal=causal,
        bottom_right=(causal or window is not None) and chance(0.4),
        window=window,
        q_lengths=chance(0.3),
        kv_lengths=chance(0.3),
        segments=implementation != "ring" and chance(0.25),
        mask=_broadcast_shape(gen, full) if chance(0.3) else None,
        bias=_broadcast_shape(gen, full) if chance(0.4) else None,
        block_mask=(int(gen.integers(4, 40)), int(gen.integers(4, 40)))
        if mask_mod and chance(0.4)
        else None,
    )
    return _normalized(structure, chance)


def _normalized(s: Structure, chance) -> Structure:
    """The structure with its normaliser drawn, last: the other draws are as they were before."""
    return dataclasses.replace(s, sigmoid=chance(0.3) and not s.sinks)


# --- the mods, written once for NumPy (the reference, on whole grids) and jax.numpy (scalars) --


def score_mod(name, xp, arrays):
    """The ``score_mod`` called ``name``, closing over ``arrays`` (NumPy or jax.numpy ones)."""
    if name == "alibi":
        return lambda s, b, h, i, j: s - arrays["slopes"][h] * xp.abs(i - j).astype(s.dtype)
    if name == "table":
        return lambda s, b, h, i, j: (
            s + arrays["table"][xp.clip(j - i + RELATIVE, 0, 2 * RELATIVE), h]
        )
    if name == "per_sequence":
        return lambda s, b, h, i, j: s + arrays["per_sequence"][b]
    if name == "scaled":
        return lambda s, b, h, i, j: s * arrays["per_head"][h]
    if name == "capped":
        return lambda s, b, h, i, j: arrays["cap"] * xp.tanh(s / arrays["cap"])
    return None


def mask_mod(name, xp, arrays):
    """The ``mask_mod`` called ``name``, closing over ``arrays``."""
    if name == "causal":
        return lambda b, h, i, j: j <= i
    if name == "prefix":
        return lambda b, h, i, j: (j < arrays["prefix"][b]) | (j <= i)
    if name == "document":
        return lambda b, h, i, j: arrays["document"][b, i] == arrays["document"][b, j]
    if name == "band":
        return lambda b, h, i, j: xp.abs(i - j) < 5
    if name == "by_head":
        return lambda b, h, i, j: (h % 2 == 0) | (j <= i)
    return None


def _mod_arrays(gen, s: Structure) -> dict:
    dtype = s.dtype
    return {
        "slopes": gen.uniform(0.05, 1.0, size=s.heads).astype(dtype),
        "table": gen.normal(size=(2 * RELATIVE + 1, s.heads)).astype(dtype),
        "per_sequence": gen.normal(size=s.batch).astype(dtype),
        "per_head": gen.uniform(0.3, 2.0, size=s.heads).astype(dtype),
        "cap": np.asarray(gen.uniform(2, 6), dtype),
        "prefix": gen.integers(0, s.seq_kv + 1, size=s.batch).astype(np.int32),
        "document": np.sort(gen.integers(0, 3, size=(s.batch, max(s.seq_q, s.seq_kv))), 1).astype(
            np.int32
        ),
    }


# The arrays each mod reads (and which of them are differentiable: the float ones).
_READS = {
    "alibi": ("slopes",),
    "table": ("table",),
    "per_sequence": ("per_sequence",),
    "scaled": ("per_head",),
    "capped": ("cap",),
    "prefix": ("prefix",),
    "document": ("document",),
}


def draw_data(s: Structure, seed: int) -> dict:
    """Every array of one case of ``s``, in NumPy: inputs, cotangents, directions."""
    gen = np.random.default_rng(seed)
    dtype = s.dtype
    b, t, n, k = s.batch, s.seq_q, s.heads, s.kv_heads
    data = {
        "query": gen.normal(size=(b, t, n, s.d_k)).astype(dtype),
        "d_out": gen.normal(size=(b, t, n, s.d_v)),
        "d_lse": gen.normal(size=(b, t, n)) if s.residual else np.zeros((b, t, n)),
    }
    if s.implementation == "paged":
        spare = int(gen.integers(0, 4))
        pool = b * s.pages + spare
        for name, d in (("key_pages", s.d_k), ("value_pages", s.d_v)):
            data[name] = gen.normal(size=(pool, s.page_size, k, d)).astype(dtype)
        data["page_table"] = (
            gen.permutation(pool)[: b * s.pages].reshape(b, s.pages).astype(np.int32)
        )
        data["lengths"] = gen.integers(0, s.seq_kv + 1, size=b).astype(np.int32)
    else:
        data["key"] = gen.normal(size=(b, s.seq_kv, k, s.d_k)).astype(dtype)
        data["value"] = gen.normal(size=(b, s.seq_kv, k, s.d_v)).astype(dtype)
    if s.bias is not None:
        bias = gen.normal(size=s.bias)
        data["bias"] = np.where(gen.random(s.bias) < 0.05, -np.inf, bias).astype(dtype)
    if s.mask is not None:
        mask = gen.random(s.mask) < 0.8
        if len(s.mask) > 1 and s.mask[-2] > 1 and gen.random() < 0.5:  # a row with no key
            mask[..., int(gen.integers(s.mask[-2])), :] = False
        data["mask"] = mask
    if s.q_lengths:
        data["query_seq_lengths"] = gen.integers(0, t + 1, size=b).astype(np.int32)
    if s.kv_lengths:
        data["key_value_seq_lengths"] = gen.integers(0, s.seq_kv + 1, size=b).astype(np.int32)
    if s.segments:
        for name, length in (("query_segment_ids", t), ("key_value_segment_ids", s.seq_kv)):
            data[name] = np.sort(gen.integers(0, 3, size=(b, length)), 1).astype(np.int32)
    if s.sinks:
        data["sinks"] = gen.normal(size=n).astype(dtype)
    arrays = _mod_arrays(gen, s)
    for name in (s.score_mod, s.mask_mod):
        data.update({a: arrays[a] for a in _READS.get(name, ())})
    return data


def differentiable(s: Structure) -> tuple[str, ...]:
    """The inputs whose gradients are checked: the floating-point ones."""
    paged = s.implementation == "paged"
    inputs = ("query", "key_pages", "value_pages") if paged else ("query", "key", "value")
    given = ("bias",) * (s.bias is not None) + ("sinks",) * s.sinks
    return inputs + given + _READS.get(s.score_mod, ())


def _mods(s: Structure, xp, arrays: dict) -> dict:
    """The keywords of the mods, the sinks and the scale, closing over NumPy or jax arrays."""
    return dict(
        score_mod=score_mod(s.score_mod, xp, arrays),
        mask_mod=mask_mod(s.mask_mod, xp, arrays),
        sinks=arrays.get("sinks"),
        scale=s.scale,
    )


# --- our side: one jitted program per structure ---------------------------------------------


def _ours(s: Structure, arrays: dict):
    """``(out, lse, max_scores)`` of our call of ``s`` on ``arrays`` (jax arrays, maybe traced)."""
    mods = dict(
        _mods(s, jnp, arrays),
        logits_soft_cap=s.soft_cap,
        normalizer="sigmoid" if s.sigmoid else "softmax",
        return_residual=True,
        return_max_scores=True,
    )
    if s.block_mask is not None:
        batch = s.batch if s.mask_mod in ("prefix", "document") else None
        heads = s.heads if s.mask_mod == "by_head" else None
        block_q, block_kv = s.block_mask
        mods["mask_mod"] = js.create_block_mask(
            mods["mask_mod"], batch, heads, s.seq_q, s.seq_kv, block_q=block_q, block_kv=block_kv
        )
    if s.implementation == "paged":
        cache = (arrays[name] for name in ("key_pages", "value_pages", "page_table", "lengths"))
        return js.paged_attention(
            arrays["query"],
            *cache,
            is_causal=s.is_causal,
            local_window_size=s.window,
            implementation=js.Paged(s.block_kv),
            **mods,
        )
    rules = dict(
        is_causal=s.is_causal,
        causal_alignment="bottom_right" if s.bottom_right else "top_left",
        local_window_size=s.window,
        query_seq_lengths=arrays.get("query_seq_lengths"),
        key_value_seq_lengths=arrays.get("key_value_seq_lengths"),
    )
    args = (arrays["query"], arrays["key"], arrays["value"], arrays.get("bias"), arrays.get("mask"))
    if s.implementation == "ring":
        names, sizes = zip(*s.mesh, strict=True)
        devices = np.array(jax.devices()[: math.prod(sizes)]).reshape(sizes)
        return js.ring_dot_product_attention(
            *args,
            mesh=jax.sharding.Mesh(devices, names),
            seq_axis="seq",
            batch_axis="batch" if "batch" in names else None,
            head_axis="heads" if "heads" in names else None,
            layout=s.layout,
            implementation=js.Ring(s.block_q, s.block_kv),
            **rules,
            **mods,
        )
    implementation = {
        "xla": lambda: "xla",
        "chunked": lambda: js.Chunked(s.block_q, s.block_kv),
        "decode": lambda: js.Decode(s.block_kv),
        "pallas": lambda: js.Pallas(s.block_q, s.block_kv, interpret=True),
    }[s.implementation]()
    return js.dot_product_attention(
        *args,
        implementation=implementation,
        query_segment_ids=arrays.get("query_segment_ids"),
        key_value_segment_ids=arrays.get("key_value_segment_ids"),
        **rules,
        **mods,
    )


@functools.lru_cache(maxsize=4)  # a structure's draws run one after another
def program(s: Structure):
    """``arrays → (out, lse, max_scores, gradients)``, jitted: compiled once per structure."""

    def run(arrays):
        def loss(diff):
            out, lse, top = _ours(s, {**arrays, **diff})
            finite = jnp.isfinite(lse)
            d_lse = jnp.where(finite, arrays["d_lse"].astype(lse.dtype), 0)
            total = jnp.sum(out.astype(lse.dtype) * arrays["d_out"].astype(lse.dtype))
            return total + jnp.sum(jnp.where(finite, lse, 0) * d_lse), (out, lse, top)

        diff = {name: arrays[name] for name in differentiable(s)}
        grads, (out, lse, top) = jax.grad(loss, has_aux=True)(diff)
        return out, lse, top, grads

    return jax.jit(run)


# --- the reference --------------------------------------------------------------------------


def _paged_keys(data: dict, s: Structure) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A paged case's keys, values and mask: each sequence's pages end to end, its queries last."""
    table = data["page_table"]
    keys, values = (
        data[name][table].reshape(s.batch, s.seq_kv, s.kv_heads, -1)
        for name in ("key_pages", "value_pages")
    )
    lengths = data["lengths"][:, None, None, None]
    j = np.arange(s.seq_kv)[None, :]
    position = np.arange(s.seq_q)[:, None] + lengths - s.seq_q  # query i: lengths[b] − T + i
    allowed = j < lengths
    if s.is_causal:
        allowed = allowed & (j <= position)
    if s.window is not None:
        allowed = allowed & (j >= position - s.window[0]) & (j <= position + s.window[1])
    return keys, values, allowed


def reference(s: Structure, data: dict, **cotangents) -> dict:
    """The float64 reference of ``s`` on ``data``: outputs, ``allowed`` and every gradient (of
    the data's ``d_out`` and ``d_lse``, or of the ``cotangents`` given)."""
    arrays = {
        name: np.asarray(x, np.float64) if np.issubdtype(x.dtype, np.floating) else x
        for name, x in {**data, **cotangents}.items()
    }
    mods = dict(
        _mods(s, np, arrays),
        soft_cap=s.soft_cap,
        normalizer="sigmoid" if s.sigmoid else "softmax",
        d_out=arrays["d_out"],
        d_lse=arrays["d_lse"],
    )
    if s.implementation == "paged":
        keys, values, allowed = _paged_keys(arrays, s)
        counts = arrays["lengths"]  # the sigmoid's S: each sequence's keys
        result = ref.attention(
            arrays["query"], keys, values, mask=allowed, kv_counts=counts, **mods
        )
        table = arrays["page_table"]
        for name, grad in (("key_pages", result["dk"]), ("value_pages", result["dv"])):
            pages = np.zeros_like(arrays[name])  # each page gets its sequence's gradient
            np.add.at(pages, table, grad.reshape(*table.shape, *pages.shape[1:]))
            result[name] = pages
    else:
        window = (s.window, s.window) if isinstance(s.window, int) else s.window
        result = ref.attention(
            arrays["query"],
            arrays["key"],
            arrays["value"],
            arrays.get("bias"),
            mask=arrays.get("mask"),
            is_causal=s.is_causal,
            window=window,
            offset=s.seq_kv - s.seq_q if s.bottom_right else 0,
            q_lengths=arrays.get("query_seq_lengths"),
            kv_lengths=arrays.get("key_value_seq_lengths"),
            q_segments=arrays.get("query_segment_ids"),
            kv_segments=arrays.get("key_value_segment_ids"),
            **mods,
        )
        result.update(key=result["dk"], value=result["dv"], bias=result["dbias"])
    result.update(query=result["dq"], sinks=result["dsinks"])
    for name in _READS.get(s.score_mod, ()):
        result[name] = _captured_gradient(s, arrays, result, name)
    return result


def _captured_gradient(s: Structure, arrays: dict, result: dict, name: str) -> np.ndarray:
    """The gradient of the array ``name`` a score_mod closes over, entry by entry.

    The reference's gradient of the scores the mod returns, times the mod's central difference
    in that entry, summed over the scores.
    """
    b, n, t, kv = result["d_scores"].shape
    grid = np.arange(b)[:, None, None, None], np.arange(n)[:, None, None], *np.indices((t, kv))
    x = arrays[name]
    grad = np.zeros_like(x)
    for entry in np.ndindex(x.shape):
        step = 1e-6 * (1 + abs(x[entry]))
        moved = []
        for sign in (1, -1):
            changed = x.copy()
            changed[entry] += sign * step
            mod = score_mod(s.score_mod, np, {**arrays, name: changed})
            moved.append(mod(result["before_mod"], *grid))
        grad[entry] = np.sum(result["d_scores"] * (moved[0] - moved[1]) / (2 * step))
    return grad


# --- one case -------------------------------------------------------------------------------


def check_case(
    implementation: str, structure_seed: int, data_seed: int, x64: bool | None = None
) -> None:
    """Runs one case and raises ``AssertionError`` naming it if anything disagrees."""
    s = draw_structure(implementation, structure_seed, x64)
    data = draw_data(s, data_seed)
    devices = "XLA_FLAGS=--xla_force_host_platform_device_count=8 " * (implementation == "ring")
    where = (
        f"sweep case {implementation} {structure_seed} {data_seed} (rerun: {devices}python -m "
        f"tests.sweep {implementation} {structure_seed} {data_seed}{' --x64' * s.x64}): {s}"
    )
    with enable_x64() if s.x64 else contextlib.nullcontext():
        out, lse, top, grads = program(s)(jax.tree.map(jnp.asarray, data))
        want = reference(s, data)
        has_key = want["allowed"].any(-1).transpose(0, 2, 1)  # (B, T, N)
        theirs = _jax_nn(s, data, has_key)
    assert out.dtype == s.dtype, f"output {out.dtype}, inputs {np.dtype(s.dtype)}; {where}"
    tolerance = 1e-9 if s.float64 else 1e-5
    for name, x in (("output", out), ("log-sum-exp", lse), *grads.items()):
        assert not np.isnan(np.asarray(x)).any(), f"NaN in the {name}; {where}"
    error = _error(out, want["out"])
    assert error <= tolerance, f"output off by {error:.1e}; {where}"
    if not s.sinks:
        assert (np.asarray(out)[~has_key] == 0).all(), f"a row with no key is not 0; {where}"
    lse, finite = np.asarray(lse, np.float64), np.isfinite(want["lse"])
    assert (np.isfinite(lse) == finite).all(), f"−∞ log-sum-exp rows differ; {where}"
    error = np.abs(lse[finite] - want["lse"][finite]).max(initial=0)
    assert error <= 10 * tolerance, f"log-sum-exp off by {error:.1e}; {where}"
    for name, grad in grads.items():
        error = _error(grad, want[name])
        assert error <= 2 * tolerance, f"gradient of {name} off by {error:.1e}; {where}"
    top, finite = np.asarray(top, np.float64), np.isfinite(want["max_scores"])
    assert (np.isfinite(top) == finite).all(), f"−∞ max-score rows differ; {where}"
    error = _error(np.where(finite, top, 0), np.where(finite, want["max_scores"], 0))
    assert error <= 10 * tolerance, f"max scores off by {error:.1e}; {where}"
    if theirs is not None:
        theirs_out, theirs_grads = theirs
        error = _error(out, np.where(has_key[..., None], np.asarray(theirs_out, np.float64), 0))
        assert error <= tolerance, f"jax.nn's output differs by {error:.1e}; {where}"
        d_out = np.where(has_key[..., None], data["d_out"], 0)
        want = reference(s, data, d_out=d_out, d_lse=np.zeros_like(data["d_lse"]))
        for name, grad in theirs_grads.items():
            error = _error(grad, want[name])
            assert error <= 2 * tolerance, (
                f"jax.nn's gradient of {name} differs by {error:.1e}; {where}"
            )


def _error(x, want) -> float:
    """``max |x − want|`` relative to ``max |want|``, or absolute below 1 (gradients that cancel
    to about 0, like a bias's that is constant along the keys, are rounding alone)."""
    x, want = np.asarray(x, np.float64), np.asarray(want, np.float64)
    return float(np.abs(x - want).max(initial=0) / max(1.0, np.abs(want).max(initial=0)))


def _jax_nn(s: Structure, data: dict, has_key: np.ndarray):
    """``jax.nn.dot_product_attention``'s output of the case and its gradients of ``⟨out, d_out⟩``
    on the rows with a key, where it takes the call meaning the same; else None."""
    beyond = (s.bottom_right, s.soft_cap, s.sinks, s.score_mod, s.mask_mod, s.segments, s.sigmoid)
    beyond += (s.d_v != s.d_k,)  # jax.nn asks for values as wide as the keys
    if s.implementation not in ("xla", "chunked") or any(beyond):
        return None
    mask = data.get("mask")
    if mask is None and s.window is not None:  # jax.nn before 0.8 ignored a window without one
        mask = np.ones((1,), bool)
    names = ("query", "key", "value") + ("bias",) * (s.bias is not None)

    def attend(diff):
        return nn_attention(
            diff["query"],
            diff["key"],
            diff["value"],
            bias=diff.get("bias"),
            mask=None if mask is None else jnp.asarray(mask),
            scale=s.scale,
            is_causal=s.is_causal,
            local_window_size=s.window,
            query_seq_lengths=data.get("query_seq_lengths"),
            key_value_seq_lengths=data.get("key_value_seq_lengths"),
        )

    out, pullback = jax.vjp(attend, {name: jnp.asarray(data[name]) for name in names})
    d_out = jnp.where(jnp.asarray(has_key)[..., None], jnp.asarray(data["d_out"]), 0)
    return out, pullback(d_out.astype(out.dtype))[0]


if __name__ == "__main__":  # python -m tests.sweep IMPLEMENTATION STRUCTURE DATA [--x64]
    jax.config.update("jax_numpy_dtype_promotion", "strict")  # as the suite runs (conftest.py)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    implementation, structure_seed, data_seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    check_case(implementation, structure_seed, data_seed, x64="--x64" in sys.argv or None)
    print("ok")
