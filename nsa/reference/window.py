"""Sliding-window attention, the paper's local branch (Sec. 3.3.3), as readable XLA.

Key j is visible to query t iff t - window_size < j <= t and both are in the same sequence. Each query
knows its key row (the global row of its own token in k: t itself, or kv_lens[b] - T + t when the
queries are the last T tokens of longer sequences in a KV cache). A chunk of Tc queries whose first key
row is r0 needs only the key rows [r0 - W + 1, r0 + Tc), W = min(window_size, TK): a static-size slice
of the keys, padded with W - 1 zero rows in front (padded row r0 is key r0 - W + 1).
"""

import jax
import jax.numpy as jnp
from jax import lax

from nsa._varlen import cdiv, tokens
from nsa.reference import _common as c


def _layout(q, k, v, cu_seqlens, kv_lens, window_size):
    """(W, chunk, padded keys, padded values, the chunks' inputs: key row and position [B or 1, T]).

    W = max(1, min(window_size, TK)) is the effective window; the keys and values are padded in the
    accumulation dtype with W - 1 rows in front and up to whole chunks behind.
    """
    B, T, HQ, Dk = q.shape
    W = max(1, min(window_size, k.shape[1]))
    chunk = c.chunk_size(T, 8 * (2 * HQ + 2 * max(Dk, v.shape[3])) * (W + 256))
    acc = c.acc_dtype(q.dtype)
    k_pad, v_pad = _pad_keys(k.astype(acc), W, T, chunk), _pad_keys(v.astype(acc), W, T, chunk)
    tok = tokens(T, 1, cu_seqlens, kv_lens)
    return W, chunk, k_pad, v_pad, tok.start + tok.pos, tok.pos


def _pad_keys(x, W, T, chunk):
    """Pads x [B, TK, H, D] on TK with W - 1 rows in front and, behind, the rows the T queries' last chunk
    may slice past TK."""
    return jnp.pad(x, [(0, 0), (W - 1, cdiv(T, chunk) * chunk - T), (0, 0), (0, 0)])


def _rows(x, r0, size):
    """x [B, N, ...] sliced to the rows [r0[b], r0[b] + size) of each batch row (r0 [B] or [1])."""
    r0 = jnp.broadcast_to(r0, x.shape[:1])
    return jax.vmap(lambda x_b, r_b: lax.dynamic_slice_in_dim(x_b, r_b, size, axis=0))(x, r0)


def _add_rows(acc, r0, update):
    """acc [B, N, ...] with update [B, size, ...] added at the rows [r0[b], r0[b] + size)."""
    r0 = jnp.broadcast_to(r0, acc.shape[:1])
    add = lambda a_b, r_b, u_b: lax.dynamic_update_slice_in_dim(
        a_b, lax.dynamic_slice_in_dim(a_b, r_b, u_b.shape[0], axis=0) + u_b, r_b, axis=0)
    return jax.vmap(add)(acc, r0, update)


def _visible(row, pos, W, chunk, window_size):
    """The chunk's first key row r0 [B or 1] and the mask [B or 1, Tc, 1, 1, Tc + W - 1] of its keys
    r0 - W + 1 + i."""
    r0 = row[:, 0]
    j = (r0[:, None] - (W - 1) + jnp.arange(chunk + W - 1))[:, None, None, None, :]
    row = row[:, :, None, None, None]
    sequence_start = row - pos[:, :, None, None, None]
    return r0, (j > row - window_size) & (j <= row) & (j >= sequence_start)


def _chunk_logits(q_c, row, pos, k_pad, v_pad, W, chunk, window_size, scale):
    """The chunk's grouped queries, keys and values [B, Tc + W - 1, H, D] (the keys no query of the chunk
    sees set to 0, whatever they hold), logits, mask and r0."""
    r0, mask = _visible(row, pos, W, chunk, window_size)
    used = jnp.any(mask, axis=(1, 2, 3))[:, :, None, None]
    keys = jnp.where(used, _rows(k_pad, r0, chunk + W - 1), 0.0)
    values = jnp.where(used, _rows(v_pad, r0, chunk + W - 1), 0.0)
    q_c = c.group_heads(q_c.astype(k_pad.dtype), k_pad.shape[2])
    return q_c, keys, values, scale * jnp.einsum("bthgd,bjhd->bthgj", q_c, keys), mask, r0


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ]); k, v [B, TK, H, D], TK = T
    unless kv_lens int [B] places the queries at the end of longer sequences (`nsa._varlen.tokens`)."""
    W, chunk, k_pad, v_pad, row, pos = _layout(q, k, v, cu_seqlens, kv_lens, window_size)

    def body(_, xs):
        _, _, values, s, mask, _ = _chunk_logits(*xs, k_pad, v_pad, W, chunk, window_size, scale)
        p, lse = c.softmax(s, mask)
        o = jnp.einsum("bthgj,bjhd->bthgd", p, values)
        return None, (c.ungroup_heads(o).astype(q.dtype), c.ungroup_heads(lse))

    _, (o, lse) = c.scan_queries(body, None, (q, row, pos), chunk=chunk)
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale):
    """Gradients (dq, dk, dv, None, None) from the recomputed probabilities."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    TK, H = k.shape[1], k.shape[2]
    W, chunk, k_pad, v_pad, row, pos = _layout(q, k, v, cu_seqlens, kv_lens, window_size)

    def body(carry, xs):
        dk, dv = carry
        q_c, row, pos, do_c, lse_c, delta_c = xs
        q_c, keys, values, s, mask, r0 = _chunk_logits(q_c, row, pos, k_pad, v_pad, W, chunk, window_size, scale)
        do_c = c.group_heads(do_c.astype(k_pad.dtype), H)
        p = c.probabilities(s, mask, c.group_heads(lse_c, H))
        dp = jnp.einsum("bthgd,bjhd->bthgj", do_c, values)
        ds = c.dlogits(p, dp, c.group_heads(delta_c, H))
        dq = scale * jnp.einsum("bthgj,bjhd->bthgd", ds, keys)
        dk = _add_rows(dk, r0, scale * jnp.einsum("bthgj,bthgd->bjhd", ds, q_c))
        dv = _add_rows(dv, r0, jnp.einsum("bthgj,bthgd->bjhd", p, do_c))
        return (dk, dv), c.ungroup_heads(dq).astype(q.dtype)

    zeros = (jnp.zeros_like(k_pad), jnp.zeros_like(v_pad))
    xs = (q, row, pos, do, lse, c.delta(o, do))
    (dk, dv), dq = c.scan_queries(body, zeros, xs, chunk=chunk)
    return dq, dk[:, W - 1:W - 1 + TK].astype(k.dtype), dv[:, W - 1:W - 1 + TK].astype(v.dtype), None, None
