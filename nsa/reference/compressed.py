"""Compressed attention, the paper's coarse-grained branch (Eq. 7), as readable XLA.

Each query attends to the compressed keys/values (one per window of l = block_size tokens every d = stride
tokens, from `compress`) of the windows that lie wholly in its past: the query at in-sequence position t sees
compressed row i iff i * d + l <= t + 1 (with d = l: block c iff (c + 1) * l - 1 <= t). It returns the output
and the log-sum-exp, which `select_blocks` turns into block scores.
"""

import jax.numpy as jnp

from nsa._varlen import complete_rows, tokens
from nsa.reference import _common as c


def visible_blocks(num_rows, pos, cmp_start, *, block_size, stride):
    """bool [1, Tc, 1, 1, NC]: which rows of k_cmp each query sees (its own sequence's, complete ones)."""
    row = jnp.arange(num_rows)
    first = cmp_start[:, :, None, None, None]
    return (row >= first) & (row < first + complete_rows(pos[:, :, None, None, None], block_size, stride))


def used_rows_only(x, visible):
    """x [B, NC, H, D] with the rows no query of the chunk sees (visible [B, Tc, H, G, NC]) set to 0, so
    that whatever they hold (a KV cache's unwritten rows) never reaches a result, not even as 0 * NaN."""
    used = jnp.any(visible, axis=(1, 2, 3))
    return jnp.where(used[:, :, None, None], x, 0)


def logits(q, k_cmp, scale):
    """q [B, Tc, H, G, Dk] (accumulation dtype) against every compressed key -> [B, Tc, H, G, NC]."""
    return scale * jnp.einsum("bthgd,bchd->bthgc", q, k_cmp.astype(q.dtype))


def softmax_over_blocks(q, k_cmp, pos, cmp_start, lse=None, *, block_size, stride, scale):
    """p [B, Tc, H, G, NC], lse [B, Tc, H, G] and the visibility mask of a chunk of queries q [B, Tc, HQ, Dk]
    over k_cmp.

    With a given lse [B, Tc, HQ] (this op's own, from an earlier call) p = exp(s - lse) is not
    normalized again.
    """
    H = k_cmp.shape[2]
    s = logits(c.group_heads(q.astype(c.acc_dtype(q.dtype)), H), k_cmp, scale)
    visible = visible_blocks(k_cmp.shape[1], pos, cmp_start, block_size=block_size, stride=stride)
    if lse is None:
        return (*c.softmax(s, visible), visible)
    lse = c.group_heads(lse.astype(s.dtype), H)
    return c.probabilities(s, visible, lse), lse, visible


def _chunk(T, HQ, NC):
    # logits and probabilities, in the accumulation dtype, per query
    return c.chunk_size(T, 16 * HQ * NC)


def forward(q, k_cmp, v_cmp, cu_seqlens, kv_lens=None, *, block_size, scale, stride=None):
    """Returns (o [B, T, HQ, Dv], lse [B, T, HQ] fp32) and the residuals; kv_lens int [B] or None places
    the queries at the end of longer sequences (`nsa._varlen.tokens`); stride None: block_size."""
    stride = block_size if stride is None else stride
    B, T, HQ, _ = q.shape
    NC = k_cmp.shape[1]
    acc = c.acc_dtype(q.dtype)
    tok = tokens(T, stride, cu_seqlens, kv_lens)

    def body(_, xs):
        q_c, pos, cmp_start = xs
        p, lse, visible = softmax_over_blocks(q_c, k_cmp, pos, cmp_start, block_size=block_size, stride=stride,
                                              scale=scale)
        o = jnp.einsum("bthgc,bchd->bthgd", p, used_rows_only(v_cmp.astype(acc), visible))
        return None, (c.ungroup_heads(o).astype(q.dtype), c.ungroup_heads(lse))

    _, (o, lse) = c.scan_queries(body, None, (q, tok.pos, tok.cmp_start), chunk=_chunk(T, HQ, NC))
    return (o, lse), (q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse)


def backward(residuals, cotangents, *, block_size, scale, stride=None):
    """Gradients (dq, dk_cmp, dv_cmp, None, None), including the path through lse."""
    stride = block_size if stride is None else stride
    q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse = residuals
    do, dlse = cotangents
    B, T, HQ, _ = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    acc = c.acc_dtype(q.dtype)
    tok = tokens(T, stride, cu_seqlens, kv_lens)

    def body(carry, xs):
        dk, dv = carry
        q_c, pos, cmp_start, do_c, lse_c, delta_c, dlse_c = xs
        q_c = c.group_heads(q_c.astype(acc), H)
        do_c = c.group_heads(do_c.astype(acc), H)
        visible = visible_blocks(NC, pos, cmp_start, block_size=block_size, stride=stride)
        k_c, v_c = (used_rows_only(x.astype(acc), visible) for x in (k_cmp, v_cmp))
        s = logits(q_c, k_c, scale)
        p = c.probabilities(s, visible, c.group_heads(lse_c, H))
        dp = jnp.einsum("bthgd,bchd->bthgc", do_c, v_c)
        ds = c.dlogits(p, dp, c.group_heads(delta_c, H), c.group_heads(dlse_c, H))
        dq = scale * jnp.einsum("bthgc,bchd->bthgd", ds, k_c)
        dk = dk + scale * jnp.einsum("bthgc,bthgd->bchd", ds, q_c)
        dv = dv + jnp.einsum("bthgc,bthgd->bchd", p, do_c)
        return (dk, dv), c.ungroup_heads(dq).astype(q.dtype)

    zeros = (jnp.zeros_like(k_cmp, acc), jnp.zeros_like(v_cmp, acc))
    xs = (q, tok.pos, tok.cmp_start, do, lse, c.delta(o, do), dlse.astype(acc))
    (dk, dv), dq = c.scan_queries(body, zeros, xs, chunk=_chunk(T, HQ, NC))
    return dq, dk.astype(k_cmp.dtype), dv.astype(v_cmp.dtype), None, None
