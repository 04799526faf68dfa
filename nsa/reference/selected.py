"""Selected attention, the paper's fine-grained branch (Eq. 10-12), as readable XLA.

Query t of KV head h, with its G query heads, attends to the raw tokens of the blocks listed in
block_indices[b, t, h, :count]: block c holds the in-sequence positions [c * bs, (c + 1) * bs), of
which only those <= t are attended. Entries < 0 or > t // bs are skipped (their keys are never used),
and a block listed twice is attended twice.

The queries are processed in chunks of Tc; for each chunk the selected keys are gathered into
[B, Tc, H, S * bs, D], so the whole-sequence [T, S * bs] logits never exist at once.
"""

import jax.numpy as jnp

from nsa._varlen import tokens
from nsa.reference import _common as c


def selected_keys(block_indices, block_counts, pos, start, *, block_size):
    """The keys each (query, KV head) attends.

    Args:
      block_indices: int [B, Tc, H, S], in-sequence block ids.
      block_counts: int [B, Tc, H], how many leading slots are used.
      pos, start: int [1, Tc], in-sequence position and sequence start of each query.

    Returns:
      idx: int32 [B, Tc, H, S * bs], global token index of each key (0 where not attended);
      attended: bool [B, Tc, H, S * bs].
    """
    B, Tc, H, S = block_indices.shape
    pos = pos[:, :, None, None, None]
    block = block_indices[..., None].astype(jnp.int32)  # [B, Tc, H, S, 1]
    slot_used = jnp.arange(S)[:, None] < block_counts[..., None, None]
    in_range = (block >= 0) & (block <= pos // block_size)
    key_pos = jnp.where(in_range, block, 0) * block_size + jnp.arange(block_size)  # [B, Tc, H, S, bs]
    attended = slot_used & in_range & (key_pos <= pos)
    idx = jnp.where(attended, start[:, :, None, None, None] + key_pos, 0)
    return idx.reshape(B, Tc, H, S * block_size), attended.reshape(B, Tc, H, S * block_size)


def _chunk_keys(k, v, block_indices, block_counts, pos, start, block_size):
    """Gathers the attended keys and values of a chunk: [B, Tc, H, K, D], zero where not attended."""
    idx, attended = selected_keys(block_indices, block_counts, pos, start, block_size=block_size)
    acc = c.acc_dtype(k.dtype)
    keys = jnp.where(attended[..., None], c.gather_tokens(k, idx).astype(acc), 0.0)
    values = jnp.where(attended[..., None], c.gather_tokens(v, idx).astype(acc), 0.0)
    return idx, attended, keys, values


def _logits(q, keys, scale):
    return scale * jnp.einsum("bthgd,bthkd->bthgk", q, keys)


def _chunk(T, HQ, S, block_size, D):
    # keys + values + logits, in the accumulation dtype, per query
    return c.chunk_size(T, 8 * S * block_size * (2 * D + HQ))


def forward(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens=None, *, block_size, scale):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ]); kv_lens int [B] or None
    places the queries at the end of longer sequences of keys k, v [B, TK, H, D] (`nsa._varlen.tokens`)."""
    B, T, HQ, Dk = q.shape
    H, S = k.shape[2], block_indices.shape[-1]
    acc = c.acc_dtype(q.dtype)
    tok = tokens(T, block_size, cu_seqlens, kv_lens)

    def body(_, xs):
        q_c, idx_c, counts_c, pos, start = xs
        _, attended, keys, values = _chunk_keys(k, v, idx_c, counts_c, pos, start, block_size)
        p, lse = c.softmax(_logits(c.group_heads(q_c.astype(acc), H), keys, scale), attended[:, :, :, None])
        o = jnp.einsum("bthgk,bthkd->bthgd", p, values)
        return None, (c.ungroup_heads(o).astype(q.dtype), c.ungroup_heads(lse))

    chunk = _chunk(T, HQ, S, block_size, max(Dk, v.shape[-1]))
    _, (o, lse) = c.scan_queries(body, None, (q, block_indices, block_counts, tok.pos, tok.start), chunk=chunk)
    return o, (q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, block_size, scale):
    """Gradients (dq, dk, dv, None, None, None, None) from the recomputed probabilities."""
    q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, o, lse = residuals
    B, T, HQ, Dk = q.shape
    H, S = k.shape[2], block_indices.shape[-1]
    acc = c.acc_dtype(q.dtype)
    tok = tokens(T, block_size, cu_seqlens, kv_lens)

    def body(carry, xs):
        dk, dv = carry
        q_c, idx_c, counts_c, pos, start, do_c, lse_c, delta_c = xs
        idx, attended, keys, values = _chunk_keys(k, v, idx_c, counts_c, pos, start, block_size)
        q_c = c.group_heads(q_c.astype(acc), H)
        do_c = c.group_heads(do_c.astype(acc), H)
        s = _logits(q_c, keys, scale)
        p = c.probabilities(s, attended[:, :, :, None], c.group_heads(lse_c, H))
        dp = jnp.einsum("bthgd,bthkd->bthgk", do_c, values)
        ds = c.dlogits(p, dp, c.group_heads(delta_c, H))
        dq = scale * jnp.einsum("bthgk,bthkd->bthgd", ds, keys)
        dk = c.scatter_add_tokens(dk, idx, scale * jnp.einsum("bthgk,bthgd->bthkd", ds, q_c))
        dv = c.scatter_add_tokens(dv, idx, jnp.einsum("bthgk,bthgd->bthkd", p, do_c))
        return (dk, dv), c.ungroup_heads(dq).astype(q.dtype)

    zeros = (jnp.zeros_like(k, acc), jnp.zeros_like(v, acc))
    xs = (q, block_indices, block_counts, tok.pos, tok.start, do, lse, c.delta(o, do))
    chunk = _chunk(T, HQ, S, block_size, max(Dk, v.shape[-1]))
    (dk, dv), dq = c.scan_queries(body, zeros, xs, chunk=chunk)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None
