"""A float64 NumPy oracle for attention, forward and backward, written from the formulas.

Independent of jax_sdpa: it builds the full (B, N, T, S) mask from its definition, repeats
key/value heads for GQA, and differentiates by hand:

    dV = Wᵀ dO,  dW = dO Vᵀ,  dS = W ∘ (dW − rowsum(W ∘ dW) + d_lse),  dQ = scale·dS' K,  dK = scale·dS'ᵀ Q

where W includes a sink's column (whose value is 0, so its dW is 0; its dS is the sink's
gradient); for sigmoid weights W = m ∘ σ(S + b), lse = log rowsum(W) and
dS = W ∘ (1 − W) ∘ (dW + d_lse / rowsum(W)); dS' = dS ∘ mod'(s) ∘ (1 − tanh²(s/c)) under a score_mod (its derivative taken by a
central difference, entry by entry) and a soft cap, and dBias = dS ∘ mod'(s) summed to the bias's
shape. A row with no allowed key outputs 0 (the library's contract).
"""

import numpy as np


def allowed_keys(
    shape,
    *,
    mask=None,
    is_causal=False,
    window=None,
    q_lengths=None,
    kv_lengths=None,
    q_segments=None,
    kv_segments=None,
    offset=0,
):
    """The (B, N, T, S) boolean 'may attend' array, from each rule's definition."""
    b, n, t, s = shape
    i = np.arange(t)[:, None]
    j = np.arange(s)[None, :]
    allowed = np.ones(shape, bool)
    if mask is not None:
        allowed &= np.broadcast_to(np.asarray(mask) != 0, shape)
    if is_causal:
        allowed &= j <= i + offset
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        allowed &= (j >= i + offset - left) & (j <= i + offset + right)
    if q_lengths is not None:
        allowed &= (i[None] < np.asarray(q_lengths)[:, None, None])[:, None]
    if kv_lengths is not None:
        allowed &= (j[None] < np.asarray(kv_lengths)[:, None, None])[:, None]
    if q_segments is not None:
        qs, ks = np.asarray(q_segments), np.asarray(kv_segments)
        allowed &= (qs[:, :, None] == ks[:, None, :])[:, None]
    return allowed


