"""Top-n block selection (paper Eq. 8-11).

Per query head, p(i) is the softmax of the compressed attention over the visible compressed rows (windows of
l = compress_block_size tokens every d = compress_stride tokens, `compressed`). Selection block j (l' =
block_size tokens: [j * l', (j + 1) * l')) scores, per query head, the paper's Eq. 9:

    sum over m < l' / d and n < l / d of p((l' / d) * j + m - n)

(p is 0 for rows the query does not see and for negative indices): each compressed row counts by its overlap
with the selection block, in units of d tokens (the paper prints the indices shifted by a block). With
l = d = l' (fla's form, the default) block j's score is p(j). A block's score is the mean over the G query
heads of its KV group, so the whole group shares one selection. Blocks 0, t // l' - 1 and t // l' are always
selected (ranked t // l', t // l' - 1, 0), blocks after t // l' never; the block_counts best are kept, ties going
to the lower block id, and the unused slots are -1. No gradient flows through the selection.
"""

import jax.numpy as jnp
from jax import lax

from nsa._plan import blocks_of, num_candidates, one_row_per_block
from nsa._varlen import tokens
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


def overlaps(block_size, compress_block_size, compress_stride):
    """Eq. 9 as {offset o: count}: selection block j scores sum_o count * p((l' / d) * j + o), o from
    -(l / d - 1) to l' / d - 1; count is how many d-token units row (l' / d) * j + o shares with block j."""
    per_block, per_row = block_size // compress_stride, compress_block_size // compress_stride
    return {o: min(per_block, per_row + o) - max(0, o) for o in range(1 - per_row, per_block)}


def unless_one_row_per_block(kernels, **blocks):
    """Raises ValueError naming `kernels` unless `blocks` (block_size, compress_block_size, compress_stride) are
    `one_row_per_block`."""
    if not one_row_per_block(**blocks):
        raise ValueError(f"the {kernels} selection kernel scores one compressed row per selection block "
                         f"(compress_block_size = compress_stride = block_size), got {blocks}; use "
                         f"implementation=None or 'xla'")


def block_scores(by_row, cmp_start, num_blocks, *, block_size, compress_block_size, compress_stride):
    """The Eq. 9 score [B, Tc, H, NB] of each in-sequence selection block from the score of each row of k_cmp,
    by_row [B, Tc, H, NC] (0 where the query does not see the row). In-sequence row i is row cmp_start + i
    (cmp_start [B or 1, Tc]); rows before a sequence's first and past the last of k_cmp score 0."""
    NC = by_row.shape[-1]
    by_row = jnp.pad(by_row, [(0, 0)] * 3 + [(0, 1)])  # column NC: a zero
    per_block = block_size // compress_stride
    first = cmp_start[:, :, None, None]
    scores = None
    for offset, count in overlaps(block_size, compress_block_size, compress_stride).items():
        row = per_block * jnp.arange(num_blocks) + offset  # in-sequence rows
        rows = jnp.where(row >= 0, jnp.minimum(first + row, NC), NC)
        term = jnp.take_along_axis(by_row, jnp.broadcast_to(rows, by_row.shape[:3] + (num_blocks,)), axis=-1)
        term = term if count == 1 else count * term
        scores = term if scores is None else scores + term
    return scores


def forward(q, k_cmp, lse, cu_seqlens, kv_lens=None, *, block_counts, block_size, scale, compress_block_size=None,
            compress_stride=None):
    """Returns block_indices int32 [B, T, H, block_counts] (in-sequence block ids).

    lse [B, T, HQ] is compressed attention's log-sum-exp of the same q and k_cmp when the caller has
    it (nsa.attention does), or None to compute it here. kv_lens int [B] or None places the queries at the
    end of longer sequences (`nsa._varlen.tokens`), which k_cmp covers (kv_lens <= NC * compress_stride).
    compress_block_size and compress_stride None: block_size.
    """
    _, compress_block_size, compress_stride = blocks_of(block_size, compress_block_size, compress_stride)
    B, T, HQ, _ = q.shape
    NC = k_cmp.shape[1]
    NB = num_candidates(T, NC, block_size, kv_lens, compress_stride)
    tok = tokens(T, compress_stride, cu_seqlens, kv_lens)
    mapping = dict(block_size=block_size, compress_block_size=compress_block_size, compress_stride=compress_stride)

    def body(_, xs):
        q_c, pos, cmp_start, lse_c = xs
        p, _, _ = softmax_over_blocks(q_c, k_cmp, pos, cmp_start, lse_c, block_size=compress_block_size,
                                      stride=compress_stride, scale=scale)
        by_row = jnp.mean(p, axis=3)  # [B, Tc, H, NC]: score of each row of k_cmp
        by_block = block_scores(by_row, cmp_start, NB, **mapping)
        return None, top_blocks(block_ranks(by_block, pos, block_size=block_size), block_counts)

    _, idx = c.scan_queries(body, None, (q, tok.pos, tok.cmp_start, lse), chunk=c.chunk_size(T, 24 * HQ * NC))
    return idx
