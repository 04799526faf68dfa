"""Block selection (`select_blocks`) as one Triton kernel: compressed-attention scores fused with top-k.

The contract is nsa.reference.select's. Query t of KV head h, at in-sequence position p, sees the
compressed rows cmp_start <= r < cmp_start + (p + 1) // block_size; each of its G = HQ / H query heads
takes the softmax p_g(c) of scale * q_g . k_cmp over them, and block c (row cmp_start + c) scores
mean_g p_g(c). Blocks 0, p // bs - 1 and p // bs are forced (ranks 2, 3 and 4, above any score),
blocks after p // bs are never candidates; the block_counts best are kept in rank order, ties going
to the lower block id, unused slots -1.

`_select_kernel` never materializes the [T, NC] scores. One program owns TB consecutive tokens of one
KV head and stacks their G query heads (padded to GR, a power of two) into the rows of one tile, so
every chunk of BC compressed rows is loaded once for TB tokens and tl.dot gets TB * GR rows (64; 32 in
float32). It walks the chunks twice: first for the log-sum-exp of each row (online, in base 2),
skipped when the caller gives compressed attention's lse; then to recompute the probabilities, sum
them over each token's heads and merge the chunk into each token's running top.

The top is kept as sortable int64 keys (score bits << 32 | (2^31 - 1 - block id)): scores are >= 0,
so the key order is the rank order, ties going to the lower id. A chunk's best SP keys (tl.topk,
descending) against the running top (ascending) take their elementwise maximum, the SP best of
both as a bitonic sequence, which tl.bitonic_merge sorts again; chunks that cannot enter any token's
top are skipped. Everything is float32 whatever the input dtype; a row's result depends only on its
own loads, so it is deterministic. Batched, packed and cached sequences take one path: the kernel reads
pos and cmp_start (nsa._varlen.tokens) per token of each batch row, and the tokens of one tile may belong
to several packed sequences (each token has its own visible rows, candidates and top). With kv_lens (a
KV cache) the T queries are the last tokens of sequences of kv_lens[b] tokens that k_cmp covers: query t
of batch row b is at position kv_lens[b] - T + t, and may have up to NB = max(ceil(T / bs), NC) blocks;
the rows of k_cmp past the visible ones (a cache's partial or unwritten blocks) are never loaded.

Layouts (contiguous): q [B, T, HQ, Dk], k_cmp [B, NC, H, Dk], lse [B, T, HQ] float32, pos and cmp_start
[B, T] int32, out [B, T, H, S] int32; query head hq uses KV head hq // G. Token offsets are computed in
int64 (b * T + t can be multiplied past 2^31).
"""

from typing import NamedTuple

import jax.numpy as jnp
import triton
import triton.language as tl

from nsa._varlen import cdiv, tokens
from nsa.reference import select as reference
from nsa.triton import _launch, decode
from nsa.triton.decode import split_stats
from nsa.triton._common import LOG2E, pow2

_ROWS = 64  # query rows per tile (TB tokens x GR heads): the M of one wgmma
# `default_decode_config`'s splits aim at decode.SMS * DECODE_PROGRAMS_PER_SM programs, never more than
# MAX_DECODE_SPLITS (the merge sorts MAX_DECODE_SPLITS * SP keys per query). Four programs per SM against one
# (H200, the fused decode step, benchmarks/decode_tuning.py, results/decode-tuning.json): B = 1 at 64k 78.0 ->
# 72.0 us, at 512k 76.4 -> 66.1; B = 16 at 64k 80.0 -> 78.2; B = 64 174.0 -> 170.5. A split walks a few
# chunks of compressed rows, each a load, a dot, a top-k merge: latency, which more programs hide.
DECODE_PROGRAMS_PER_SM = 4
MAX_DECODE_SPLITS = 64
_ROWS_FP32 = 32  # float32 takes no wgmma (IEEE products: an FMA dot), and spills less with fewer rows
# the forced blocks' ranks, nsa.reference.select's
_CURRENT, _PREVIOUS, _FIRST = (tl.constexpr(r) for r in (reference.CURRENT, reference.PREVIOUS, reference.FIRST))

# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _logits(q_tile, k_cmp, rows, load, b, h,
            NC: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DKP: tl.constexpr,
            SCALE: tl.constexpr, IEEE: tl.constexpr):
    """Base-2 logits [M, BC] of the tile's query rows q_tile [M, DKP] against the compressed rows
    `rows` [BC] of KV head h; loads the key chunk transposed, k_cmp [B, NC, H, DK] -> [DKP, BC], only
    the rows where `load` (the others read as 0). The caller masks the logits of rows a query does not
    see: a row loaded for another token of the tile may hold anything (NaN too), and it only spoils its
    own column."""
    dk = tl.arange(0, DKP)
    k_row = b * NC + tl.where(load, rows, 0)  # masked lanes keep an in-bounds address
    k_t = tl.load(k_cmp + (k_row * H + h)[None, :] * DK + dk[:, None],
                  mask=load[None, :] & (dk < DK)[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q_tile, k_t, input_precision="ieee")
    else:
        s = tl.dot(q_tile, k_t)
    return s * (SCALE * LOG2E)


@triton.jit
def _keys(score, blk, cur):
    """Sortable int64 keys [TB, BC] of the chunk's blocks from their scores [TB, BC].

    blk [TB, BC] are the in-sequence block ids of each token, cur [TB] its current block. The forced
    ranks of nsa.reference.select (_FIRST, _PREVIOUS, _CURRENT) replace the scores, in its order;
    candidates (0 <= blk <= cur) get (float bits of the rank) << 32 | (2^31 - 1 - blk), which orders
    as (rank, -blk) since ranks are >= 0; every other block gets -1, below any candidate.
    """
    rank = tl.where(blk == 0, _FIRST, score)
    rank = tl.where(blk == cur[:, None] - 1, _PREVIOUS, rank)
    rank = tl.where(blk == cur[:, None], _CURRENT, rank)
    key = (rank.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0x7FFFFFFF - blk).to(tl.int64)
    return tl.where((blk >= 0) & (blk <= cur[:, None]), key, -1)


@triton.jit
def _merge_top(top, key, S: tl.constexpr, SP: tl.constexpr):
    """Each token's running top [TB, SP] (ascending keys, slot SP - 1 ranks first) merged with the keys
    [TB, BC] of a chunk: the SP best of both, unless no key can enter any token's top-S (skipped)."""
    kth = tl.max(tl.where(tl.arange(0, SP)[None, :] == SP - S, top, -1), 1)  # [TB]: each token's S-th best
    if tl.max((tl.max(key, 1) > kth).to(tl.int32), 0) > 0:  # some token's top-S changes
        # max of ascending and descending: the SP best of both, bitonic
        top = tl.bitonic_merge(tl.maximum(top, tl.topk(key, SP, dim=1)), dim=1)
    return top


@triton.jit
def _select_kernel(q, k_cmp, lse, pos, cmp_start, out,
                   T: tl.constexpr, NC: tl.constexpr, H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr,
                   BS: tl.constexpr, S: tl.constexpr, SCALE: tl.constexpr, GR: tl.constexpr, TB: tl.constexpr,
                   DKP: tl.constexpr, BC: tl.constexpr, SP: tl.constexpr, IEEE: tl.constexpr,
                   HAS_LSE: tl.constexpr):
    """The top-S blocks of TB consecutive tokens of one KV head.

    Grid: (cdiv(T, TB), B * H). Tile: M = TB * GR query rows, row i = token t0 + i // GR, head
    h * G + i % GR (heads >= G and tokens >= T masked), against BC compressed rows at a time.
    Loads q [B, T, HQ, DK] once (M x DKP), pos and cmp_start [B, T] (int32) of batch row b per token and
    per row, lse [B, T, HQ] (M rows, when HAS_LSE), then the key chunks k_cmp [B, NC, H, DK] (DKP x BC).
    The chunks walk the rows of k_cmp from the tile's lowest cmp_start, and load the rows below the
    tile's last visible one (vis_end, at most NC): rows past it are never read (a cache's partial or
    unwritten blocks); the partial last block of a packed sequence may be loaded when the tile holds the
    next sequence's tokens, but no query uses it.
    Without HAS_LSE a first pass up to vis_end computes the lse of each query row; the second pass up
    to the last candidate block (the current block may be one past the visible rows) sums the
    probabilities over each token's heads ([M, BC] -> [TB, GR, BC]) and merges the chunk into the
    running top of each token ([TB, SP] keys, SP = S padded to a power of two >= 2, SP <= BC), unless
    no key can enter any token's top-S.
    Stores out [B, T, H, S] int32: block ids in rank order, -1 in unused slots.
    """
    t0 = tl.program_id(0) * TB
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    M: tl.constexpr = TB * GR

    pos += b * T  # this batch row's tokens
    cmp_start += b * T

    # each token of the tile [TB]: its sequence's first compressed row, visible rows and current block
    tok = t0 + tl.arange(0, TB)
    tok_ok = tok < T
    p_tok = tl.load(pos + tok, mask=tok_ok, other=0)
    first = tl.load(cmp_start + tok, mask=tok_ok, other=0)
    n_vis = tl.where(tok_ok, (p_tok + 1) // BS, 0)
    cur = tl.where(tok_ok, p_tok // BS, -1)  # padded tokens have no candidates

    # each query row of the tile [M]: its token's visible rows [first_row, end_row) of k_cmp (none past its
    # last row: under jit a cu_seqlens can ask for more rows than a given k_cmp holds)
    i = tl.arange(0, M)
    t_row = t0 + i // GR
    hq = h * G + i % GR
    row_ok = (i % GR < G) & (t_row < T)
    first_row = tl.load(cmp_start + t_row, mask=row_ok, other=0)
    end_row = tl.where(row_ok, first_row + (tl.load(pos + t_row, mask=row_ok, other=0) + 1) // BS, first_row)
    end_row = tl.minimum(end_row, NC)
    q_row = (b * T + t_row) * (H * G) + hq  # int64 row of q and lse
    dk = tl.arange(0, DKP)
    q_tile = tl.load(q + q_row[:, None] * DK + dk[None, :], mask=row_ok[:, None] & (dk < DK)[None, :], other=0.0)

    c = tl.arange(0, BC)
    # the chunks walk k_cmp from the tile's lowest cmp_start; no token of the tile sees a row >= vis_end
    lo = tl.min(tl.where(tok_ok, first, NC), 0)
    vis_end = tl.minimum(tl.max(first + n_vis, 0), NC)
    if HAS_LSE:
        lse_row = tl.load(lse + q_row, mask=row_ok, other=float("-inf"))
        seen = lse_row > float("-inf")  # rows that see no compressed row get p = 0, never NaN
        lse2 = tl.where(seen, lse_row * LOG2E, 0.0)
    else:
        # pass 1: lse (base 2) of each row over its visible rows
        m = tl.full([M], float("-inf"), tl.float32)
        l_sum = tl.zeros([M], tl.float32)
        for r0 in range(lo, vis_end, BC):
            rows = r0 + c
            s = _logits(q_tile, k_cmp, rows, rows < vis_end, b, h, NC=NC, H=H, DK=DK, DKP=DKP, SCALE=SCALE, IEEE=IEEE)
            s = tl.where((rows[None, :] >= first_row[:, None]) & (rows[None, :] < end_row[:, None]), s,
                         float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: no NaN
            l_sum = l_sum * tl.exp2(m - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), 1)
            m = m_new
        seen = l_sum > 0
        lse2 = tl.where(seen, m + tl.log2(tl.where(seen, l_sum, 1.0)), 0.0)

    # pass 2: scores of each token's candidates, merged chunk by chunk into its running top
    top = tl.full([TB, SP], -1, tl.int64)  # keys in ascending order: slot SP - 1 ranks first
    end = tl.max(first + cur, 0) + 1
    for r0 in range(lo, end, BC):
        rows = r0 + c
        s = _logits(q_tile, k_cmp, rows, rows < vis_end, b, h, NC=NC, H=H, DK=DK, DKP=DKP, SCALE=SCALE, IEEE=IEEE)
        vis = (rows[None, :] >= first_row[:, None]) & (rows[None, :] < end_row[:, None]) & seen[:, None]
        p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
        score = tl.sum(tl.reshape(p, [TB, GR, BC]), 1) / G
        key = _keys(score, rows[None, :] - first[:, None], cur)  # [TB, BC], by in-sequence block id
        top = _merge_top(top, key, S=S, SP=SP)

    _store_top(out, (b * T + tok) * H + h, top, tok_ok, S=S, SP=SP)


@triton.jit
def _ids(key):
    """The block ids (int32) of sortable keys, -1 for the keys of no candidate (-1)."""
    return tl.where(key >= 0, 0x7FFFFFFF - (key & 0x7FFFFFFF), -1).to(tl.int32)


@triton.jit
def _store_top(out, out_rows, top, ok, S: tl.constexpr, SP: tl.constexpr):
    """The block ids of each token's running top [TB, SP] (ascending keys) into its row out_rows [TB] of out
    [.., S] int32 in rank order (-1 in unused slots), for the tokens that are ok."""
    out_slot = SP - 1 - tl.arange(0, SP)  # top is ascending
    tl.store(out + out_rows[:, None] * S + out_slot[None, :], _ids(top), mask=ok[:, None] & (out_slot < S)[None, :])


@triton.jit
def _decode_split_kernel(q, k_cmp, lse, m_cmp, l_cmp, kv_lens, top, out,
                         TQ: tl.constexpr, NC: tl.constexpr, H: tl.constexpr, G: tl.constexpr, DK: tl.constexpr,
                         BS: tl.constexpr, S: tl.constexpr, SCALE: tl.constexpr, GR: tl.constexpr,
                         TQP: tl.constexpr, DKP: tl.constexpr, BC: tl.constexpr, SP: tl.constexpr,
                         IEEE: tl.constexpr, NSPLIT: tl.constexpr, LSE_SPLITS: tl.constexpr,
                         LSE_NSP: tl.constexpr):
    """Decode: the running top of the TQ queries of one KV head over one share of the candidate blocks.

    The TQ queries are the last tokens of batch row b (query t at position p_t = kv_lens[b] - TQ + t, its
    candidates the blocks 0 .. p_t // BS, block c scored from row c of k_cmp). Grid (B * H, NSPLIT): program
    (b * H + h, split) takes share `split` of the chunks of BC blocks up to the tile's last candidate (cut
    into NSPLIT even shares at run time, so a ragged batch splits each row's own range). Tile: M = TQP * GR
    query rows, row i = token i // GR, head h * G + i % GR (heads >= G and tokens >= TQ masked; TQP * GR >=
    16 for tl.dot). Loads q [B, TQ, HQ, DK] (M x DKP) and lse [B, TQ, HQ] (compressed attention's) once,
    kv_lens [B], then each chunk of k_cmp [B, NC, H, DK] transposed (DKP x BC), only the rows some query
    sees (below min(NC, (p_last + 1) // BS)). The lse of each row is compressed attention's: lse [B, TQ, HQ]
    (natural log), or with LSE_SPLITS > 0 merged here from the decode kernel's partial statistics m_cmp and
    l_cmp [B * H, LSE_SPLITS, TQ * G] (base 2; `decode.split_stats`, LSE_NSP = LSE_SPLITS padded to a power
    of two), which saves the fused decode step (`decode.attention`) a combine before the selection. Each
    chunk's scores are merged into each token's running top (`_merge_top`). With NSPLIT = 1 stores the ids
    into out [B, TQ, H, S] int32 (rank order, -1 unused, `_store_top`), else the keys of its top
    (ascending) into top [B * H, NSPLIT, TQP, SP, 2] int32 (each int64 key's high and low halves) for
    `_decode_merge_kernel`.
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    M: tl.constexpr = TQP * GR
    kv_len = tl.load(kv_lens + b)

    tok = tl.arange(0, TQP)
    p_tok = kv_len - TQ + tok
    tok_ok = (tok < TQ) & (p_tok >= 0)
    cur = tl.where(tok_ok, p_tok // BS, -1)  # each token's current block (-1: no candidates)

    i = tl.arange(0, M)
    t_row = i // GR
    p_row = kv_len - TQ + t_row
    row_ok = (i % GR < G) & (t_row < TQ) & (p_row >= 0)
    end_row = tl.where(row_ok, tl.minimum((p_row + 1) // BS, NC), 0)  # the row's visible rows [0, end_row)
    q_row = (b * TQ + t_row) * (H * G) + h * G + i % GR  # int64 row of q and lse
    dk = tl.arange(0, DKP)
    q_tile = tl.load(q + q_row[:, None] * DK + dk[None, :], mask=row_ok[:, None] & (dk < DK)[None, :], other=0.0)
    if LSE_SPLITS == 0:
        lse2 = tl.load(lse + q_row, mask=row_ok, other=float("-inf")) * LOG2E
    else:
        part_row = bh.to(tl.int64) * LSE_SPLITS * (TQ * G) + t_row * G + i % GR  # split 0's row of m_cmp, l_cmp
        _, _, lse2 = split_stats(m_cmp, l_cmp, part_row, row_ok, R=TQ * G, NSPLIT=LSE_SPLITS, NSP=LSE_NSP)
    seen = lse2 > float("-inf")  # rows that see no compressed row get p = 0, never NaN
    lse2 = tl.where(seen, lse2, 0.0)

    vis_end = tl.max(end_row, 0)  # no query sees a row >= vis_end
    chunks = (tl.max(cur, 0) + BC) // BC  # the chunks up to the last candidate block
    per = (chunks + NSPLIT - 1) // NSPLIT
    best = tl.full([TQP, SP], -1, tl.int64)  # ascending keys: slot SP - 1 ranks first
    for chunk in range(split * per, tl.minimum(chunks, split * per + per)):
        rows = chunk * BC + tl.arange(0, BC)
        s = _logits(q_tile, k_cmp, rows, rows < vis_end, b, h, NC=NC, H=H, DK=DK, DKP=DKP, SCALE=SCALE, IEEE=IEEE)
        p = tl.where((rows[None, :] < end_row[:, None]) & seen[:, None], tl.exp2(s - lse2[:, None]), 0.0)
        score = tl.sum(tl.reshape(p, [TQP, GR, BC]), 1) / G
        best = _merge_top(best, _keys(score, rows[None, :], cur), S=S, SP=SP)

    if NSPLIT == 1:
        _store_top(out, (b * TQ + tok) * H + h, best, tok < TQ, S=S, SP=SP)
    else:
        at = ((bh.to(tl.int64) * NSPLIT + split) * TQP + tok)[:, None] * SP + tl.arange(0, SP)[None, :]
        tl.store(top + 2 * at, (best >> 32).to(tl.int32))  # int32 halves: jax has no int64 without x64
        tl.store(top + 2 * at + 1, best.to(tl.int32))


@triton.jit
def _decode_merge_kernel(top, out, TQ: tl.constexpr, H: tl.constexpr, S: tl.constexpr, TQP: tl.constexpr,
                         SP: tl.constexpr, NSPLIT: tl.constexpr, NSP: tl.constexpr):
    """Decode: the splits' tops of one query merged, in a fixed order (deterministic).

    Grid (B * H * TQ,): program (b * H + h) * TQ + t loads the NSPLIT tops of token t of KV head h, top
    [B * H, NSPLIT, TQP, SP, 2] int32 (NSP * SP int64 keys in halves, NSP = NSPLIT padded to a power of
    two, -1 past NSPLIT), and stores the S best as block ids into out [B, TQ, H, S] int32 (rank order, -1
    unused)."""
    bh = tl.program_id(0) // TQ
    t = tl.program_id(0) % TQ
    b = (bh // H).to(tl.int64)
    h = bh % H
    j = tl.arange(0, NSP * SP)
    split = j // SP
    at = ((bh.to(tl.int64) * NSPLIT + split) * TQP + t) * SP + j % SP
    high = tl.load(top + 2 * at, mask=split < NSPLIT, other=-1)
    low = tl.load(top + 2 * at + 1, mask=split < NSPLIT, other=-1)
    keys = (high.to(tl.int64) << 32) | (low.to(tl.int64) & 0xFFFFFFFF)
    slot = tl.arange(0, SP)
    tl.store(out + ((b * TQ + t) * H + h) * S + slot, _ids(tl.topk(keys, SP)), mask=slot < S)


# ------------------------------------------------------------------------------------ wrappers


class Config(NamedTuple):
    """The launch of the select kernel: TB query tokens per program, BC compressed rows per step, warps
    and pipeline stages."""

    tokens: int
    chunk: int
    num_warps: int
    num_stages: int


def default_config(q, k_cmp, *, block_counts, block_size, kv_lens=None):
    """The Config for q [B, T, HQ, Dk] against k_cmp [B, NC, H, Dk] (kv_lens: whether the queries end
    sequences of a KV cache, only its presence counts).

    TB tokens per tile so that their heads, G padded to GR = a power of two, fill TB * GR = 64 rows, 32
    in float32 (one token when G is larger; fewer for a short T, never under tl.dot's 16 rows). BC = 64
    compressed rows per step, fewer (>= 16) when there are fewer blocks, at least SP (tl.topk takes SP of
    them). Eight warps when a tile passes 16 KiB: q [M, DKP], the key chunk [DKP, BC] (itemsize bytes
    each), the float32 logits [M, BC] or the int64 keys [TB, BC]. Two pipeline stages (the next key chunk
    loads while this one is scored) once a tile walks four chunks or more, else one: on an H200 two stages
    took select at T = 65536 (1024 blocks) from 11.66 to 11.36 ms but at T = 8192 (128 blocks, about one
    chunk) from 0.49 to 0.70 ms (more shared memory, fewer resident programs, nothing to overlap).
    """
    T, sizes = q.shape[1], _sizes(q, k_cmp, block_counts, block_size, kv_lens)
    itemsize = jnp.dtype(q.dtype).itemsize
    gr, dkp, sp, num_blocks = sizes["GR"], sizes["DKP"], sizes["SP"], _num_blocks(q, k_cmp, block_size, kv_lens)
    tb = max(16 // gr, min(max(1, (_ROWS_FP32 if itemsize == 4 else _ROWS) // gr), triton.next_power_of_2(T)))
    bc = _chunk(sp, num_blocks)
    largest = max(tb * gr * dkp * itemsize, dkp * bc * itemsize, tb * gr * bc * 4, tb * bc * 8)
    return Config(tb, bc, 8 if largest > 16384 else 4, 2 if num_blocks >= 4 * bc else 1)


def _chunk(sp, num_blocks):
    """BC: 64 compressed rows per step, fewer (>= 16) when there are fewer blocks, at least SP."""
    return max(sp, min(64, max(16, triton.next_power_of_2(num_blocks))))


def _num_blocks(q, k_cmp, block_size, kv_lens):
    """NB, the most in-sequence blocks a query can have: those of the T queries, or with kv_lens those of the
    longest sequence k_cmp covers (as nsa.reference.select)."""
    blocks = cdiv(q.shape[1], block_size)
    return blocks if kv_lens is None else max(blocks, k_cmp.shape[1])


def _sizes(q, k_cmp, block_counts, block_size, kv_lens):
    """What the shapes fix: GR (the group G padded to a power of two), DKP (Dk padded, >= 16), S (the
    slots the kernel fills: at most NB, the blocks of the longest sequence) and SP (S padded, >= 2)."""
    slots = min(block_counts, _num_blocks(q, k_cmp, block_size, kv_lens))
    return dict(GR=triton.next_power_of_2(q.shape[2] // k_cmp.shape[2]), DKP=pow2(q.shape[3]), S=slots,
                SP=max(2, triton.next_power_of_2(slots)))


class DecodeConfig(NamedTuple):
    """The launch of the decode select (`decode_forward`): BC compressed rows per step, NSPLIT splits of each (b, h)'s
    chunks (1: no merge kernel), warps and pipeline stages."""

    chunk: int
    splits: int
    num_warps: int
    num_stages: int


def default_decode_config(q, k_cmp, *, block_counts, block_size):
    """The DecodeConfig of the queries q [B, TQ, HQ, Dk] at the end of a cache against k_cmp [B, NC, H, Dk].

    BC as `default_config`. NSPLIT: cdiv(132 * DECODE_PROGRAMS_PER_SM, B * H) splits (four programs per SM),
    never more than the chunks of the longest sequence (its NC + 1 candidate blocks) nor MAX_DECODE_SPLITS,
    1 from B * H >= 528. Warps as `default_config`; two stages once a split walks four chunks or more.
    """
    B, TQ, HQ, _ = q.shape
    H, sizes = k_cmp.shape[2], _sizes(q, k_cmp, block_counts, block_size, kv_lens=True)
    num_blocks = _num_blocks(q, k_cmp, block_size, kv_lens=True)
    bc = _chunk(sizes["SP"], num_blocks)
    chunks = cdiv(num_blocks + 1, bc)
    splits = max(1, min(chunks, MAX_DECODE_SPLITS, cdiv(decode.SMS * DECODE_PROGRAMS_PER_SM, max(1, B * H))))
    m = _decode_tokens(TQ, sizes["GR"]) * sizes["GR"]
    largest = max(m * sizes["DKP"] * q.dtype.itemsize, sizes["DKP"] * bc * q.dtype.itemsize, m * bc * 4)
    return DecodeConfig(bc, splits, 8 if largest > 16384 else 4, 2 if cdiv(chunks, splits) >= 4 else 1)


def _decode_tokens(TQ, GR):
    """TQP, the decode tile's tokens: TQ padded to a power of two, with at least 16 rows (TQP * GR)."""
    return max(triton.next_power_of_2(TQ), 16 // GR)


def decode_forward(q, k_cmp, lse, kv_lens, *, block_counts, block_size, scale, config=None, lse_parts=None):
    """`forward` for a few queries q [B, TQ, HQ, Dk] at the end of a cache (kv_lens int [B]), split over the
    candidate blocks (flash-decoding style: `_decode_split_kernel`, then `_decode_merge_kernel` when NSPLIT
    > 1). Compressed attention's lse is given as lse [B, TQ, HQ], or as lse_parts, the (m, l) partial
    statistics [B * H, NSPLIT, TQ * G] of its decode kernel's splits (then lse is None), or else computed
    first by that kernel (k_cmp as its values). config: a DecodeConfig (None: `default_decode_config`)."""
    B, TQ, HQ, Dk = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    kv_lens = kv_lens.astype(jnp.int32)
    if lse is None and lse_parts is None:
        _, lse = decode.compressed(q, k_cmp, k_cmp, kv_lens, block_size=block_size, scale=scale)
    unused = jnp.zeros((1,), jnp.float32)
    m_cmp, l_cmp = (unused, unused) if lse_parts is None else lse_parts
    lse_splits = 0 if lse_parts is None else m_cmp.shape[1]
    cfg = config if config is not None else default_decode_config(q, k_cmp, block_counts=block_counts,
                                                                  block_size=block_size)
    sizes = _sizes(q, k_cmp, block_counts, block_size, kv_lens)
    tqp, S, SP = _decode_tokens(TQ, sizes["GR"]), sizes["S"], sizes["SP"]
    out = _launch.shape_dtype((B, TQ, H, S), jnp.int32)
    top = _launch.shape_dtype((B * H, cfg.splits, tqp, SP, 2) if cfg.splits > 1 else (1,), jnp.int32)
    top, idx = _launch.launch(
        _decode_split_kernel, grid=(B * H, cfg.splits),
        inputs=dict(q=q, k_cmp=k_cmp, lse=unused if lse is None else lse.astype(jnp.float32), m_cmp=m_cmp, l_cmp=l_cmp,
                    kv_lens=kv_lens),
        outputs=dict(top=top, out=out), num_warps=cfg.num_warps, num_stages=cfg.num_stages, TQ=TQ, NC=NC, H=H,
        G=HQ // H, DK=Dk, BS=block_size, SCALE=float(scale), IEEE=bool(q.dtype == jnp.float32), TQP=tqp,
        BC=cfg.chunk, NSPLIT=cfg.splits, LSE_SPLITS=lse_splits, LSE_NSP=triton.next_power_of_2(max(1, lse_splits)),
        **sizes)
    if cfg.splits > 1:
        [idx] = _launch.launch(_decode_merge_kernel, grid=(B * H * TQ,), inputs=dict(top=top), outputs=dict(out=out),
                               num_warps=4, num_stages=1, TQ=TQ, H=H, S=S, TQP=tqp, SP=SP, NSPLIT=cfg.splits,
                               NSP=triton.next_power_of_2(cfg.splits))
    return jnp.pad(idx, [(0, 0)] * 3 + [(0, block_counts - S)], constant_values=-1)


def forward(q, k_cmp, lse, cu_seqlens, kv_lens=None, *, block_counts, block_size, scale, config=None):
    """Returns block_indices int32 [B, T, H, block_counts] (in-sequence block ids), as the reference.

    lse [B, T, HQ] (compressed attention's of the same q and k_cmp) saves the kernel its first pass;
    None computes it. kv_lens int [B] or None places the queries at the end of longer sequences
    (`nsa._varlen.tokens`), which k_cmp covers: a few of them (`decode.applies`; config None) run
    `decode_forward`. config: a Config (None: `default_config`)."""
    if kv_lens is not None and config is None and decode.applies(q, k_cmp):
        return decode_forward(q, k_cmp, lse, kv_lens, block_counts=block_counts, block_size=block_size, scale=scale)
    B, T, HQ, Dk = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    cfg = config if config is not None else default_config(q, k_cmp, block_counts=block_counts,
                                                           block_size=block_size, kv_lens=kv_lens)
    sizes = _sizes(q, k_cmp, block_counts, block_size, kv_lens)
    tok = tokens(T, block_size, cu_seqlens, kv_lens)
    per_batch = lambda x: jnp.broadcast_to(x, (B, T))
    lse_arg = jnp.zeros((1,), jnp.float32) if lse is None else lse.astype(jnp.float32)  # unread when None
    [idx] = _launch.launch(
        _select_kernel, grid=(cdiv(T, cfg.tokens), B * H),
        inputs=dict(q=q, k_cmp=k_cmp, lse=lse_arg, pos=per_batch(tok.pos), cmp_start=per_batch(tok.cmp_start)),
        outputs=dict(out=_launch.shape_dtype((B, T, H, sizes["S"]), jnp.int32)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, T=T, NC=NC, H=H, G=HQ // H, DK=Dk, BS=block_size,
        SCALE=float(scale), IEEE=bool(q.dtype == jnp.float32), HAS_LSE=lse is not None, TB=cfg.tokens,
        BC=cfg.chunk, **sizes)
    # the slots past S are always unused
    return jnp.pad(idx, [(0, 0)] * 3 + [(0, block_counts - sizes["S"])], constant_values=-1)
