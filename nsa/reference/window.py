"""Sliding-window attention, the paper's local branch (Sec. 3.3.3), as readable XLA.

Key j is visible to query t iff t - window_size < j <= t and both are in the same sequence. A chunk of
Tc queries starting at t0 needs only the keys [t0 - W + 1, t0 + Tc), W = min(window_size, T): a
static-size slice of the keys, padded with W - 1 zero rows in front (padded row t0 is key t0 - W + 1).
"""

import jax.numpy as jnp
from jax import lax

from nsa._varlen import cdiv, tokens
from nsa.reference import _common as c


def _layout(q, k, v, cu_seqlens, window_size):
    """(W, chunk, padded keys, padded values, the chunks' inputs t and pos [1, T]).

    W = min(window_size, T) is the effective window; the keys and values are padded in the
    accumulation dtype with W - 1 rows in front and up to whole chunks behind.
    """
    B, T, HQ, Dk = q.shape
    W = max(1, min(window_size, T))
    chunk = c.chunk_size(T, 8 * (2 * HQ + 2 * max(Dk, v.shape[3])) * (W + 256))
    acc = c.acc_dtype(q.dtype)
    k_pad, v_pad = _pad_keys(k.astype(acc), W, chunk), _pad_keys(v.astype(acc), W, chunk)
    return W, chunk, k_pad, v_pad, jnp.arange(T, dtype=jnp.int32)[None], tokens(T, 1, cu_seqlens).pos


def _pad_keys(x, W, chunk):
    """Pads x [B, T, H, D] on T with W - 1 rows in front and up to whole chunks behind."""
    T = x.shape[1]
    return jnp.pad(x, [(0, 0), (W - 1, cdiv(T, chunk) * chunk - T), (0, 0), (0, 0)])


def _visible(t, pos, W, chunk, window_size):
    """The chunk's first query t0 and the mask [1, Tc, 1, 1, Tc + W - 1] of its keys t0 - W + 1 + i."""
    t0 = t[0, 0]
    j = t0 - (W - 1) + jnp.arange(chunk + W - 1)
    t = t[:, :, None, None, None]
    sequence_start = t - pos[:, :, None, None, None]
    return t0, (j > t - window_size) & (j <= t) & (j >= sequence_start)


def _chunk_logits(q_c, t, pos, k_pad, v_pad, W, chunk, window_size, scale):
    """The chunk's grouped queries, keys, values [B, Tc + W - 1, H, D], logits and mask, and t0."""
    t0, mask = _visible(t, pos, W, chunk, window_size)
    keys = lax.dynamic_slice_in_dim(k_pad, t0, chunk + W - 1, axis=1)
    values = lax.dynamic_slice_in_dim(v_pad, t0, chunk + W - 1, axis=1)
    q_c = c.group_heads(q_c.astype(k_pad.dtype), k_pad.shape[2])
    return q_c, keys, values, scale * jnp.einsum("bthgd,bjhd->bthgj", q_c, keys), mask, t0


def forward(q, k, v, cu_seqlens, *, window_size, scale):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ])."""
    W, chunk, k_pad, v_pad, t, pos = _layout(q, k, v, cu_seqlens, window_size)

    def body(_, xs):
        _, _, values, s, mask, _ = _chunk_logits(*xs, k_pad, v_pad, W, chunk, window_size, scale)
        p, lse = c.softmax(s, mask)
        o = jnp.einsum("bthgj,bjhd->bthgd", p, values)
        return None, (c.ungroup_heads(o).astype(q.dtype), c.ungroup_heads(lse))

    _, (o, lse) = c.scan_queries(body, None, (q, t, pos), chunk=chunk)
    return o, (q, k, v, cu_seqlens, o, lse)


def backward(residuals, do, *, window_size, scale):
    """Gradients (dq, dk, dv, None) from the recomputed probabilities."""
    q, k, v, cu_seqlens, o, lse = residuals
    T, H = q.shape[1], k.shape[2]
    W, chunk, k_pad, v_pad, t, pos = _layout(q, k, v, cu_seqlens, window_size)

    def body(carry, xs):
        dk, dv = carry
        q_c, t, pos, do_c, lse_c, delta_c = xs
        q_c, keys, values, s, mask, t0 = _chunk_logits(q_c, t, pos, k_pad, v_pad, W, chunk, window_size, scale)
        do_c = c.group_heads(do_c.astype(k_pad.dtype), H)
        p = c.probabilities(s, mask, c.group_heads(lse_c, H))
        dp = jnp.einsum("bthgd,bjhd->bthgj", do_c, values)
        ds = c.dlogits(p, dp, c.group_heads(delta_c, H))
        dq = scale * jnp.einsum("bthgj,bjhd->bthgd", ds, keys)
        dk_c = scale * jnp.einsum("bthgj,bthgd->bjhd", ds, q_c)
        dv_c = jnp.einsum("bthgj,bthgd->bjhd", p, do_c)
        dk = lax.dynamic_update_slice_in_dim(dk, lax.dynamic_slice_in_dim(dk, t0, chunk + W - 1, 1) + dk_c, t0, 1)
        dv = lax.dynamic_update_slice_in_dim(dv, lax.dynamic_slice_in_dim(dv, t0, chunk + W - 1, 1) + dv_c, t0, 1)
        return (dk, dv), c.ungroup_heads(dq).astype(q.dtype)

    zeros = (jnp.zeros_like(k_pad), jnp.zeros_like(v_pad))
    xs = (q, t, pos, do, lse, c.delta(o, do))
    (dk, dv), dq = c.scan_queries(body, zeros, xs, chunk=chunk)
    return dq, dk[:, W - 1:W - 1 + T].astype(k.dtype), dv[:, W - 1:W - 1 + T].astype(v.dtype), None
