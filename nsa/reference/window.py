"""Sliding-window attention, the paper's local branch (Sec. 3.3.3), as readable XLA.

Key j is visible to query t iff t - window_size < j <= t and both are in the same sequence. Each query
knows its key row (the global row of its own token in k: t itself, or kv_lens[b] - T + t when the
queries are the last T tokens of longer sequences in a KV cache). A chunk of Tc queries whose first key
row is r0 needs only the key rows [r0 - W + 1, r0 + Tc), W = min(window_size, TK): a static-size gather
of the keys (rows outside k clipped, then masked), so a decode step reads O(window) keys, never all TK.
"""

import jax.numpy as jnp

from nsa._varlen import tokens
from nsa.reference import _common as c


def _layout(q, k, v, cu_seqlens, kv_lens, window_size):
    """(W, chunk, the chunks' inputs: key row and position [B or 1, T]); W = max(1, min(window_size, TK)) is
    the effective window."""
    B, T, HQ, Dk = q.shape
    W = max(1, min(window_size, k.shape[1]))
    chunk = c.chunk_size(T, 8 * (2 * HQ + 2 * max(Dk, v.shape[3])) * (W + 256))
    tok = tokens(T, 1, cu_seqlens, kv_lens)
    return W, chunk, tok.start + tok.pos, tok.pos


def _key_rows(row, W, chunk):
    """The key rows j = r0 - W + 1 + i [B or 1, Tc + W - 1] of a chunk whose first query's key row is r0."""
    return row[:, :1] - (W - 1) + jnp.arange(chunk + W - 1)


def _visible(row, pos, j, window_size):
    """The mask [B or 1, Tc, 1, 1, Tc + W - 1]: which key rows j each query of the chunk sees."""
    j = j[:, None, None, None, :]
    row = row[:, :, None, None, None]
    sequence_start = row - pos[:, :, None, None, None]
    return (j > row - window_size) & (j <= row) & (j >= sequence_start)


def _chunk_logits(q_c, row, pos, k, v, W, chunk, window_size, scale):
    """The chunk's grouped queries, its keys and values [B, Tc + W - 1, H, D] (gathered at the key rows,
    clipped into k; the rows no query of the chunk sees set to 0, whatever they hold), logits, mask and the
    gathered rows [B, Tc + W - 1]."""
    j = _key_rows(row, W, chunk)
    mask = _visible(row, pos, j, window_size)
    rows = jnp.broadcast_to(jnp.clip(j, 0, k.shape[1] - 1), (k.shape[0], j.shape[1]))
    used = jnp.any(mask, axis=(1, 2, 3))[:, :, None, None]
    acc = c.acc_dtype(q_c.dtype)
    b = jnp.arange(k.shape[0])[:, None]
    keys = jnp.where(used, k[b, rows].astype(acc), 0.0)
    values = jnp.where(used, v[b, rows].astype(acc), 0.0)
    q_c = c.group_heads(q_c.astype(acc), k.shape[2])
    return q_c, keys, values, scale * jnp.einsum("bthgd,bjhd->bthgj", q_c, keys), mask, rows


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ]); k, v [B, TK, H, D], TK = T
    unless kv_lens int [B] places the queries at the end of longer sequences (`nsa._varlen.tokens`)."""
    W, chunk, row, pos = _layout(q, k, v, cu_seqlens, kv_lens, window_size)

    def body(_, xs):
        _, _, values, s, mask, _ = _chunk_logits(*xs, k, v, W, chunk, window_size, scale)
        p, lse = c.softmax(s, mask)
        o = jnp.einsum("bthgj,bjhd->bthgd", p, values)
        return None, (c.ungroup_heads(o).astype(q.dtype), c.ungroup_heads(lse))

    _, (o, lse) = c.scan_queries(body, None, (q, row, pos), chunk=chunk)
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale):
    """Gradients (dq, dk, dv, None, None) from the recomputed probabilities."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    H = k.shape[2]
    W, chunk, row, pos = _layout(q, k, v, cu_seqlens, kv_lens, window_size)
    b = jnp.arange(k.shape[0])[:, None]

    def body(carry, xs):
        dk, dv = carry
        q_c, row, pos, do_c, lse_c, delta_c = xs
        q_c, keys, values, s, mask, rows = _chunk_logits(q_c, row, pos, k, v, W, chunk, window_size, scale)
        do_c = c.group_heads(do_c.astype(keys.dtype), H)
        p = c.probabilities(s, mask, c.group_heads(lse_c, H))
        dp = jnp.einsum("bthgd,bjhd->bthgj", do_c, values)
        ds = c.dlogits(p, dp, c.group_heads(delta_c, H))
        dq = scale * jnp.einsum("bthgj,bjhd->bthgd", ds, keys)
        # rows clipped into k repeat a row, with zero contributions (no query sees them): exact
        dk = dk.at[b, rows].add(scale * jnp.einsum("bthgj,bthgd->bjhd", ds, q_c))
        dv = dv.at[b, rows].add(jnp.einsum("bthgj,bthgd->bjhd", p, do_c))
        return (dk, dv), c.ungroup_heads(dq).astype(q.dtype)

    acc = c.acc_dtype(q.dtype)
    zeros = (jnp.zeros_like(k, acc), jnp.zeros_like(v, acc))
    xs = (q, row, pos, do, lse, c.delta(o, do))
    (dk, dv), dq = c.scan_queries(body, zeros, xs, chunk=chunk)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None