def _sum_to(x, shape):
    """Sums a broadcast gradient back to ``shape`` (left-padded with 1s)."""
    shape = (1,) * (x.ndim - len(shape)) + tuple(shape)
    axes = tuple(
        a for a, (xs, s) in enumerate(zip(x.shape, shape, strict=True)) if s == 1 and xs != 1
    )
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def attention(
    q,
    k,
    v,
    bias=None,
    *,
    scale=None,
    soft_cap=None,
    d_out=None,
    d_lse=None,
    score_mod=None,
    mask_mod=None,
    sinks=None,
    normalizer="softmax",
    sigmoid_bias=None,
    kv_counts=None,
    **rules,
):
    """Forward (and, given ``d_out``, backward) of BTNH attention in float64.

    ``score_mod(score, b, h, i, j)`` and ``mask_mod(b, h, i, j)`` are applied to the whole
    (B, N, T, S) grid at once, by broadcasting index arrays; ``sinks`` (N,) add a key without a
    value to every row. A −∞ bias masks its key whatever the score_mod makes of it, as a −∞ the
    score_mod returns does. ``normalizer="sigmoid"``: weights σ(s + b), ``b`` the
    ``sigmoid_bias`` (a scalar or (N,)) or −log of each sequence's key count (``kv_counts``, or
    its ``kv_lengths``, at least 1); ``lse`` is then the log of each row's total weight.

    Returns a dict with ``out`` (B,T,N,V), ``lse`` (B,T,N), ``max_scores`` (B,T,N), the largest
    allowed score of each row (−∞ for none), ``weights`` (B,N,T,S), ``allowed``
    and, with ``d_out`` (and optionally ``d_lse``, the log-sum-exp's cotangent, 0 where it is
    −∞), the gradients ``dq``, ``dk``, ``dv``, ``dbias``, ``dsinks``, and ``d_scores``, the
    gradient of the scores the score_mod returns (for the arrays it closes over).
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    scale = 1.0 / np.sqrt(h) if scale is None else scale
    kf, vf = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # head i uses kv head i // g
    raw = np.einsum("btnh,bsnh->bnts", q, kf) * scale
    scores = soft_cap * np.tanh(raw / soft_cap) if soft_cap else raw
    if bias is not None:
        scores = scores + np.asarray(bias, np.float64)
    allowed = allowed_keys((b, n, t, s), **rules) & (scores != -np.inf)
    grid = np.arange(b)[:, None, None, None], np.arange(n)[:, None, None], *np.indices((t, s))
    before_mod = np.where(allowed, scores, 0)  # what the score_mod sees where a bias masked
    if score_mod is not None:
        scores = np.broadcast_to(score_mod(before_mod, *grid), allowed.shape)
        allowed &= scores != -np.inf
    if mask_mod is not None:
        allowed &= np.broadcast_to(mask_mod(*grid), allowed.shape)
    masked = np.where(allowed, scores, -np.inf)
    if sinks is not None:  # one more key per row, always allowed, whose value is 0
        sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (b, n, t, 1))
        masked = np.concatenate([masked, sink], axis=-1)
    sigmoid = normalizer == "sigmoid"
    if sigmoid:
        if sigmoid_bias is None:
            counts = rules.get("kv_lengths") if kv_counts is None else kv_counts
            counts = np.full(b, s) if counts is None else np.maximum(np.asarray(counts), 1)
            offset = -np.log(counts.astype(np.float64))[:, None, None, None]
        else:
            offset = np.broadcast_to(np.asarray(sigmoid_bias, np.float64), (n,))[:, None, None]
        full_weights = np.where(
            allowed, 1 / (1 + np.exp(-(np.where(allowed, scores, 0) + offset))), 0
        )
        denom = full_weights.sum(-1, keepdims=True)
        row_max = np.zeros_like(denom)
    else:
        row_max = np.max(masked, axis=-1, keepdims=True)
        row_max = np.where(np.isfinite(row_max), row_max, 0.0)
        p = np.where(np.isfinite(masked), np.exp(masked - row_max), 0.0)
        denom = p.sum(-1, keepdims=True)
        full_weights = p / np.where(denom > 0, denom, 1.0)  # with the sink's column
    weights = full_weights[..., :s]
    out = np.einsum("bnts,bsnv->btnv", weights, vf)
    with np.errstate(divide="ignore"):
        lse = np.where(denom[..., 0] > 0, row_max[..., 0] + np.log(denom[..., 0]), -np.inf)
    top = np.where(allowed, scores, -np.inf).max(axis=-1, initial=-np.inf)  # the keys', not sinks'
    result = {
        "out": out,
        "lse": lse.transpose(0, 2, 1),
        "weights": weights,
        "allowed": allowed,
        "max_scores": top.transpose(0, 2, 1),
    }
    if d_out is None:
        return result
    d_out = np.asarray(d_out, np.float64)
    d_lse = np.zeros((b, t, n)) if d_lse is None else np.asarray(d_lse, np.float64)
    d_lse = np.where(np.isfinite(lse.transpose(0, 2, 1)), d_lse, 0).transpose(0, 2, 1)
    dvf = np.einsum("bnts,btnv->bsnv", weights, d_out)
    dw = np.einsum("btnv,bsnv->bnts", d_out, vf)
    dw = np.concatenate([dw, np.zeros((b, n, t, full_weights.shape[-1] - s))], axis=-1)
    if sigmoid:  # ∂lse/∂s = W(1 − W) / rowsum(W)
        total = np.where(denom > 0, denom, 1.0)
        ds_full = full_weights * (1 - full_weights) * (dw + d_lse[..., None] / total)
    else:
        rows = (full_weights * dw).sum(-1, keepdims=True)
        ds_full = full_weights * (dw - rows + d_lse[..., None])  # ∂lse/∂s = W
    ds = ds_full[..., :s]
    if score_mod is not None:  # the chain through the mod, by a central difference per entry
        step = 1e-5 * (1 + np.abs(before_mod))
        up, down = (score_mod(before_mod + x, *grid) for x in (step, -step))
        slope = np.where(allowed, (up - down) / (2 * step), 0)
        ds = ds * np.broadcast_to(slope, ds.shape)
    d_raw = ds * (1 - np.tanh(raw / soft_cap) ** 2) if soft_cap else ds
    dq = scale * np.einsum("bnts,bsnh->btnh", d_raw, kf)
    dkf = scale * np.einsum("bnts,btnh->bsnh", d_raw, q)
    result["dq"] = dq
    result["dk"] = dkf.reshape(b, s, kh, g, h).sum(3)
    result["dv"] = dvf.reshape(b, s, kh, g, -1).sum(3)
    result["dbias"] = None if bias is None else _sum_to(ds, np.shape(bias))
    result["dsinks"] = None if sinks is None else ds_full[..., s].sum(axis=(0, 2))
    result["d_scores"] = ds_full[..., :s]
    result["before_mod"] = before_mod
    return result


def rel_err(x, ref):
    """max |x − ref| / max |ref| (0 when both are 0)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    scale = np.abs(ref).max()
    return float(np.abs(x - ref).max() / scale) if scale > 0 else float(np.abs(x).max())
