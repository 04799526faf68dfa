"""Selected attention (the fine-grained branch) as Triton kernels: forward, dq and a deterministic dk/dv.

The contract is nsa.reference.selected's: query t of KV head h, with its G = HQ / H query heads,
attends to the tokens at in-sequence positions <= t of the blocks listed in
block_indices[b, t, h, :block_counts[b, t, h]]. Entries < 0 or > t // block_size are skipped before
any of their keys is loaded; a block listed twice is attended twice; a query that sees nothing gets
o = 0, lse = -inf and zero gradients.

The decomposition follows fla's NSA kernels (batching the tokens of small groups is this module's own):

- forward (`_fwd_kernel`): one program per (TB consecutive query tokens, b * H + h), online softmax in
  float32 (base 2 inside, natural-log lse outside). Its tile has TB * GR rows, the G query heads of each
  token padded to GR = next_pow2(G) rows (row i: head i % GR of token t0 + i // GR), and tl.dot wants
  16 rows or more: groups of 16 or more run one token per program (TB = 1), smaller groups batch
  TB = 16 / GR tokens instead of padding a group to 16 rows. TB = 1 loops over the token's S slots (a
  block listed twice is loaded and attended twice). TB > 1 loads each distinct block its tokens list once
  for the whole tile: the TB * S slots are named by the key row where their block starts (sequence start +
  block * block_size, so equal in-sequence ids of two packed sequences are two blocks), sorted, and
  ranked by an associative scan, and block i of the loop is the value of rank i + 1. Row r sees key u of
  the block iff its token lists the block and u <= that token's position; a token that lists the block k times adds
  log2(k) to its rows' logits. Both loops are for loops with no carried block state, which Triton
  software-pipelines (the next block's keys load while this one is computed);
- backward: delta = sum(o * do) in XLA, then `_dq_kernel` on the forward's grid and tiles, recomputing the
  probabilities from lse. dk and dv walk, for each key block row of each (batch, KV head), the list of
  the queries that selected it: the selections inverted in JAX (a stable sort of the valid entries by
  (b, h, block row), offsets by searchsorted). These lists are far from even (block 0 and the current
  block are forced into every selection, so one list holds all T queries while the mean is about
  S * block_size), so each list is cut into segments of at most L entries (`_segment_length`, L near
  the mean list length): `_dkv_partial_kernel` runs one program per segment and stores float32
  partial dk and dv, and `_dkv_reduce_kernel`, one program per list, adds its segments' partials in
  segment order and stores dk and dv in the input dtype. No float atomics, so dk and dv are bitwise
  repeatable; the partial buffers have a static bound of NL + ceil(E / L) segments (NL = B * H * NR
  lists, E = B * T * H * S entries), each [block_size, Dk] and [block_size, Dv] in float32: 512 MiB at
  B = 1, T = 65536, H = 4, S = 16, block_size 64, Dk = Dv = 128 (L = 1024, 8192 segments).

With kv_lens (a KV cache) the T queries are the last tokens of sequences of kv_lens[b] tokens in k, v
[B, TK, H, D] (TK >= T): query t of batch row b sits at position kv_lens[b] - T + t (`nsa._varlen.tokens`:
pos and start are then per batch row), which indexes k's rows directly, and the dk/dv lists run over the
NR = ceil(TK / block_size) block rows of each (batch, KV head). No kernel loads a key past the position
of its batch row's last query, so a cache's rows at or past kv_lens[b] (anything, NaN too) never reach a
result, and get zero gradients. Without kv_lens TK = T.

Every array is indexed as [B, T, heads, D] (keys [B, TK, H, D]) row-major; token offsets (b * T + t) are
computed in int64 before they are multiplied by heads * D, which can pass 2^31.
"""

from typing import NamedTuple

import jax.numpy as jnp
import triton
import triton.language as tl

from nsa._config import Shapes, expect, positive, power_of_two, validated, wanted
from nsa._device import KiB
from nsa import _plan
from nsa._plan import kernel_delta
from nsa._varlen import cdiv, tokens
from nsa.triton import _launch, _splits
from nsa.triton import decode as flash_decoding
from nsa.triton._common import LN2, LOG2E, device, online_step, pow2, runs

# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _tile_rows(b, h, T: tl.constexpr, H: tl.constexpr, G: tl.constexpr, GR: tl.constexpr, TB: tl.constexpr):
    """The R = TB * GR rows of the tile of tokens t0 = program_id(0) * TB ... t0 + TB - 1 and KV head h of
    batch row b: row i is head i % GR of token t0 + i // GR. Returns (ok [R]: the row is a real (token, head);
    q_rows [R]: its int64 row (b * T + token) * HQ + h * G + i % GR of q, o, do, lse, delta and dq, the token
    clamped to T - 1)."""
    i = tl.arange(0, TB * GR)
    t = tl.program_id(0) * TB + i // GR
    return (t < T) & (i % GR < G), (b * T + tl.minimum(t, T - 1)) * (H * G) + h * G + i % GR


@triton.jit
def _per_row(x, TB: tl.constexpr, GR: tl.constexpr):
    """A value per token of the tile, x [TB], as a value per row [TB * GR] (row i: token i // GR)."""
    return tl.reshape(tl.broadcast_to(x[:, None], [TB, GR]), [TB * GR])


