"""Top-n block selection (paper Eq. 8-11, in fla's form where compression and selection blocks coincide).

Per query head, p(c) is the softmax of the compressed attention over the visible compressed blocks;
a block's score is the mean of p(c) over the G query heads of its KV group, so the whole group shares
one selection. Blocks 0, t // bs - 1 and t // bs are always selected (ranked t // bs, t // bs - 1, 0),
blocks after t // bs never; the block_counts best are kept, ties going to the lower block id, and the
unused slots are -1. No gradient flows through the selection.
"""

import jax.numpy as jnp
from jax import lax

from nsa._varlen import cdiv, tokens
from nsa.reference import _common as c
from nsa.reference.compressed import softmax_over_blocks

# Ranks of the forced blocks, above any score (a mean of probabilities is at most 1).
CURRENT, PREVIOUS, FIRST = 4.0, 3.0, 2.0


def block_ranks(scores, pos, *, block_size):
    """Ranks of the in-sequence blocks [B, Tc, H, NB] from their scores; -inf for blocks after t // bs."""
    block = jnp.arange(scores.shape[-1])
    current = (pos // block_size)[:, :, None, None]
    rank = jnp.where(block > current, -jnp.inf, scores)
    rank = jnp.where(block == 0, FIRST, rank)
    rank = jnp.where(block == current - 1, PREVIOUS, rank)
    return jnp.where(block == current, CURRENT, rank)


def top_blocks(ranks, num_slots):
    """The num_slots best-ranked block ids [B, Tc, H, S] (ties to the lower id), -1 for -inf ranks."""
    missing = num_slots - ranks.shape[-1]
    if missing > 0:
        ranks = jnp.pad(ranks, [(0, 0)] * (ranks.ndim - 1) + [(0, missing)], constant_values=-jnp.inf)
    best, ids = lax.top_k(ranks, num_slots)
    return jnp.where(best == -jnp.inf, -1, ids).astype(jnp.int32)


def forward(q, k_cmp, lse, cu_seqlens, kv_lens=None, *, block_counts, block_size, scale):
    """Returns block_indices int32 [B, T, H, block_counts] (in-sequence block ids).

    lse [B, T, HQ] is compressed attention's log-sum-exp of the same q and k_cmp when the caller has
    it (nsa.attention does), or None to compute it here. kv_lens int [B] or None places the queries at the
    end of longer sequences (`nsa._varlen.tokens`), which k_cmp covers (kv_lens <= NC * block_size).
    """
    B, T, HQ, _ = q.shape
    NC = k_cmp.shape[1]
    # the most in-sequence blocks a query can have (without kv_lens k_cmp may hold fewer rows)
    NB = cdiv(T, block_size) if kv_lens is None else max(cdiv(T, block_size), NC)
    tok = tokens(T, block_size, cu_seqlens, kv_lens)

    def body(_, xs):
        q_c, pos, cmp_start, lse_c = xs
        p, _, _ = softmax_over_blocks(q_c, k_cmp, pos, cmp_start, lse_c, block_size=block_size, scale=scale)
        by_row = jnp.mean(p, axis=3)  # [B, Tc, H, NC]: score of each row of k_cmp
        # in-sequence block c is row cmp_start + c; rows past the last of k_cmp score 0 (a zero column)
        by_row = jnp.pad(by_row, [(0, 0)] * 3 + [(0, 1)])
        rows = jnp.minimum(cmp_start[:, :, None, None] + jnp.arange(NB), NC)
        by_block = jnp.take_along_axis(by_row, jnp.broadcast_to(rows, by_row.shape[:3] + (NB,)), axis=-1)
        return None, top_blocks(block_ranks(by_block, pos, block_size=block_size), block_counts)

    _, idx = c.scan_queries(body, None, (q, tok.pos, tok.cmp_start, lse), chunk=c.chunk_size(T, 24 * HQ * NC))
    return idx
