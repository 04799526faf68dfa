"""Block selection (`select_blocks`) as one Triton kernel: compressed-attention scores fused with top-k.

The contract is nsa.reference.select's. Query t of KV head h, at in-sequence position p, sees the
compressed rows cmp_start <= r < cmp_start + (p + 1) // block_size; each of its G = HQ / H query heads
takes the softmax p_g(c) of scale * q_g . k_cmp over them, and block c (row cmp_start + c) scores
mean_g p_g(c). Blocks 0, p // bs - 1 and p // bs are forced (ranks 2, 3 and 4, above any score),
blocks after p // bs are never candidates; the block_counts best are kept in rank order, ties going
to the lower block id, unused slots -1.

`_select_kernel` never materializes the [T, NC] scores: one program per (token t, b * H + h) walks
the candidate blocks in chunks of BC twice, first for the log-sum-exp of each query head (online, in
base 2), then to recompute the probabilities, average them over the group and merge the chunk into a
running top-S kept in registers. Everything is float32 whatever the input dtype; a row's result
depends only on its own loads, so it is deterministic. Batched and packed sequences take one path:
the kernel reads pos and cmp_start (nsa._varlen.tokens) per token.

Layouts (contiguous): q [B, T, HQ, Dk], k_cmp [B, NC, H, Dk], out [B, T, H, block_counts] int32;
query head hq uses KV head hq // G. Token offsets are computed in int64 (b * T + t can be multiplied
past 2^31).
"""

import jax.numpy as jnp
import triton
import triton.language as tl

from nsa._varlen import tokens
from nsa.reference import select as reference
from nsa.triton import _launch


# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _logits(q_tile, k_cmp, first, blk, vis, b, h,
            NC: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
            SCALE: tl.constexpr, IEEE: tl.constexpr):
    """Base-2 logits [GP, BC] of the group's heads against the compressed rows first + blk (-inf where
    not vis); loads the key chunk transposed, k_cmp [B, NC, H, DK] -> DKP x BC, masked by vis."""
    dk = tl.arange(0, DKP)
    k_row = b * NC + first + tl.where(vis, blk, 0)  # masked lanes keep an in-bounds address
    k_t = tl.load(k_cmp + (k_row * H + h)[None, :] * DK + dk[:, None],
                  mask=vis[None, :] & (dk < DK)[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q_tile, k_t, input_precision="ieee")
    else:
        s = tl.dot(q_tile, k_t)
    return tl.where(vis[None, :], s * (SCALE * 1.4426950408889634), float("-inf"))


@triton.jit
def _beats(v_a, id_a, v_b, id_b):
    """Whether a ranks above b: a higher value, or an equal value and a lower id (broadcasting)."""
    return (v_a > v_b) | ((v_a == v_b) & (id_a < id_b))


@triton.jit
def _merge(vals, ids, cand, cand_ids, SP: tl.constexpr):
    """The best SP of the running top (vals, ids [SP], in rank order) and the chunk (cand, cand_ids [BC]).

    A merge by ranks, with no sequential rounds: an entry's rank in the union is the number of entries
    that beat it (ids are distinct, so exactly one entry has each rank), from the comparison matrices
    chunk x top [SP, BC] and chunk x chunk [BC, BC]; the entry of rank i goes to slot i. Values of -inf
    are empty and never placed; empty slots hold -inf and id -1.
    """
    slot = tl.arange(0, SP)
    cand_over_top = _beats(cand[None, :], cand_ids[None, :], vals[:, None], ids[:, None])  # [SP, BC]
    cand_over_cand = _beats(cand[:, None], cand_ids[:, None], cand[None, :], cand_ids[None, :])  # [BC, BC]
    rank_top = slot + tl.sum(cand_over_top.to(tl.int32), 1)
    rank_cand = (tl.sum(tl.where(cand_over_top, 0, 1), 0)  # the top's entries that beat the candidate
                 + tl.sum(cand_over_cand.to(tl.int32), 0))
    at_top = (rank_top[None, :] == slot[:, None]) & (vals > float("-inf"))[None, :]  # [SP slots, SP]
    at_cand = (rank_cand[None, :] == slot[:, None]) & (cand > float("-inf"))[None, :]  # [SP slots, BC]
    new_vals = tl.maximum(tl.max(tl.where(at_top, vals[None, :], float("-inf")), 1),
                          tl.max(tl.where(at_cand, cand[None, :], float("-inf")), 1))
    new_ids = tl.maximum(tl.max(tl.where(at_top, ids[None, :], -1), 1),
                         tl.max(tl.where(at_cand, cand_ids[None, :], -1), 1))
    return new_vals, new_ids


@triton.jit
def _select_kernel(q, k_cmp, pos, cmp_start, out,
                   T: tl.constexpr, NC: tl.constexpr, H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr,
                   BS: tl.constexpr, S: tl.constexpr, SCALE: tl.constexpr, GP: tl.constexpr,
                   DKP: tl.constexpr, BC: tl.constexpr, SP: tl.constexpr, IEEE: tl.constexpr):
    """The top-S blocks of one (query token, KV head).

    Grid: (T, B * H). Tile: the G query heads of KV head h at token t, rows padded to GP (a power of
    two >= 16, masked), against BC compressed rows at a time.
    Loads q [B, T, HQ, DK] once (GP x DKP), pos and cmp_start [T] (int32, shared by the batch), then
    the key chunks k_cmp [B, NC, H, DK] (DKP x BC) twice: pass 1 over the visible rows
    [0, (p + 1) // BS) for the lse of each head; pass 2 over the candidate blocks [0, p // BS] (the
    current block may be one past the visible rows) for the scores, each chunk merged into the running
    top-S (SP = S padded to a power of two) unless it cannot enter it.
    Stores out [B, T, H, S] int32: block ids in rank order, -1 in unused slots.
    """
    t = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    row = b * T + t  # int64 global token row of the query
    p_t = tl.load(pos + t)
    first = tl.load(cmp_start + t)
    n_vis = (p_t + 1) // BS  # visible compressed rows
    cur = p_t // BS  # the current block; candidates are 0..cur

    g = tl.arange(0, GP)
    dk = tl.arange(0, DKP)
    c = tl.arange(0, BC)
    g_ok = g < G
    q_tile = tl.load(q + (row * (H * G) + h * G + g)[:, None] * DK + dk[None, :],
                     mask=g_ok[:, None] & (dk < DK)[None, :], other=0.0)

    # pass 1: lse (base 2) of each head over the visible rows; padded heads see q = 0, never used
    m = tl.full([GP], float("-inf"), tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    c0 = tl.full([], 0, tl.int32)  # a tensor: a loop-carried value must be one
    while c0 < n_vis:  # a while loop: Triton's interpreter cannot take loaded bounds in range()
        blk = c0 + c
        s = _logits(q_tile, k_cmp, first, blk, blk < n_vis, b, h, NC, H, DK, DKP, SCALE, IEEE)
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every chunk has a visible row
        l_sum = l_sum * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m = m_new
        c0 += BC
    lse2 = tl.where(l_sum > 0, m + tl.log2(tl.where(l_sum > 0, l_sum, 1.0)), 0.0)

    # pass 2: scores of the candidates 0..cur, merged chunk by chunk into the running top-S
    slot = tl.arange(0, SP)
    vals = tl.full([SP], float("-inf"), tl.float32)
    ids = tl.full([SP], -1, tl.int32)
    c0 = tl.full([], 0, tl.int32)
    while c0 <= cur:
        blk = c0 + c
        vis = blk < n_vis
        s = _logits(q_tile, k_cmp, first, blk, vis, b, h, NC, H, DK, DKP, SCALE, IEEE)
        p = tl.where(vis[None, :] & g_ok[:, None], tl.exp2(s - lse2[:, None]), 0.0)
        score = tl.sum(p, 0) / G
        score = tl.where(blk > cur, float("-inf"), score)
        # the forced ranks of nsa.reference.select (_FIRST, _PREVIOUS, _CURRENT), in its order
        score = tl.where(blk == 0, 2.0, score)
        score = tl.where(blk == cur - 1, 3.0, score)
        score = tl.where(blk == cur, 4.0, score)
        # the chunk's ids are above every id in the top, so it enters only with a strictly higher value
        threshold = tl.max(tl.where(slot == S - 1, vals, float("-inf")), 0)
        if tl.max(score, 0) > threshold:
            vals, ids = _merge(vals, ids, score, blk, SP)
        c0 += BC

    tl.store(out + (row * H + h) * S + slot, ids, mask=slot < S)


# ------------------------------------------------------------------------------------ wrappers


def _pow2(n, least=16):
    return max(least, triton.next_power_of_2(int(n)))


def _chunk(num_rows):
    """Compressed rows per step: 64, fewer (>= 16, tl.dot's least) when there are fewer rows."""
    return min(64, _pow2(num_rows + 1))


def forward(q, k_cmp, lse, cu_seqlens, *, block_counts, block_size, scale):
    """Returns block_indices int32 [B, T, H, block_counts] (in-sequence block ids), as the reference.

    lse (compressed attention's, or None) is not used yet: the kernel computes its own."""
    if q.dtype == jnp.float64 or k_cmp.dtype == jnp.float64 or q.size == 0 or k_cmp.size == 0:
        # Triton has no float64; empty grids do not launch
        return reference.forward(q, k_cmp, lse, cu_seqlens, block_counts=block_counts, block_size=block_size,
                                 scale=scale)
    B, T, HQ, Dk = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    G = HQ // H
    dtype = jnp.promote_types(q.dtype, k_cmp.dtype)  # tl.dot takes one dtype
    tok = tokens(T, block_size, cu_seqlens)
    dkp = _pow2(Dk)
    return _launch.triton_call(
        q.astype(dtype), k_cmp.astype(dtype), tok.pos[0], tok.cmp_start[0],
        kernel=_select_kernel,
        out_shape=_launch.shape_dtype((B, T, H, block_counts), jnp.int32),
        grid=(T, B * H), num_warps=8 if dkp > 128 else 4, num_stages=1,
        T=T, NC=NC, H=H, G=G, DK=Dk, BS=block_size, S=block_counts, SCALE=float(scale), GP=_pow2(G),
        DKP=dkp, BC=_chunk(T // block_size), SP=triton.next_power_of_2(block_counts),
        IEEE=bool(dtype == jnp.float32))