@triton.jit
def _valid_blocks(block_idx, block_counts, list_row, last, S: tl.constexpr, SP: tl.constexpr):
    """The S slots of block_idx [B, T, H, S] at list_row (= (b * T + t) * H + h; a scalar, or [TB, 1]) as
    block ids [SP] (or [TB, SP]), -1 where the slot is skipped: past block_counts [B, T, H], negative, or
    after the query's block `last`."""
    slots = tl.arange(0, SP)
    listed = tl.load(block_idx + list_row * S + slots, mask=slots < S, other=-1)
    count = tl.load(block_counts + list_row)
    return tl.where((slots < count) & (listed >= 0) & (listed <= last), listed, -1)


@triton.jit
def _token_blocks(block_idx, block_counts, pos, start, b, h, T: tl.constexpr, H: tl.constexpr, BS: tl.constexpr,
                  S: tl.constexpr, SP: tl.constexpr):
    """The one token t = program_id(0) of a TB = 1 tile: (its in-sequence position and sequence start, from
    pos and start [B, T], its slots as _valid_blocks)."""
    t = tl.program_id(0)
    p_t = tl.load(pos + b * T + t)
    return p_t, tl.load(start + b * T + t), _valid_blocks(block_idx, block_counts, (b * T + t) * H + h, p_t // BS, S=S,
                                                  SP=SP)


@triton.jit
def _tile_blocks(block_idx, block_counts, pos, start, b, h, T: tl.constexpr, TK: tl.constexpr, H: tl.constexpr,
                 BS: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, TB: tl.constexpr):
    """The distinct blocks the TB tokens of the tile list, in increasing order, so that each is loaded once.

    A block is named by its first key row, sequence start + block * BS (TK for a skipped slot), so that
    the same block id in two packed sequences names two blocks. Returns (tile, num): tile = (p, seq [TB]:
    the tokens' in-sequence positions and sequence starts from pos and start [B, T], tokens past T clamped
    to T - 1; firsts
    [TB, SP]: their slots so named; in_order [TB * SP]: firsts sorted; rank [TB * SP]: 1 + the number of
    distinct values below each), num: the number of distinct blocks. Block i < num starts at token
    min(in_order where rank == i + 1): _tile_block computes it from i alone, so the loop over the blocks
    has a trip count and no carried state, and Triton software-pipelines it."""
    t = tl.minimum(tl.program_id(0) * TB + tl.arange(0, TB), T - 1)
    p = tl.load(pos + b * T + t)
    seq = tl.load(start + b * T + t)
    blk = _valid_blocks(block_idx, block_counts, ((b * T + t) * H + h)[:, None], (p // BS)[:, None], S=S, SP=SP)
    firsts = tl.where(blk >= 0, seq[:, None] + blk * BS, TK)
    in_order = tl.sort(tl.reshape(firsts, [TB * SP]))
    _, _, rank = tl.associative_scan((in_order, in_order, tl.full([TB * SP], 1, tl.int32)), 0, runs)
    return (p, seq, firsts, in_order, rank), tl.max(tl.where(in_order < TK, rank, 0))


@triton.jit
def _tile_block(i, tile, TK: tl.constexpr, BS: tl.constexpr, TB: tl.constexpr, GR: tl.constexpr):
    """Block i of the tile of _tile_blocks, as _attend takes it: (its block id; its sequence start s_blk; the last
    position a row sees in it; p0 = r0 - s_blk, the key row r0 of the tile's first token (the smallest: key
    rows, start + pos, grow with the token) as a position in the block's sequence, so that row r's token is
    at position p0 + r // GR; row_bias [R, 1]: log2 of how many times the row's token lists the block, -inf
    where it does not, so that a block listed twice weighs twice and a row whose token does not list it sees
    none of it). The tokens that list a block are all of its sequence.
    """
    p, seq, firsts, in_order, rank = tile
    first = tl.min(tl.where(rank == i + 1, in_order, TK))
    listed = tl.sum((firsts == first).to(tl.float32), 1)  # [TB]
    seq_start = tl.max(tl.where(listed > 0, seq, 0))
    return ((first - seq_start) // BS, seq_start, tl.max(tl.where(listed > 0, p, -1)), tl.min(seq + p) - seq_start,
            _per_row(tl.where(listed > 0, tl.log2(tl.maximum(listed, 1.0)), float("-inf")), TB=TB, GR=GR)[:, None])


@triton.jit
def _block_keys(blk, chunk, p_last, s_blk, b, TK: tl.constexpr, BS: tl.constexpr, BSP: tl.constexpr):
    """Keys chunk * BSP + j, j < BSP, of in-sequence block blk of the sequence starting at key row s_blk of
    batch row b, up to position p_last: (their positions in the sequence, which are loaded (none if blk <
    0; none past p_last, so none past a cache's length), their int64 global rows of k [B, TK, H, DK], in
    bounds also where not loaded)."""
    j = chunk * BSP + tl.arange(0, BSP)
    key_pos = blk * BS + j
    seen = (blk >= 0) & (j < BS) & (key_pos <= p_last)
    return key_pos, seen, b * TK + s_blk + tl.where(seen, key_pos, 0)


@triton.jit
def _attend(q_tile, k, v, m, l_sum, acc, block, b, h,
            TK: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr,
            SCALE: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, BSP: tl.constexpr, NSUB: tl.constexpr,
            TB: tl.constexpr, GR: tl.constexpr):
    """The forward tile q_tile [R, DKP] against one block, block = (blk, s_blk, p_last, p0, row_bias) as
    _tile_block gives it: the keys of block blk of the sequence starting at key row s_blk, up to position
    p_last (_block_keys), are loaded once; row r (of token TB-tile-index r // GR) sees the key at position
    u iff u <= p0 + r // GR, with row_bias (a scalar or [R, 1]) added to its base-2 logits. Returns the
    online softmax state (running max m, sum l_sum [R], acc [R, DVP], float32) updated."""
    blk, s_blk, p_last, p0, row_bias = block
    dk = tl.arange(0, DKP)
    dv = tl.arange(0, DVP)
    for chunk in tl.static_range(NSUB):  # the block in chunks of BSP keys
        key_pos, seen, key_row = _block_keys(blk, chunk, p_last, s_blk, b, TK=TK, BS=BS, BSP=BSP)
        k_t = tl.load(k + (key_row * H + h)[None, :] * DK + dk[:, None],
                      mask=seen[None, :] & (dk < DK)[:, None], other=0.0)  # [DKP, BSP]
        v_tile = tl.load(v + (key_row * H + h)[:, None] * DV + dv[None, :],
                         mask=seen[:, None] & (dv < DV)[None, :], other=0.0)  # [BSP, DVP]
        s = tl.dot(q_tile, k_t, input_precision="ieee") * (SCALE * LOG2E) + row_bias
        row_pos = p0 + tl.arange(0, TB * GR) // GR
        m, l_sum, acc = online_step(m, l_sum, acc, s, v_tile, seen[None, :] & (key_pos[None, :] <= row_pos[:, None]),
                                    IEEE=True)
    return m, l_sum, acc


@triton.jit
def _fwd_kernel(q, k, v, block_idx, block_counts, pos, start, o, lse,
                T: tl.constexpr, TK: tl.constexpr, H: tl.constexpr, G: tl.constexpr, S: tl.constexpr, DK: tl.constexpr,
                DV: tl.constexpr, BS: tl.constexpr, SCALE: tl.constexpr, GR: tl.constexpr, TB: tl.constexpr,
                DKP: tl.constexpr, DVP: tl.constexpr, BSP: tl.constexpr, NSUB: tl.constexpr, SP: tl.constexpr):
    """Forward of selected attention for TB consecutive query tokens of one KV head.

    Grid: (ceil(T / TB), B * H). Tile: R = TB * GR rows (_tile_rows: the G heads of each token padded to
    GR = next_pow2(G)) against one key block of BS tokens at a time, in NSUB chunks of BSP keys.
    TB = 1 (G >= 16) walks the token's S slots in order, a block listed twice loaded twice. TB > 1 walks
    the distinct blocks its tokens list (_tile_blocks), in increasing order of first key row, each loaded
    once for the tile; a token that lists a block k times adds log2(k) to its rows' logits.
    Loads q [B, T, HQ, DK] (R x DKP), the slots of block_idx [B, T, H, S] with block_counts [B, T, H],
    pos and start [B, T] (each token's in-sequence position and sequence start) of the tile's tokens, then
    per block k [B, TK, H, DK] (DKP x BSP) and v [B, TK, H, DV] (BSP x DVP) up to the last position of the
    tile's tokens that list it. Stores o [B, T, HQ, DV] in o's dtype and lse [B, T, HQ] (float32, natural log, -inf
    where nothing is seen).
    """
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    ok, q_rows = _tile_rows(b, h, T=T, H=H, G=G, GR=GR, TB=TB)
    dk = tl.arange(0, DKP)
    dv = tl.arange(0, DVP)
    q_tile = tl.load(q + q_rows[:, None] * DK + dk[None, :], mask=ok[:, None] & (dk < DK)[None, :], other=0.0)

    m = tl.full([TB * GR], float("-inf"), tl.float32)  # running max of the base-2 logits
    l_sum = tl.zeros([TB * GR], tl.float32)
    acc = tl.zeros([TB * GR, DVP], tl.float32)
    if TB == 1:
        p_t, s_t, blocks = _token_blocks(block_idx, block_counts, pos, start, b, h, T=T, H=H, BS=BS, S=S, SP=SP)
        for slot in range(S):  # no branch on the slot: masked loads, so the pipeliner overlaps the blocks
            blk = tl.max(tl.where(tl.arange(0, SP) == slot, blocks, -1), 0)  # -1: skipped, nothing is loaded
            m, l_sum, acc = _attend(q_tile, k, v, m, l_sum, acc, (blk, s_t, p_t, p_t, 0.0), b, h, TK=TK, H=H,
                                    DK=DK, DV=DV, BS=BS, SCALE=SCALE, DKP=DKP, DVP=DVP, BSP=BSP, NSUB=NSUB, TB=TB,
                                    GR=GR)
    else:
        tile, num = _tile_blocks(block_idx, block_counts, pos, start, b, h, T=T, TK=TK, H=H, BS=BS, S=S, SP=SP,
                                 TB=TB)
        for i in range(num):
            block = _tile_block(i, tile, TK=TK, BS=BS, TB=TB, GR=GR)
            m, l_sum, acc = _attend(q_tile, k, v, m, l_sum, acc, block, b, h, TK=TK, H=H, DK=DK, DV=DV, BS=BS,
                                    SCALE=SCALE, DKP=DKP, DVP=DVP, BSP=BSP, NSUB=NSUB, TB=TB, GR=GR)

    any_seen = l_sum > 0
    out = acc / tl.where(any_seen, l_sum, 1.0)[:, None]
    tl.store(o + q_rows[:, None] * DV + dv[None, :], out.to(o.dtype.element_ty), mask=ok[:, None] & (dv < DV)[None, :])
    log_sum = tl.where(any_seen, (m + tl.log2(tl.where(any_seen, l_sum, 1.0))) * LN2, float("-inf"))
    tl.store(lse + q_rows, log_sum, mask=ok)


@triton.jit
def _query_rows(q, do, lse, delta, q_rows, ok, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
                DVP: tl.constexpr):
    """The rows q_rows ([R] int64, (b * T + t) * HQ + head) of q [B, T, HQ, DK] and do [B, T, HQ, DV] as tiles
    [R, DKP] and [R, DVP], and of lse (in base 2, 0 where -inf: such a row sees nothing) and delta [B, T, HQ]
    as [R] float32; rows that are not ok read as zeros."""
    dk = tl.arange(0, DKP)
    dv = tl.arange(0, DVP)
    q_tile = tl.load(q + q_rows[:, None] * DK + dk[None, :], mask=ok[:, None] & (dk < DK)[None, :], other=0.0)
    do_tile = tl.load(do + q_rows[:, None] * DV + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :], other=0.0)
    lse_r = tl.load(lse + q_rows, mask=ok, other=0.0)
    lse2 = tl.where(lse_r > float("-inf"), lse_r * LOG2E, 0.0)
    return q_tile, do_tile, lse2, tl.load(delta + q_rows, mask=ok, other=0.0)


@triton.jit
def _dq_step(rows, k, v, acc, block, b, h,
             TK: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr,
             SCALE: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, BSP: tl.constexpr, NSUB: tl.constexpr,
             TB: tl.constexpr, GR: tl.constexpr):
    """The dq tile, rows = (q_tile, do_tile, lse2, delta) as _query_rows gives them, against one key block
    seen as in _attend: p = exp2(s + row_bias - lse2) recomputed, acc [R, DKP] += (p * (do v^T - delta)) k,
    unscaled."""
    q_tile, do_tile, lse2, delta_r = rows
    blk, s_blk, p_last, p0, row_bias = block
    dk = tl.arange(0, DKP)
    dv = tl.arange(0, DVP)
    for chunk in tl.static_range(NSUB):  # the block in chunks of BSP keys
        key_pos, seen, key_row = _block_keys(blk, chunk, p_last, s_blk, b, TK=TK, BS=BS, BSP=BSP)
        k_tile = tl.load(k + (key_row * H + h)[:, None] * DK + dk[None, :],
                         mask=seen[:, None] & (dk < DK)[None, :], other=0.0)  # [BSP, DKP]
        v_t = tl.load(v + (key_row * H + h)[None, :] * DV + dv[:, None],
                      mask=seen[None, :] & (dv < DV)[:, None], other=0.0)  # [DVP, BSP]
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee") * (SCALE * LOG2E) + row_bias
        row_pos = p0 + tl.arange(0, TB * GR) // GR
        p = tl.where(seen[None, :] & (key_pos[None, :] <= row_pos[:, None]), tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do_tile, v_t, input_precision="ieee")
        ds = p * (dp - delta_r[:, None])
        acc += tl.dot(ds.to(k_tile.dtype), k_tile, input_precision="ieee")
    return acc


@triton.jit
def _dq_kernel(q, k, v, block_idx, block_counts, pos, start, do, lse, delta, dq,
               T: tl.constexpr, TK: tl.constexpr, H: tl.constexpr, G: tl.constexpr, S: tl.constexpr, DK: tl.constexpr,
               DV: tl.constexpr, BS: tl.constexpr, SCALE: tl.constexpr, GR: tl.constexpr, TB: tl.constexpr,
               DKP: tl.constexpr, DVP: tl.constexpr, BSP: tl.constexpr, NSUB: tl.constexpr, SP: tl.constexpr):
    """dq of selected attention for TB consecutive query tokens of one KV head, recomputing p from lse.

    Grid: (ceil(T / TB), B * H), as the forward. Tile: the forward's R = TB * GR rows against one key
    block at a time, walked as in the forward (TB = 1: the slots in a pipelined for loop; TB > 1: the
    distinct blocks, log2 of the multiplicity added to the logits).
    Loads q [B, T, HQ, DK] and do [B, T, HQ, DV] (R rows), lse and delta [B, T, HQ] (float32), the slots as
    the forward, then per block the keys (BSP x DKP) and the values (transposed, DVP x BSP). Stores dq
    [B, T, HQ, DK] in dq's dtype; zero where nothing is seen.
    """
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    ok, q_rows = _tile_rows(b, h, T=T, H=H, G=G, GR=GR, TB=TB)
    rows = _query_rows(q, do, lse, delta, q_rows, ok, DK=DK, DV=DV, DKP=DKP, DVP=DVP)

    acc = tl.zeros([TB * GR, DKP], tl.float32)
    if TB == 1:
        p_t, s_t, blocks = _token_blocks(block_idx, block_counts, pos, start, b, h, T=T, H=H, BS=BS, S=S, SP=SP)
        for slot in range(S):  # as the forward
            blk = tl.max(tl.where(tl.arange(0, SP) == slot, blocks, -1), 0)
            acc = _dq_step(rows, k, v, acc, (blk, s_t, p_t, p_t, 0.0), b, h, TK=TK, H=H, DK=DK, DV=DV, BS=BS,
                           SCALE=SCALE, DKP=DKP, DVP=DVP, BSP=BSP, NSUB=NSUB, TB=TB, GR=GR)
    else:
        tile, num = _tile_blocks(block_idx, block_counts, pos, start, b, h, T=T, TK=TK, H=H, BS=BS, S=S, SP=SP,
                                 TB=TB)
        for i in range(num):  # as the forward
            block = _tile_block(i, tile, TK=TK, BS=BS, TB=TB, GR=GR)
            acc = _dq_step(rows, k, v, acc, block, b, h, TK=TK, H=H, DK=DK, DV=DV, BS=BS, SCALE=SCALE, DKP=DKP,
                           DVP=DVP, BSP=BSP, NSUB=NSUB, TB=TB, GR=GR)

    dk = tl.arange(0, DKP)
    tl.store(dq + q_rows[:, None] * DK + dk[None, :], (acc * SCALE).to(dq.dtype.element_ty),
             mask=ok[:, None] & (dk < DK)[None, :])


@triton.jit
def _key_rows(row_start, row_end, r, chunk, b, TK: tl.constexpr, BS: tl.constexpr, BSP: tl.constexpr):
    """Keys chunk * BSP + j, j < BSP, of block row r: (j, their rows of k in the batch row, which exist, their
    int64 global rows of k [B, TK, H, DK], 0 where they do not exist). Block row r is the key rows
    [row_start[r], min(row_start[r] + BS, row_end[r])) of batch row b."""
    j = chunk * BSP + tl.arange(0, BSP)
    key_tok = tl.load(row_start + r) + j
    key_ok = (j < BS) & (key_tok < tl.load(row_end + r))
    return j, key_tok, key_ok, b * TK + tl.where(key_ok, key_tok, 0)


@triton.jit
def _dkv_partial_kernel(q, k, v, do, lse, delta, row_start, row_end, seg_list, seg_lo, seg_hi, query_tok,
                        query_row0, dk_part, dv_part,
                        T: tl.constexpr, TK: tl.constexpr, H: tl.constexpr, G: tl.constexpr, NR: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr, SCALE: tl.constexpr, GR: tl.constexpr,
                        BQ: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, BSP: tl.constexpr,
                        NSUB: tl.constexpr):
    """Partial dk and dv of one key block row of one (batch, KV head), from one segment of its query list.

    Grid: (NSEG * NSUB,): program p takes BSP keys (chunk p % NSUB: one chunk when the block fits in shared
    memory) of block row r, NR block rows (ceil(TK / BS), or per-sequence blocks when packed), against
    segment s = p // NSUB of list i = seg_list[s] = (b * H + h) * NR + r: the queries query_tok[seg_lo[s] :
    seg_hi[s]] (token index t in the batch row, at key row query_row0[b] + t; a query listed twice counts
    twice). The segments past the real ones are empty: they store zeros that are never reduced.
    Tile: BQ queries at a time, each with its G heads padded to GR = next_pow2(G) rows, so BQ * GR rows
    (>= 16), in a for loop that Triton software-pipelines (two stages: the next BQ entries' q and do load
    while these are computed: faster than one, benchmarks/results/ops-pipelining-ab.json).
    Loads the key block k [B, TK, H, DK] (BSP x DKP) and the value block v [B, TK, H, DV] once, up to the
    key row of the batch row's last query (rows past a cache's length read as 0), then per step of BQ
    entries q [B, T, HQ, DK], do [B, T, HQ, DV], lse and delta [B, T, HQ].
    Stores the unscaled float32 partials dk_part [NSEG, BS, DK] and dv_part [NSEG, BS, DV] of segment s
    (zero for keys past the block's end or the last query).
    """
    seg = tl.program_id(0) // NSUB
    list_id = tl.load(seg_list + seg)
    bh = list_id // NR
    b = (bh // H).to(tl.int64)
    h = bh % H
    r = list_id % NR
    chunk = tl.program_id(0) % NSUB
    j, key_tok, key_ok, key_row = _key_rows(row_start, row_end, r, chunk, b, TK=TK, BS=BS, BSP=BSP)
    row0 = tl.load(query_row0 + b)  # query t is at key row row0 + t
    key_ok = key_ok & (key_tok < row0 + T)
    dk = tl.arange(0, DKP)
    dv = tl.arange(0, DVP)
    k_tile = tl.load(k + (key_row * H + h)[:, None] * DK + dk[None, :],
                     mask=key_ok[:, None] & (dk < DK)[None, :], other=0.0)  # [BSP, DKP]
    v_tile = tl.load(v + (key_row * H + h)[:, None] * DV + dv[None, :],
                     mask=key_ok[:, None] & (dv < DV)[None, :], other=0.0)  # [BSP, DVP]

    rows = tl.arange(0, BQ * GR)
    e = rows // GR  # entry of the step
    g = rows % GR  # head of the group
    acc_k = tl.zeros([BSP, DKP], tl.float32)
    acc_v = tl.zeros([BSP, DVP], tl.float32)
    hi = tl.load(seg_hi + seg)
    for i in range(tl.load(seg_lo + seg), hi, BQ):
        entry_ok = i + e < hi
        t = tl.load(query_tok + i + e, mask=entry_ok, other=0)
        ok = entry_ok & (g < G)
        q_rows = (b * T + t) * (H * G) + h * G + tl.where(ok, g, 0)
        q_tile, do_tile, lse2, delta_r = _query_rows(q, do, lse, delta, q_rows, ok, DK=DK, DV=DV, DKP=DKP, DVP=DVP)
        seen = ok[:, None] & key_ok[None, :] & (key_tok[None, :] <= row0 + t[:, None])  # [BQ * GR, BSP]
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee") * (SCALE * LOG2E)
        p = tl.where(seen, tl.exp2(s - lse2[:, None]), 0.0)  # lse is finite: each listed query sees this block
        acc_v += tl.dot(tl.trans(p.to(do_tile.dtype)), do_tile, input_precision="ieee")
        dp = tl.dot(do_tile, tl.trans(v_tile), input_precision="ieee")
        ds = p * (dp - delta_r[:, None])
        acc_k += tl.dot(tl.trans(ds.to(q_tile.dtype)), q_tile, input_precision="ieee")

    part = seg.to(tl.int64) * BS + j
    tl.store(dk_part + part[:, None] * DK + dk[None, :], acc_k, mask=(j < BS)[:, None] & (dk < DK)[None, :])
    tl.store(dv_part + part[:, None] * DV + dv[None, :], acc_v, mask=(j < BS)[:, None] & (dv < DV)[None, :])


@triton.jit
def _sum_partials(part, seg, stop, j, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BSP: tl.constexpr):
    """The sum, in segment order, of the rows j [BSP] of the partials part[seg : stop] ([NSEG, BS, D]
    float32), as a [BSP, DP] float32 tile."""
    d = tl.arange(0, DP)
    acc = tl.zeros([BSP, DP], tl.float32)
    while seg < stop:
        rows = seg.to(tl.int64) * BS + j
        acc += tl.load(part + rows[:, None] * D + d[None, :], mask=(j < BS)[:, None] & (d < D)[None, :], other=0.0)
        seg += 1
    return acc


@triton.jit
def _dkv_reduce_kernel(dk_part, dv_part, row_start, row_end, seg_offsets, dk_out, dv_out,
                       TK: tl.constexpr, H: tl.constexpr, NR: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BS: tl.constexpr, SCALE: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr,
                       BSP: tl.constexpr, NSUB: tl.constexpr):
    """dk and dv of one key block row of one (batch, KV head): the sum of its segments' partials.

    Grid: (NR * NSUB, B * H), as the lists: list i = (b * H + h) * NR + r owns the segments
    [seg_offsets[i], seg_offsets[i + 1]) (none if the block was never selected), each program BSP keys.
    Tile: [BSP, DKP], then [BSP, DVP], float32.
    Loads the partials dk_part [NSEG, BS, DK] and dv_part [NSEG, BS, DV] of its segments, added in
    segment order. Stores dk [B, TK, H, DK] (times SCALE) and dv [B, TK, H, DV] of the block's keys in
    their dtype: every key row is in one block row, so every row is written (zero if never selected).
    """
    r = tl.program_id(0) // NSUB
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    j, _, key_ok, key_row = _key_rows(row_start, row_end, r, tl.program_id(0) % NSUB, b, TK=TK, BS=BS, BSP=BSP)
    list_id = bh.to(tl.int64) * NR + r
    first = tl.load(seg_offsets + list_id)
    stop = tl.load(seg_offsets + list_id + 1)
    dk = tl.arange(0, DKP)
    acc_k = _sum_partials(dk_part, first, stop, j, D=DK, DP=DKP, BS=BS, BSP=BSP)
    tl.store(dk_out + (key_row * H + h)[:, None] * DK + dk[None, :], (acc_k * SCALE).to(dk_out.dtype.element_ty),
             mask=key_ok[:, None] & (dk < DK)[None, :])
    dv = tl.arange(0, DVP)
    acc_v = _sum_partials(dv_part, first, stop, j, D=DV, DP=DVP, BS=BS, BSP=BSP)
    tl.store(dv_out + (key_row * H + h)[:, None] * DV + dv[None, :], acc_v.to(dv_out.dtype.element_ty),
             mask=key_ok[:, None] & (dv < DV)[None, :])


# --------------------------------------------------------------------------------- launches


@validated
class Config(NamedTuple):
    """The launches of the selected-attention kernels: BSP keys of a block loaded at once (a block is
    NSUB = ceil(block_size / BSP) chunks), TB query tokens per forward and dq program, the warps of every
    kernel, the pipeline stages of the forward and dq, BQ list entries per dk/dv step, and L, the most
    entries of a dk/dv segment."""

    block_keys: int
    tokens: int
    num_warps: int
    num_stages: int
    dkv_entries: int
    segment: int

    def check(self):
        power_of_two(self, "block_keys", "tokens", "num_warps", "dkv_entries")
        expect(self.block_keys >= 16, self, "block_keys", "at least 16 (tl.dot's smallest side)")
        positive(self, "num_stages", "segment")


# what `default_config` leaves of a block's shared memory (nsa._device.facts: shared_memory) beyond one stage of
# a key + value block and the q and do tiles, where it plans two stages: 160 KiB of an H100's or H200's 227 (two
# stages everywhere reached 330 KiB compiled for sm_90, scripts/sm90_shared_memory.py)
SHARED_MARGIN = 67 * KiB


def default_config(shapes, dtype, device):
    """The Config for q [B, T, HQ, Dk], k [B, TK, H, Dk], v [B, TK, H, Dv] and block_indices [B, T, H, S]:
    `nsa._config.Shapes.of(q, k, v, block_size=..., block_counts=S, packed=...)`.

    - BSP: the block in one chunk when BSP * (DKP + DVP) elements take at most 64 KiB (shared memory:
      float32 at Dk = Dv = 256 and block_size 128 takes two chunks).
    - TB = 16 / GR query tokens per program when a group has fewer than 16 rows (TB * GR = 16 rows),
      else 1.
    - Warps: 4 for small tiles, 8 once a tile side passes 128.
    - Stages: two (the next block's keys load while this one is computed) where a whole key + value block
      and the q and do tiles take at most the device's shared memory less SHARED_MARGIN together, one beyond.
    - BQ: BQ * GR = 64 rows (32 for wide heads), or GR when one group is larger.
    - L: the mean list length rounded up to a power of two, within [256, 1024] (a multiple of every BQ).
      The longest dk/dv program then walks no more than about a mean list, and the segments number at
      most twice the lists once L reaches the mean. The lists are those of ceil(TK / block_size) block rows
      (packed sequences have up to one more per sequence: their mean is at most this one).
    """
    itemsize = jnp.dtype(dtype).itemsize
    gr, dkp, dvp = triton.next_power_of_2(shapes.G), pow2(shapes.Dk), pow2(shapes.Dv)
    fit = max(16, triton.next_power_of_2(65536 // (itemsize * (dkp + dvp)) + 1) // 2)
    bsp = min(pow2(shapes.block_size), fit)
    tb = max(1, 16 // gr)
    block_bytes = cdiv(shapes.block_size, bsp) * bsp * (dkp + dvp) * itemsize
    tile_bytes = tb * gr * (dkp + dvp) * itemsize
    entries = shapes.B * shapes.T * shapes.H * shapes.block_counts
    lists = shapes.B * shapes.H * cdiv(shapes.TK, shapes.block_size)
    segment = min(1024, max(256, triton.next_power_of_2(cdiv(entries, max(lists, 1)))))
    return Config(block_keys=bsp, tokens=tb, num_warps=8 if max(dkp, dvp, bsp) > 128 else 4,
                  num_stages=2 if block_bytes + tile_bytes <= device.shared_memory - SHARED_MARGIN else 1,
                  dkv_entries=max(1, (32 if max(dkp, dvp) > 128 else 64) // gr), segment=segment)


_DKV_STAGES = 2  # dk/dv partials: the next BQ entries' q and do load while these are computed


def _meta(q, k, v, block_size, scale, cfg):
    """The constexprs every selected-attention kernel takes (TK: the rows of k and v)."""
    Dk = q.shape[3]
    TK, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    return dict(TK=TK, H=H, DK=Dk, DV=Dv, BS=block_size, SCALE=float(scale), DKP=pow2(Dk), DVP=pow2(Dv),
                BSP=cfg.block_keys, NSUB=cdiv(block_size, cfg.block_keys), num_warps=cfg.num_warps)


def _per_token(q, k, block_indices, cfg):
    """The constexprs and the grid of the per-token kernels (forward, dq): the T queries, the S slots, SP = S
    padded to a power of two, G and GR, TB tokens per program."""
    B, T, HQ, _ = q.shape
    H, S = k.shape[2], block_indices.shape[-1]
    return dict(grid=(cdiv(T, cfg.tokens), B * H), num_stages=cfg.num_stages, T=T, S=S,
                SP=triton.next_power_of_2(S), G=HQ // H, GR=triton.next_power_of_2(HQ // H), TB=cfg.tokens)


# ------------------------------------------------------------------------------------ wrappers


def _clipped(block_indices, TK, block_size):
    """int32 block ids with the same validity: anything past the last block of TK keys becomes one past it."""
    return jnp.clip(block_indices, -1, TK // block_size + 1).astype(jnp.int32)


def _tokens(q, block_size, cu_seqlens, kv_lens):
    """The queries' `nsa._varlen.tokens`, each field int32 [B, T] as the kernels index them (b * T + t)."""
    tok = tokens(q.shape[1], block_size, cu_seqlens, kv_lens)
    return tok._make(jnp.broadcast_to(x, q.shape[:2]) for x in tok)


def _query_row0(q, kv_lens):
    """int32 [B]: the key row of each batch row's query 0, kv_lens[b] - T (0 without kv_lens: query t is then
    key row t, packed or not)."""
    B, T = q.shape[:2]
    return jnp.zeros((B,), jnp.int32) if kv_lens is None else kv_lens.astype(jnp.int32) - T


def _config(q, k, v, block_indices, block_size, cu_seqlens, config):
    """config, or `default_config`'s."""
    shapes = Shapes.of(q, k, v, block_size=int(block_size), block_counts=block_indices.shape[-1],
                       packed=cu_seqlens is not None)
    return default_config(shapes, q.dtype, device()) if config is None else config


def forward(q, k, v, block_indices, block_counts, cu_seqlens, kv_lens=None, *, block_size, scale, config=None,
            decode=None):
    """Returns o [B, T, HQ, Dv] and the reference's residuals (inputs, o, lse [B, T, HQ] float32); kv_lens int
    [B] or None places the queries at the end of longer sequences of keys k, v [B, TK, H, D]
    (`nsa._varlen.tokens`). decode: whether the flash-decoding forward of nsa/triton/decode.py runs instead
    (None: where it applies, a few queries at the end of a cache: `nsa.triton._splits.decoding`). config: the
    Config of the kernels that run (a decode.Config for the decode forward; None: its `default_config`)."""
    if _splits.decoding(decode, q, k, kv_lens, config, (Config, flash_decoding.Config)):
        o, lse = flash_decoding.selected(q, k, v, block_indices, block_counts, kv_lens, block_size=block_size,
                                         scale=scale, config=config)
        return o, (q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, o, lse)
    cfg = _config(q, k, v, block_indices, block_size, cu_seqlens, config)
    tok = _tokens(q, block_size, cu_seqlens, kv_lens)
    o, lse = _launch.launch(
        _fwd_kernel,
        inputs=dict(q=q, k=k, v=v, block_idx=_clipped(block_indices, k.shape[1], block_size),
                    block_counts=block_counts.astype(jnp.int32), pos=tok.pos, start=tok.start),
        outputs=dict(o=_launch.shape_dtype(q.shape[:3] + v.shape[3:], q.dtype),
                     lse=_launch.shape_dtype(q.shape[:3], jnp.float32)),
        **_per_token(q, k, block_indices, cfg), **_meta(q, k, v, block_size, scale, cfg))
    return o, (q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, block_size, scale, config=None, grads=None):
    """Gradients (dq, dk, dv, None, None, None, None) in the input dtypes, as the reference's backward; config:
    a Config (None: `default_config`). grads: the gradients to compute, (0,) dq or (1, 2) dk and dv (None in
    their place otherwise; None: all), so that implementation=None can take dq from another family's kernel
    (nsa._config.Claim)."""
    q, k, v, block_indices, block_counts, cu_seqlens, kv_lens, o, lse = residuals
    cfg = _config(q, k, v, block_indices, block_size, cu_seqlens, config)
    meta = _meta(q, k, v, block_size, scale, cfg)
    tok = _tokens(q, block_size, cu_seqlens, kv_lens)
    delta = kernel_delta(o, do, q.dtype)
    do = do.astype(q.dtype)
    idx = _clipped(block_indices, k.shape[1], block_size)
    counts = block_counts.astype(jnp.int32)
    softmax = dict(q=q, k=k, v=v, do=do, lse=lse, delta=delta)

    dq = dk = dv = None
    if wanted(grads, 0):
        [dq] = _launch.launch(
            _dq_kernel, inputs=dict(q=q, k=k, v=v, block_idx=idx, block_counts=counts, pos=tok.pos, start=tok.start,
                                    do=do, lse=lse, delta=delta),
            outputs=dict(dq=_launch.shape_dtype(q.shape, q.dtype)), **_per_token(q, k, block_indices, cfg), **meta)
    if wanted(grads, 1, 2):
        dk, dv = _key_gradients(softmax, q, k, v, idx, counts, tok, cu_seqlens, kv_lens, block_size, cfg, meta)
    return dq, dk, dv, None, None, None, None


def _key_gradients(softmax, q, k, v, idx, counts, tok, cu_seqlens, kv_lens, block_size, cfg, meta):
    """`backward`'s dk and dv: the selections inverted into per-block query lists, their segments' partials
    (`_dkv_partial_kernel`) and the lists' sums (`_dkv_reduce_kernel`)."""
    B, T, HQ, _ = q.shape
    H = k.shape[2]
    NR, row_start, row_end = _plan.block_rows(k.shape[1], block_size, cu_seqlens)
    offsets, query_tok = _plan.query_lists(idx, counts, tok, B, T, H, NR, block_size)
    seg_offsets, seg_list, seg_lo, seg_hi = _plan.segments(offsets, query_tok.shape[0], cfg.segment)
    NSEG = seg_list.shape[0]
    rows = dict(row_start=row_start, row_end=row_end)
    dk_part, dv_part = _launch.launch(
        _dkv_partial_kernel, grid=(NSEG * meta["NSUB"],),
        inputs=dict(softmax, **rows, seg_list=seg_list, seg_lo=seg_lo, seg_hi=seg_hi, query_tok=query_tok,
                    query_row0=_query_row0(q, kv_lens)),
        outputs=dict(dk_part=_launch.shape_dtype((NSEG, block_size, k.shape[3]), jnp.float32),
                     dv_part=_launch.shape_dtype((NSEG, block_size, v.shape[3]), jnp.float32)),
        num_stages=_DKV_STAGES, T=T, G=HQ // H, GR=triton.next_power_of_2(HQ // H), NR=NR, BQ=cfg.dkv_entries,
        **meta)
    dk, dv = _launch.launch(
        _dkv_reduce_kernel, grid=(NR * meta["NSUB"], B * H),
        inputs=dict(dk_part=dk_part, dv_part=dv_part, **rows, seg_offsets=seg_offsets),
        outputs=dict(dk_out=_launch.shape_dtype(k.shape, k.dtype), dv_out=_launch.shape_dtype(v.shape, v.dtype)),
        num_stages=1, NR=NR, **meta)
    return dk, dv
