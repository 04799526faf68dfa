"""Flash-decoding forward kernels for a few queries at the end of a KV cache: window, compressed, selected,
and the whole NSA step fused.

Serving: q [B, TQ, HQ, Dk] are the last TQ tokens (TQ = 1 .. 16: decode, speculative or chunked steps) of
sequences held in a padded cache k, v [B, TK, H, D]; kv_lens int32 [B] is each sequence's length, and query
i of row b sits at position p = kv_lens[b] - TQ + i. The results are the reference forwards' with
`cu_seqlens=None, kv_lens=kv_lens` (nsa.reference.{window,compressed,selected}): o [B, TQ, HQ, Dv] in q's
dtype and lse [B, TQ, HQ] float32 (natural log; -inf and o = 0 where a query sees nothing). Keys at
positions >= kv_lens[b] (and compressed rows no query sees) are never loaded, whatever they hold.

Why not the training kernels: at decode one token's work is tiny, and they tile it badly. The window and
compressed kernels (_flash.py) run one query head per program, so each KV head's keys are read G = HQ / H
times; the selected kernel runs one program per (b, h), so at B = 1, H = 4 only 4 programs run.

Design (flash-decoding). One program per (b * H + h, split):

- its tile has R = TQ * G rows, all G query heads of KV head h for each of the TQ tokens (row r: head
  h * G + r % G of token r // G), padded to RP = next_pow2(R) >= 16 rows for tl.dot, so each key is
  loaded once per KV head, not G times;
- the keys of (b, h) are one range of work units: window and compressed, the key rows any of the tile's
  tokens sees ([p_0 - W + 1, p_last] and [0, kv_lens // block_size - 1]), in tiles of BLOCK_N rows;
  selected, the distinct blocks the TQ tokens list (each loaded once for all of them, a token that lists
  a block k times adding log2(k) to its rows' logits). The units are cut into NSPLIT even shares at run
  time (a ragged batch splits each row's own range), one per program (`default_config`: enough programs
  to fill the device's SMs, never more splits than units);
- each program runs an online softmax in float32 (base 2 inside) over its share and stores float32
  partials: acc [B, H, NSPLIT, R, Dv] (unnormalized), the running max m and the sum l [B, H, NSPLIT, R];
  `_combine_kernel` then merges the splits of each row in a fixed order (deterministic, no atomics) and
  stores o and lse. With NSPLIT = 1 (large batches) the program stores o and lse itself.

The fused step (`attention`, on a `Step` of arrays, nsa._config): nsa.attention's whole decode step (compressed branch on,
blocks selected) in three launches, since launching a step's small kernels is most of its time: the compressed
and window splits in one grid (`_cmp_window_split_kernel`), the selection (nsa/triton/decode_select.py,
reading the compressed partials' m and l, `nsa.triton._splits.split_stats`; its last split of each (b, h)
merges the splits' tops), and the selected splits, whose last split of each (b, h) merges all three branches
with the gates (`_selected_gated_kernel`). "Last": each split adds 1 to a counter of its (b, h), zeroed at launch,
with an atomic add (acquire-release, GPU scope); the one that reads NSPLIT - 1 finds every other split's
partials stored. The merge itself runs in a fixed order, so the result does not depend on which split that is.

Forward only (serving needs no gradient). `nsa.triton._splits.applies(q, k)` says when the ops run these
kernels rather than the training ones (TQ <= 16 and tiles of <= 128 rows; an op's decode= argument decides
explicitly). Every array is row-major; row offsets are computed in int64 (b is int64) before they are
multiplied by the head dims.
"""

from typing import NamedTuple

import jax.numpy as jnp
import triton
import triton.language as tl

from nsa._config import Shapes, Step, expect, as_sequences, positive, power_of_two, validated
from nsa._device import KiB
from nsa._varlen import cdiv
from nsa.triton import _launch, _splits, decode_select
from nsa.triton._common import (LN2, LOG2E, all_queries, cache_rows, check, check_keys, device, online_step, paging,
                               pow2, runs)
from nsa.triton._splits import split_stats
from nsa.triton._topk import complete_rows

# `default_config`'s splits aim at PROGRAMS_PER_SM programs on each SM (nsa._device.facts: its cores); two
# measured slower than one at every shape of benchmarks/decode_tuning.py (benchmarks/results/decode-tuning.json)
PROGRAMS_PER_SM = 1
# the columns of Dv one combine program merges: 16 measured faster than 32 (twice the programs for a combine of
# many splits; benchmarks/results/decode-tuning.json, the fused step; the per-op combine takes the same tile)
COMBINE_COLS = 16
# what `default_config` leaves of a block's shared memory (nsa._device.facts: shared_memory) to what Triton keeps
# there besides the stages it plans: it plans 200 KiB of an H100's or H200's 227, which compiled within the
# limit at every shape of scripts/sm90_shared_memory.py
SHARED_MARGIN = 27 * KiB
# the fused step's last launch merges every branch's splits in its last program of each (b, h), in tiles of
# FOLD_ROWS rows by FOLD_COLS columns of Dv, FOLD_SPLITS splits loaded at once (a [FOLD_SPLITS, FOLD_ROWS, FOLD_COLS]
# float32 tile: 32 registers a thread at 4 warps); wider than the per-op combine's tiles, since one program walks
# them all
FOLD_ROWS, FOLD_COLS, FOLD_SPLITS = 16, 64, 4
_NONE = tl.constexpr(2 ** 31 - 1)  # a skipped slot of the selected kernel: above every valid int32 block id

# ------------------------------------------------------------------------------------------ kernels


@triton.jit
def _group_rows(b, h, TQ: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, RP: tl.constexpr):
    """The RP rows of the tile of KV head h of batch row b: row r is query head h * G + r % G of token r // G.
    Returns (r, ok: the row is real (r < TQ * G), t: its token (0 where not ok), q_rows: its int64 row
    (b * TQ + t) * HQ + h * G + r % G of q, o and lse)."""
    r = tl.arange(0, RP)
    ok = r < TQ * G
    t = tl.where(ok, r // G, 0)
    return r, ok, t, (b * TQ + t) * HQ + h * G + r % G


@triton.jit
def _query_tile(Q, q_rows, ok, DK: tl.constexpr, DKP: tl.constexpr):
    """q [B, TQ, HQ, DK] at the rows q_rows as an [RP, DKP] tile (rows not ok and columns >= DK read 0)."""
    dk = tl.arange(0, DKP)
    return tl.load(Q + q_rows[:, None] * DK + dk[None, :], mask=ok[:, None] & (dk < DK)[None, :], other=0.0)


@triton.jit
def _keys(K, V, rows, load, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr):
    """The keys, transposed [DKP, N], and the values [N, DVP] at the int64 rows `rows` [N] of K [.., DK] and
    V [.., DV]; only where `load` (elsewhere 0, nothing read)."""
    dk = tl.arange(0, DKP)
    dv = tl.arange(0, DVP)
    k_t = tl.load(K + rows[None, :] * DK + dk[:, None], mask=load[None, :] & (dk < DK)[:, None], other=0.0)
    v = tl.load(V + rows[:, None] * DV + dv[None, :], mask=load[:, None] & (dv < DV)[None, :], other=0.0)
    return k_t, v


@triton.jit
def _store_final(O, LSE, m, l_sum, acc, q_rows, ok, DV: tl.constexpr, DVP: tl.constexpr):
    """o = acc / l_sum into O [B, TQ, HQ, DV] (O's dtype) and lse into LSE [B, TQ, HQ] (natural log, -inf and
    o = 0 where nothing is seen), at the rows q_rows that are ok."""
    dv = tl.arange(0, DVP)
    seen = l_sum > 0
    out = acc / tl.where(seen, l_sum, 1.0)[:, None]
    tl.store(O + q_rows[:, None] * DV + dv[None, :], out.to(O.dtype.element_ty), mask=ok[:, None] & (dv < DV)[None, :])
    tl.store(LSE + q_rows, tl.where(seen, (m + tl.log2(tl.where(seen, l_sum, 1.0))) * LN2, float("-inf")), mask=ok)


@triton.jit
def _store_partial(ACC, M, L, m, l_sum, acc, bh, split, r, ok, R: tl.constexpr, NSPLIT: tl.constexpr,
                   DV: tl.constexpr, DVP: tl.constexpr):
    """The split's float32 partials at the rows r that are ok: acc into ACC [B * H, NSPLIT, R, DV], m (base 2)
    and l_sum into M and L [B * H, NSPLIT, R]."""
    dv = tl.arange(0, DVP)
    rows = (bh.to(tl.int64) * NSPLIT + split) * R + r
    tl.store(ACC + rows[:, None] * DV + dv[None, :], acc, mask=ok[:, None] & (dv < DV)[None, :])
    tl.store(M + rows, m, mask=ok)
    tl.store(L + rows, l_sum, mask=ok)


@triton.jit
def _interval(Q, K, V, KV_LENS, Q_LENS, PAGES, bh, split, NSPLIT: tl.constexpr, TQ: tl.constexpr, NK: tl.constexpr,
              HQ: tl.constexpr, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
              DVP: tl.constexpr, RP: tl.constexpr, BLOCK_N: tl.constexpr, COMPRESSED: tl.constexpr,
              WINDOW: tl.constexpr, BS: tl.constexpr, STRIDE: tl.constexpr, SCALE: tl.constexpr,
              PAGE: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, LOGITS, KEEP: tl.constexpr):
    """The window or compressed attention of one (b * H + h = bh, split) program, as softmax state.

    Row r (token t at position p = kv_lens[b] - q_lens[b] + t; a token t >= q_lens[b], a ragged step's padding,
    sees nothing) sees the key rows [lo, hi] of its sequence in K
    ([B, NK, H, DK], or with PAGE > 0 a pool of pages through the page table PAGES: `cache_rows`):
    window (COMPRESSED false), [p - WINDOW + 1, p]; compressed (windows of BS tokens every STRIDE), the rows i
    with i * STRIDE + BS <= p + 1, [0, (p + 1) // BS - 1] when STRIDE = BS; both clipped to
    [0, NK - 1]. The rows any token sees, [k_lo, k_hi], are cut into tiles of BLOCK_N keys and the tiles into
    NSPLIT shares; this program walks share `split`, loading k (transposed, [DKP, BLOCK_N]) and v
    [BLOCK_N, DVP] of each tile once for all RP rows (nothing past k_hi: a window's keys end at p_last =
    kv_lens[b] - 1, the compressed rows at kv_lens[b] // BS - 1). With KEEP, it also stores the base-2 logits of
    its rows' tiles into LOGITS [B * H, R, NK] float32 (row r of KV head bh, key rows k_lo .. k_hi; for the
    selection, which then reads them instead of the keys). Returns (m, l_sum, acc, r, ok, q_rows).
    """
    G: tl.constexpr = HQ // H
    b = (bh // H).to(tl.int64)
    h = bh % H
    r, ok, t, q_rows = _group_rows(b, h, TQ=TQ, HQ=HQ, G=G, RP=RP)
    q = _query_tile(Q, q_rows, ok, DK=DK, DKP=DKP)
    q_len = tl.load(Q_LENS + b)
    p = tl.load(KV_LENS + b) - q_len + t
    if COMPRESSED:
        lo = tl.zeros_like(p)
        hi = complete_rows(p, STRIDE, BS, STRIDE) - 1  # windows of BS every STRIDE: (p + 1) // BS if STRIDE = BS
    else:
        lo = p - WINDOW + 1
        hi = p
    lo = tl.maximum(lo, 0)
    hi = tl.minimum(hi, NK - 1)
    seen = ok & (t < q_len) & (p >= 0) & (lo <= hi)
    k_lo = tl.min(tl.where(seen, lo, NK), 0)
    k_hi = tl.max(tl.where(seen, hi, -1), 0)
    tiles = (tl.maximum(k_hi - k_lo + 1, 0) + BLOCK_N - 1) // BLOCK_N
    per = (tiles + NSPLIT - 1) // NSPLIT
    first = split * per
    last = tl.minimum(tiles, first + per)

    m = tl.full([RP], float("-inf"), tl.float32)  # running max of the base-2 logits
    l_sum = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, DVP], tl.float32)
    for i in range(first, last):
        offs = k_lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
        load = offs <= k_hi
        rows = cache_rows(PAGES, b, offs, load, h, NK=NK, H=H, PAGE=PAGE, MP=MP, NP=NP)
        k_t, v = _keys(K, V, rows, load, DK=DK, DV=DV, DKP=DKP, DVP=DVP)
        s = tl.dot(q, k_t, input_precision="ieee") * (SCALE * LOG2E)
        if KEEP:
            tl.store(LOGITS + (bh.to(tl.int64) * (TQ * G) + r)[:, None] * NK + offs[None, :], s,
                     mask=ok[:, None] & load[None, :])
        visible = seen[:, None] & (offs[None, :] >= lo[:, None]) & (offs[None, :] <= hi[:, None])
        m, l_sum, acc = online_step(m, l_sum, acc, s, v, visible, IEEE=True)
    return m, l_sum, acc, r, ok, q_rows


@triton.jit
def _interval_kernel(Q, K, V, KV_LENS, Q_LENS, PAGES, O, LSE,
                     TQ: tl.constexpr, NK: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr, DK: tl.constexpr,
                     DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, RP: tl.constexpr,
                     BLOCK_N: tl.constexpr, COMPRESSED: tl.constexpr, WINDOW: tl.constexpr, BS: tl.constexpr,
                     STRIDE: tl.constexpr, SCALE: tl.constexpr, PAGE: tl.constexpr, MP: tl.constexpr,
                     NP: tl.constexpr):
    """Window or compressed decode attention, one split: o [B, TQ, HQ, DV] and lse [B, TQ, HQ].

    Grid (B * H,). Loads q [B, TQ, HQ, DK] (the tile's RP x DKP rows), kv_lens [B], then every key tile
    the tile's tokens see (`_interval`); stores o and lse of its R = TQ * G rows.
    """
    m, l_sum, acc, r, ok, q_rows = _interval(Q, K, V, KV_LENS, Q_LENS, PAGES, tl.program_id(0), 0, NSPLIT=1, TQ=TQ,
                                             NK=NK,
                                             HQ=HQ, H=H, DK=DK, DV=DV, DKP=DKP, DVP=DVP, RP=RP, BLOCK_N=BLOCK_N,
                                             COMPRESSED=COMPRESSED, WINDOW=WINDOW, BS=BS, STRIDE=STRIDE,
                                             SCALE=SCALE, PAGE=PAGE, MP=MP, NP=NP, LOGITS=Q, KEEP=False)
    _store_final(O, LSE, m, l_sum, acc, q_rows, ok, DV=DV, DVP=DVP)


@triton.jit
def _interval_split_kernel(Q, K, V, KV_LENS, Q_LENS, PAGES, ACC, M, L,
                           TQ: tl.constexpr, NK: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr,
                           DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr,
                           RP: tl.constexpr, BLOCK_N: tl.constexpr, COMPRESSED: tl.constexpr,
                           WINDOW: tl.constexpr, BS: tl.constexpr, STRIDE: tl.constexpr, SCALE: tl.constexpr,
                           PAGE: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, NSPLIT: tl.constexpr):
    """Window or compressed decode attention, NSPLIT splits: float32 partials for `_combine_kernel`.

    Grid (B * H, NSPLIT). Loads q (RP x DKP), kv_lens [B] and the key tiles of its share (`_interval`);
    stores acc [B * H, NSPLIT, R, DV], m and l [B * H, NSPLIT, R] of its split (m = -inf, l = 0, acc = 0
    where the share is empty or unseen).
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    m, l_sum, acc, r, ok, _ = _interval(Q, K, V, KV_LENS, Q_LENS, PAGES, bh, split, NSPLIT=NSPLIT, TQ=TQ, NK=NK, HQ=HQ,
                                        H=H,
                                        DK=DK, DV=DV, DKP=DKP, DVP=DVP, RP=RP, BLOCK_N=BLOCK_N, COMPRESSED=COMPRESSED,
                                        WINDOW=WINDOW, BS=BS, STRIDE=STRIDE, SCALE=SCALE, PAGE=PAGE, MP=MP, NP=NP,
                                        LOGITS=Q, KEEP=False)
    _store_partial(ACC, M, L, m, l_sum, acc, bh, split, r, ok, R=TQ * (HQ // H), NSPLIT=NSPLIT, DV=DV, DVP=DVP)


@triton.jit
def _selected(Q, K, V, IDX, COUNTS, KV_LENS, Q_LENS, PAGES, bh, split, NSPLIT: tl.constexpr, TQ: tl.constexpr,
              TK: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr, S: tl.constexpr, DK: tl.constexpr,
              DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, RP: tl.constexpr, TQP: tl.constexpr,
              SP: tl.constexpr, BS: tl.constexpr, BSP: tl.constexpr, NSUB: tl.constexpr, SCALE: tl.constexpr,
              PAGE: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr):
    """The selected attention of one (b * H + h = bh, split) program, as softmax state.

    Token t (position p_t = kv_lens[b] - q_lens[b] + t; tokens t >= q_lens[b] list nothing) lists the blocks
    IDX[b, t, h, :COUNTS[b, t, h]] (IDX
    [B, TQ, H, S] int32); a slot is skipped when negative or after p_t // BS. The valid
    slots of the TQ tokens (a [TQP, SP] tile) are sorted and ranked by an associative scan: the tile's
    distinct blocks are the values of ranks 1 .. num, in increasing order, cut into NSPLIT shares. This
    program walks share `split`: block i is the value of rank i + 1 (computed from i alone, so the loop
    carries no block state), loaded once for all RP rows in NSUB chunks of BSP keys (k transposed
    [DKP, BSP], v [BSP, DVP]; only keys before kv_lens[b]; with PAGE > 0 from the pool of pages K, V through
    the page table PAGES, `cache_rows`). Row r sees key u of the block iff its token
    lists the block and u <= its position; a token that lists it k times adds log2(k) to its rows' logits
    (attended k times). Returns (m, l_sum, acc, r, ok, q_rows).
    """
    G: tl.constexpr = HQ // H
    b = (bh // H).to(tl.int64)
    h = bh % H
    r, ok, t, q_rows = _group_rows(b, h, TQ=TQ, HQ=HQ, G=G, RP=RP)
    q = _query_tile(Q, q_rows, ok, DK=DK, DKP=DKP)
    kv_len = tl.load(KV_LENS + b)
    key_end = tl.minimum(kv_len, TK)  # loads stay in the cache even for a kv_lens past it
    q_len = tl.load(Q_LENS + b)
    p_row = tl.where(ok & (t < q_len), kv_len - q_len + t, -1)

    tok = tl.arange(0, TQP)
    p_tok = kv_len - q_len + tok
    slots = tl.arange(0, SP)
    lists = (b * TQ + tl.minimum(tok, TQ - 1)) * H + h
    listed = tl.load(IDX + lists[:, None] * S + slots[None, :], mask=(tok < TQ)[:, None] & (slots < S)[None, :],
                     other=-1)
    count = tl.load(COUNTS + lists, mask=tok < TQ, other=0)
    valid = ((slots[None, :] < count[:, None]) & (listed >= 0) & ((tok < q_len) & (p_tok >= 0))[:, None]
             & (listed <= (tl.maximum(p_tok, 0) // BS)[:, None]))
    firsts = tl.where(valid, listed, _NONE)  # [TQP, SP]
    in_order = tl.sort(tl.reshape(firsts, [TQP * SP]))
    _, _, rank = tl.associative_scan((in_order, in_order, tl.full([TQP * SP], 1, tl.int32)), 0, runs)
    num = tl.max(tl.where(in_order < _NONE, rank, 0))
    per = (num + NSPLIT - 1) // NSPLIT
    first = split * per
    last = tl.minimum(num, first + per)
    row_token = (t[:, None] == tok[None, :]) & ok[:, None]  # [RP, TQP]

    m = tl.full([RP], float("-inf"), tl.float32)
    l_sum = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, DVP], tl.float32)
    for i in range(first, last):
        blk = tl.min(tl.where(rank == i + 1, in_order, _NONE))
        times = tl.sum((firsts == blk).to(tl.float32), 1)  # [TQP]: how many slots of each token list it
        times = tl.sum(tl.where(row_token, times[None, :], 0.0), 1)  # [RP]
        bias = tl.log2(tl.maximum(times, 1.0))
        for chunk in tl.static_range(NSUB):  # the block in chunks of BSP keys
            j = chunk * BSP + tl.arange(0, BSP)
            key_pos = blk * BS + j
            load = (j < BS) & (key_pos < key_end)
            rows = cache_rows(PAGES, b, key_pos, load, h, NK=TK, H=H, PAGE=PAGE, MP=MP, NP=NP)
            k_t, v = _keys(K, V, rows, load, DK=DK, DV=DV, DKP=DKP, DVP=DVP)
            s = tl.dot(q, k_t, input_precision="ieee") * (SCALE * LOG2E) + bias[:, None]
            visible = (times > 0)[:, None] & load[None, :] & (key_pos[None, :] <= p_row[:, None])
            m, l_sum, acc = online_step(m, l_sum, acc, s, v, visible, IEEE=True)
    return m, l_sum, acc, r, ok, q_rows


@triton.jit
def _selected_kernel(Q, K, V, IDX, COUNTS, KV_LENS, Q_LENS, PAGES, O, LSE,
                     TQ: tl.constexpr, TK: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr, S: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr, DVP: tl.constexpr, RP: tl.constexpr,
                     TQP: tl.constexpr, SP: tl.constexpr, BS: tl.constexpr, BSP: tl.constexpr,
                     NSUB: tl.constexpr, SCALE: tl.constexpr, PAGE: tl.constexpr, MP: tl.constexpr,
                     NP: tl.constexpr):
    """Selected decode attention, one split: o [B, TQ, HQ, DV] and lse [B, TQ, HQ].

    Grid (B * H,). Loads q (RP x DKP), kv_lens [B], the slots IDX [B, TQ, H, S] and COUNTS [B, TQ, H] of
    its TQ tokens, then each distinct listed block once (`_selected`); stores o and lse of its R rows.
    """
    m, l_sum, acc, r, ok, q_rows = _selected(Q, K, V, IDX, COUNTS, KV_LENS, Q_LENS, PAGES, tl.program_id(0), 0,
                                             NSPLIT=1,
                                             TQ=TQ, TK=TK, HQ=HQ, H=H, S=S, DK=DK, DV=DV, DKP=DKP, DVP=DVP, RP=RP,
                                             TQP=TQP, SP=SP, BS=BS, BSP=BSP, NSUB=NSUB, SCALE=SCALE, PAGE=PAGE, MP=MP,
                                             NP=NP)
    _store_final(O, LSE, m, l_sum, acc, q_rows, ok, DV=DV, DVP=DVP)


@triton.jit
def _selected_split_kernel(Q, K, V, IDX, COUNTS, KV_LENS, Q_LENS, PAGES, ACC, M, L,
                           TQ: tl.constexpr, TK: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr,
                           S: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
                           DVP: tl.constexpr, RP: tl.constexpr, TQP: tl.constexpr, SP: tl.constexpr,
                           BS: tl.constexpr, BSP: tl.constexpr, NSUB: tl.constexpr, SCALE: tl.constexpr,
                           PAGE: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, NSPLIT: tl.constexpr):
    """Selected decode attention, NSPLIT splits: float32 partials for `_combine_kernel`.

    Grid (B * H, NSPLIT). Loads as `_selected_kernel`, but only the blocks of its share; stores acc
    [B * H, NSPLIT, R, DV], m and l [B * H, NSPLIT, R] of its split.
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    m, l_sum, acc, r, ok, _ = _selected(Q, K, V, IDX, COUNTS, KV_LENS, Q_LENS, PAGES, bh, split, NSPLIT=NSPLIT, TQ=TQ,
                                        TK=TK,
                                        HQ=HQ, H=H, S=S, DK=DK, DV=DV, DKP=DKP, DVP=DVP, RP=RP, TQP=TQP, SP=SP, BS=BS,
                                        BSP=BSP, NSUB=NSUB, SCALE=SCALE, PAGE=PAGE, MP=MP, NP=NP)
    _store_partial(ACC, M, L, m, l_sum, acc, bh, split, r, ok, R=TQ * (HQ // H), NSPLIT=NSPLIT, DV=DV, DVP=DVP)


@triton.jit
def _merge_splits(ACC, M, L, bh, r, ok, d, d_ok, R: tl.constexpr, DV: tl.constexpr, NSPLIT: tl.constexpr,
                  NSP: tl.constexpr, CR: tl.constexpr, CD: tl.constexpr, CS: tl.constexpr, CACHE: tl.constexpr):
    """The rows r [CR] (ok) and columns d [CD] (d_ok) of KV head bh's tile merged over the splits of ACC
    [B * H, NSPLIT, R, DV], M and L [B * H, NSPLIT, R] in a fixed order (deterministic): (o [CR, CD] float32,
    lse [CR] natural log; -inf and o = 0 where no split saw anything). CACHE: the loads' cache modifier (".cg",
    through L2 only, for partials that other programs of the same launch stored).

    The rows' max and sum come from `split_stats`, the weights exp2(m_split - max); then the acc partials in
    chunks of CS splits ([CS, CR, CD] tiles, each chunk's loads issued together rather than one split after
    another, which timed slower when these kernels were written: commit 0eb76cf's docstring; no results file
    holds it), chunk after chunk, each summed over its splits by the same reduction tree."""
    rows = bh.to(tl.int64) * NSPLIT * R + r  # split 0's partial rows; split s adds s * R
    m_use, l_sum, lse2 = split_stats(M, L, rows, ok, R=R, NSPLIT=NSPLIT, NSP=NSP, CACHE=CACHE)
    acc = tl.zeros([CR, CD], tl.float32)
    for c in tl.static_range(0, NSPLIT, CS):
        s = c + tl.arange(0, CS)
        used = (s < NSPLIT)[:, None] & ok[None, :]  # [CS, CR]
        part_rows = rows[None, :] + s[:, None] * R
        w = tl.exp2(tl.load(M + part_rows, mask=used, other=float("-inf"), cache_modifier=CACHE) - m_use[None, :])
        part = tl.load(ACC + part_rows[:, :, None] * DV + d[None, None, :], mask=used[:, :, None] & d_ok[None, None, :],
                       other=0.0, cache_modifier=CACHE)  # [CS, CR, CD]
        acc += tl.sum(w[:, :, None] * part, 0)
    return acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None], lse2 * LN2


@triton.jit
def _combine_tile(TQ: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr, DV: tl.constexpr, CR: tl.constexpr,
                  CD: tl.constexpr):
    """The combine's tile of program (b * H + h, row tile, column tile): (bh, r [CR], ok, d [CD], d_ok, q_rows:
    the int64 rows (b * TQ + r // G) * HQ + h * G + r % G of o and lse)."""
    G: tl.constexpr = HQ // H
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    r = tl.program_id(1) * CR + tl.arange(0, CR)
    ok = r < TQ * G
    d = tl.program_id(2) * CD + tl.arange(0, CD)
    return bh, r, ok, d, d < DV, (b * TQ + tl.where(ok, r // G, 0)) * HQ + (bh % H) * G + r % G


@triton.jit
def _combine_kernel(ACC, M, L, O, LSE,
                    TQ: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr, DV: tl.constexpr, NSPLIT: tl.constexpr,
                    NSP: tl.constexpr, CR: tl.constexpr, CD: tl.constexpr, CS: tl.constexpr):
    """The splits of each row merged in a fixed order (deterministic): o [B, TQ, HQ, DV] and lse [B, TQ, HQ].

    Grid (B * H, cdiv(R, CR), cdiv(DV, CD)): CR rows of one KV head's tile by CD columns of DV. Loads m and l of
    every split ([NSP, CR]) and the acc partials [CS, CR, CD] at a time (`_merge_splits`); stores o in O's dtype
    and (column tile 0) lse.
    """
    bh, r, ok, d, d_ok, q_rows = _combine_tile(TQ=TQ, HQ=HQ, H=H, DV=DV, CR=CR, CD=CD)
    out, lse = _merge_splits(ACC, M, L, bh, r, ok, d, d_ok, R=TQ * (HQ // H), DV=DV, NSPLIT=NSPLIT, NSP=NSP, CR=CR,
                             CD=CD, CS=CS, CACHE="")
    tl.store(O + q_rows[:, None] * DV + d[None, :], out.to(O.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])
    tl.store(LSE + q_rows, lse, mask=ok & (tl.program_id(2) == 0))


@triton.jit
def _cmp_window_split_kernel(Q, K, V, K_CMP, V_CMP, KV_LENS, Q_LENS, PAGES, ACC_C, M_C, L_C, ACC_W, M_W, L_W, LOGITS,
                             TQ: tl.constexpr, TK: tl.constexpr, NC: tl.constexpr, HQ: tl.constexpr,
                             H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
                             DVP: tl.constexpr, RP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
                             WINDOW: tl.constexpr, BS: tl.constexpr, STRIDE: tl.constexpr, SCALE: tl.constexpr,
                             NS_C: tl.constexpr, NS_W: tl.constexpr, PAGE: tl.constexpr, PAGE_C: tl.constexpr,
                             MP: tl.constexpr, NP: tl.constexpr, KEEP: tl.constexpr):
    """The fused decode step's first launch: compressed and window attention, float32 partials of each.

    Grid (B * H, NS_C + NS_W): programs (bh, s < NS_C) take share s of the compressed rows K_CMP, V_CMP
    [B, NC, H, D] (tiles of BLOCK_C), the others share s - NS_C of the window's keys K, V [B, TK, H, D]
    (tiles of BLOCK_W), as `_interval_split_kernel`; stores acc, m and l into ACC_C, M_C, L_C [B * H, NS_C,
    R, ..] or ACC_W, M_W, L_W [B * H, NS_W, R, ..]. A paged cache (PAGE > 0): K, V are pools of pages of PAGE
    rows, K_CMP, V_CMP of PAGE_C = PAGE / STRIDE compressed rows, both through the page table PAGES [B, MP].
    With KEEP, the compressed programs also store their base-2 logits into LOGITS [B * H, R, NC] (`_interval`).
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    R: tl.constexpr = TQ * (HQ // H)
    if split < NS_C:
        m, l_sum, acc, r, ok, _ = _interval(Q, K_CMP, V_CMP, KV_LENS, Q_LENS, PAGES, bh, split, NSPLIT=NS_C, TQ=TQ,
                                            NK=NC,
                                            HQ=HQ, H=H, DK=DK, DV=DV, DKP=DKP, DVP=DVP, RP=RP, BLOCK_N=BLOCK_C,
                                            COMPRESSED=True, WINDOW=0, BS=BS, STRIDE=STRIDE, SCALE=SCALE,
                                            PAGE=PAGE_C, MP=MP, NP=NP, LOGITS=LOGITS, KEEP=KEEP)
        _store_partial(ACC_C, M_C, L_C, m, l_sum, acc, bh, split, r, ok, R=R, NSPLIT=NS_C, DV=DV, DVP=DVP)
    else:
        m, l_sum, acc, r, ok, _ = _interval(Q, K, V, KV_LENS, Q_LENS, PAGES, bh, split - NS_C, NSPLIT=NS_W, TQ=TQ,
                                            NK=TK,
                                            HQ=HQ, H=H, DK=DK, DV=DV, DKP=DKP, DVP=DVP, RP=RP, BLOCK_N=BLOCK_W,
                                            COMPRESSED=False, WINDOW=WINDOW, BS=1, STRIDE=1, SCALE=SCALE, PAGE=PAGE,
                                            MP=MP, NP=NP, LOGITS=LOGITS, KEEP=False)
        _store_partial(ACC_W, M_W, L_W, m, l_sum, acc, bh, split - NS_C, r, ok, R=R, NSPLIT=NS_W, DV=DV, DVP=DVP)


@triton.jit
def _gated(o, ACC, M, L, GATE, bh, r, ok, d, d_ok, q_rows, GATED: tl.constexpr, O_TYPE: tl.constexpr,
           R: tl.constexpr, DV: tl.constexpr, NSPLIT: tl.constexpr, NSP: tl.constexpr, CR: tl.constexpr,
           CD: tl.constexpr, CS: tl.constexpr, CACHE: tl.constexpr):
    """o [CR, CD] float32 plus one branch's output, merged from its splits (`_merge_splits`) and rounded to
    O_TYPE as the branch's op returns it, times its gate GATE [B, TQ, HQ] at q_rows (1 when not GATED)."""
    out, _ = _merge_splits(ACC, M, L, bh, r, ok, d, d_ok, R=R, DV=DV, NSPLIT=NSPLIT, NSP=NSP, CR=CR, CD=CD, CS=CS,
                           CACHE=CACHE)
    out = out.to(O_TYPE).to(tl.float32)
    if GATED:
        out = tl.load(GATE + q_rows, mask=ok, other=0.0).to(tl.float32)[:, None] * out
    return o + out


@triton.jit
def _selected_gated_kernel(Q, K, V, IDX, COUNTS, KV_LENS, Q_LENS, PAGES, ACC_C, M_C, L_C, ACC_W, M_W, L_W, G_CMP,
                           G_SLC, G_SWA, ACC_S, M_S, L_S, DONE, O,
                           TQ: tl.constexpr, TK: tl.constexpr, HQ: tl.constexpr, H: tl.constexpr,
                           S: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
                           DVP: tl.constexpr, RP: tl.constexpr, TQP: tl.constexpr, SP: tl.constexpr,
                           BS: tl.constexpr, BSP: tl.constexpr, NSUB: tl.constexpr, SCALE: tl.constexpr,
                           PAGE: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr,
                           NS_C: tl.constexpr, NS_S: tl.constexpr, NS_W: tl.constexpr, NSP_C: tl.constexpr,
                           NSP_S: tl.constexpr, NSP_W: tl.constexpr, GATED_C: tl.constexpr,
                           GATED_S: tl.constexpr, GATED_W: tl.constexpr, CR: tl.constexpr, CD: tl.constexpr,
                           CS_C: tl.constexpr, CS_S: tl.constexpr, CS_W: tl.constexpr):
    """The fused decode step's last launch: the selected splits, then o = g_cmp * o_cmp + g_slc * o_slc +
    g_swa * o_swa.

    Grid (B * H, NS_S). Program (bh, split) runs share `split` of the selected blocks as `_selected_split_kernel`
    and stores its float32 partials into ACC_S, M_S, L_S [B * H, NS_S, R, ..]; then counts itself done in DONE
    [B * H] (int32, zero at launch; an atomic add, acquire-release at GPU scope, after a barrier of its
    threads). The last split of (b, h) to finish merges every branch's splits for the R rows of KV head h
    (compressed NS_C and window NS_W from the first launch's partials, none when NS_W = 0; selected NS_S,
    loaded through L2, `.cg`), in tiles of CR rows by CD columns of DV, CS_* splits loaded at once, as each
    branch's own combine would; rounds each branch's output to O's dtype, loads the gates [B, TQ, HQ] of its
    rows (a missing gate, not GATED_*, is 1) and sums in nsa.attention's order and precision (float32); stores
    o [B, TQ, HQ, DV] in O's dtype. Which split is last varies from run to run; what it computes does not.
    """
    bh = tl.program_id(0)
    split = tl.program_id(1)
    G: tl.constexpr = HQ // H
    R: tl.constexpr = TQ * G
    m, l_sum, acc, r, ok, _ = _selected(Q, K, V, IDX, COUNTS, KV_LENS, Q_LENS, PAGES, bh, split, NSPLIT=NS_S, TQ=TQ,
                                        TK=TK, HQ=HQ, H=H, S=S, DK=DK, DV=DV, DKP=DKP, DVP=DVP, RP=RP, TQP=TQP, SP=SP,
                                        BS=BS, BSP=BSP, NSUB=NSUB, SCALE=SCALE, PAGE=PAGE, MP=MP, NP=NP)
    _store_partial(ACC_S, M_S, L_S, m, l_sum, acc, bh, split, r, ok, R=R, NSPLIT=NS_S, DV=DV, DVP=DVP)
    tl.debug_barrier()  # every thread's stores before the release
    if tl.atomic_add(DONE + bh, 1, sem="acq_rel", scope="gpu") == NS_S - 1:
        b = (bh // H).to(tl.int64)
        for tile in range(((R + CR - 1) // CR) * (DVP // CD)):
            r = (tile // (DVP // CD)) * CR + tl.arange(0, CR)
            ok = r < R
            d = (tile % (DVP // CD)) * CD + tl.arange(0, CD)
            d_ok = d < DV
            q_rows = (b * TQ + tl.where(ok, r // G, 0)) * HQ + (bh % H) * G + r % G
            o = tl.zeros([CR, CD], tl.float32)
            o = _gated(o, ACC_C, M_C, L_C, G_CMP, bh, r, ok, d, d_ok, q_rows, GATED=GATED_C,
                       O_TYPE=O.dtype.element_ty, R=R, DV=DV, NSPLIT=NS_C, NSP=NSP_C, CR=CR, CD=CD, CS=CS_C, CACHE="")
            o = _gated(o, ACC_S, M_S, L_S, G_SLC, bh, r, ok, d, d_ok, q_rows, GATED=GATED_S,
                       O_TYPE=O.dtype.element_ty, R=R, DV=DV, NSPLIT=NS_S, NSP=NSP_S, CR=CR, CD=CD, CS=CS_S,
                       CACHE=".cg")
            if NS_W > 0:
                o = _gated(o, ACC_W, M_W, L_W, G_SWA, bh, r, ok, d, d_ok, q_rows, GATED=GATED_W,
                           O_TYPE=O.dtype.element_ty, R=R, DV=DV, NSPLIT=NS_W, NSP=NSP_W, CR=CR, CD=CD, CS=CS_W,
                           CACHE="")
            tl.store(O + q_rows[:, None] * DV + d[None, :], o.to(O.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------------- launches


@validated
class Config(NamedTuple):
    """The launches of the decode kernels (window, compressed and selected: one Config type for the three and
    their combine): BLOCK_N keys per tile (window and compressed: a tile of key rows; selected: a chunk of a
    block, NSUB = cdiv(block_size, BLOCK_N) chunks), NSPLIT splits of each (b, h)'s work (1: no combine), the
    warps and pipeline stages of the attention kernels, and the combine's tile of combine_rows rows by
    combine_cols columns of Dv, combine_splits splits loaded at once, combine_warps warps."""

    block_n: int
    splits: int
    num_warps: int
    num_stages: int
    combine_rows: int = 16
    combine_cols: int = COMBINE_COLS
    combine_splits: int = 8
    combine_warps: int = 4

    def check(self):
        power_of_two(self, "block_n", "num_warps", "combine_rows", "combine_cols", "combine_splits", "combine_warps")
        expect(self.block_n >= 16, self, "block_n", "at least 16 (tl.dot's smallest side)")
        positive(self, "splits", "num_stages")


def _units(shapes):
    """(units, block_size): the most work units one (b, h) can have and, for the selected kernel, the block's
    keys (None for the window and compressed kernels). `shapes` says which kernel: block_counts > 0, the
    selected one (its units the distinct blocks the TQ tokens list at most, S each); else block_size > 0, the
    compressed one (the NC = TK compressed rows); else the window (the key rows its tokens see at most)."""
    if shapes.block_counts > 0:
        return max(1, min(shapes.T * shapes.block_counts, cdiv(shapes.TK, shapes.block_size))), shapes.block_size
    if shapes.block_size > 0:
        return max(1, shapes.TK), None
    return max(1, min(min(shapes.window_size, shapes.TK) + shapes.T - 1, shapes.TK)), None


def default_config(shapes, dtype, device):
    """The Config of q [B, TQ, HQ, Dk] against the keys k [B, NK, H, Dk] and values [B, NK, H, Dv], for the
    kernel its `nsa._config.Shapes` names: `Shapes.of(q, k, v, window_size=...)` (window),
    `Shapes.of(q, k_cmp, v_cmp, block_size=...)` (compressed) or `Shapes.of(q, k, v, block_size=...,
    block_counts=S)` (selected).

    - BLOCK_N: 64 key rows, or fewer while BLOCK_N * (DKP + DVP) elements take more than 64 KiB (float32 at
      Dk = Dv = 256), and no more than the keys there are (window and compressed); selected: a block in one
      chunk of pow2(block_size) keys under the same 64 KiB, else in chunks.
    - NSPLIT: enough programs to fill the device, cdiv(device.cores * PROGRAMS_PER_SM, B * H) splits, never
      more than the work units (`_units`: tiles or blocks), and 1 (no combine) from B * H >= cores. More
      splits than units would only add empty programs. Measured on an H200 (benchmarks/decode.py: the ops and
      the fused step, benchmarks/results/decode.json and decode-fused-tuned.json); the per-kernel times behind
      this heuristic, against one split and against the training kernels, are in commit 0eb76cf (its message
      and this docstring there), which added these kernels: no results file holds them.
    - Warps: 4, 8 once a tile side passes 128. Stages: as many key tiles (selected: whole blocks, all their
      chunks) in flight, up to 3, as fit in the device's shared memory less SHARED_MARGIN next to the query
      tile and twice the probability tile [RP, BLOCK_N] (scripts/sm90_shared_memory.py compiles every decode
      launch for sm_90 and checks what they take).
    """
    units, block_size = _units(shapes)
    itemsize = jnp.dtype(dtype).itemsize
    dkp, dvp, rp = pow2(shapes.Dk), pow2(shapes.Dv), pow2(shapes.T * shapes.G)
    fit = max(16, triton.next_power_of_2(65536 // (itemsize * (dkp + dvp)) + 1) // 2)
    if block_size is None:
        block_n = min(64, fit, pow2(units))
        tiles, stage = cdiv(units, block_n), block_n
    else:
        block_n = min(pow2(block_size), fit)
        tiles, stage = units, cdiv(block_size, block_n) * block_n  # a stage holds a whole block
    stage *= (dkp + dvp) * itemsize
    fixed = rp * (dkp + 2 * block_n) * itemsize  # the query tile, the probabilities (and as much again)
    stages = max(1, min(3, (device.shared_memory - SHARED_MARGIN - fixed) // stage))
    return Config(block_n=block_n, splits=_splits.splits(tiles, shapes.B * shapes.H, PROGRAMS_PER_SM, device),
                  num_warps=8 if max(dkp, dvp, rp, block_n) > 128 else 4, num_stages=int(stages),
                  combine_cols=COMBINE_COLS)


def _meta(q, k, v, scale, cfg):
    """The constexprs every attention kernel takes."""
    _, TQ, HQ, Dk = q.shape
    H, Dv = k.shape[2], v.shape[3]
    return dict(TQ=TQ, HQ=HQ, H=H, DK=Dk, DV=Dv, DKP=pow2(Dk), DVP=pow2(Dv), RP=pow2(TQ * (HQ // H)),
                SCALE=float(scale), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _partials(B, H, splits, R, Dv):
    """The float32 partials of `splits` splits: acc [B * H, splits, R, Dv], m and l [B * H, splits, R]."""
    return dict(ACC=_launch.shape_dtype((B * H, splits, R, Dv), jnp.float32),
                M=_launch.shape_dtype((B * H, splits, R), jnp.float32),
                L=_launch.shape_dtype((B * H, splits, R), jnp.float32))


def _combine_block(cfg, R, Dv):
    """(CR, CD): the combine's tile, cfg's rows and columns, no larger than R rows by Dv columns padded."""
    return min(cfg.combine_rows, pow2(R)), min(cfg.combine_cols, pow2(Dv))


def _run(kernel, split_kernel, q, v, inputs, cfg, meta):
    """The attention kernel on grid (B * H, NSPLIT) (the final kernel when NSPLIT = 1), then the combine:
    (o [B, TQ, HQ, Dv] in q's dtype, lse [B, TQ, HQ] float32)."""
    B, TQ, HQ, _ = q.shape
    H, Dv = meta["H"], v.shape[3]
    outputs = dict(O=_launch.shape_dtype((B, TQ, HQ, Dv), q.dtype), LSE=_launch.shape_dtype((B, TQ, HQ), jnp.float32))
    if B * TQ * HQ == 0:  # no query: empty results, nothing launched
        return jnp.zeros((B, TQ, HQ, Dv), q.dtype), jnp.zeros((B, TQ, HQ), jnp.float32)
    if cfg.splits == 1:
        return _launch.launch(kernel, grid=(B * H,), inputs=inputs, outputs=outputs, **meta)
    R = TQ * (HQ // H)
    acc, m, l_sum = _launch.launch(split_kernel, grid=(B * H, cfg.splits), inputs=inputs,
                                   outputs=_partials(B, H, cfg.splits, R, Dv), NSPLIT=cfg.splits, **meta)
    cr, cd = _combine_block(cfg, R, Dv)
    nsp = triton.next_power_of_2(cfg.splits)
    return _launch.launch(
        _combine_kernel, grid=(B * H, cdiv(R, cr), cdiv(Dv, cd)),
        inputs=dict(ACC=acc, M=m, L=l_sum), outputs=outputs, TQ=TQ, HQ=HQ, H=H, DV=Dv, NSPLIT=cfg.splits, NSP=nsp,
        CR=cr, CD=cd, CS=min(cfg.combine_splits, nsp), num_warps=cfg.combine_warps, num_stages=1)


def _check(q, k, v, kv_lens, names=("k", "v")):
    """q, k, v as `check_keys` takes them (names: how the caller calls k and v) and kv_lens [B]: a ValueError
    names the argument that does not fit."""
    check_keys(q, k, v, names)
    check(kv_lens.shape == (q.shape[0],), "kv_lens", f"shape [B] = ({q.shape[0]},)", tuple(kv_lens.shape))


def window(q, k, v, kv_lens, *, window_size, scale, config=None):
    """Sliding-window attention of the queries q [B, TQ, HQ, Dk] at the end of the cache k [B, TK, H, Dk],
    v [B, TK, H, Dv] (kv_lens int [B]): key j is visible to the query at p iff p - window_size < j <= p.
    Returns (o [B, TQ, HQ, Dv] in q's dtype, lse [B, TQ, HQ] float32); config: a Config (None: default)."""
    _check(q, k, v, kv_lens)
    W = min(int(window_size), k.shape[1])  # a wider window sees the same keys
    cfg = default_config(Shapes.of(q, k, v, window_size=W), q.dtype, device()) if config is None else config
    pages, pages_meta = paging(None, k)
    meta = dict(_meta(q, k, v, scale, cfg), NK=k.shape[1], BLOCK_N=cfg.block_n, COMPRESSED=False, WINDOW=W, BS=1,
                STRIDE=1, **pages_meta)
    return _run(_interval_kernel, _interval_split_kernel, q, v,
                dict(Q=q, K=k, V=v, KV_LENS=kv_lens.astype(jnp.int32), Q_LENS=all_queries(q), PAGES=pages), cfg,
                meta)


def compressed(q, k_cmp, v_cmp, kv_lens, *, block_size, stride, scale, config=None):
    """Compressed attention of the queries q [B, TQ, HQ, Dk] at the end of sequences of kv_lens int [B] tokens
    over k_cmp [B, NC, H, Dk], v_cmp [B, NC, H, Dv] (windows of block_size tokens every `stride`): row i is
    visible to the query at p iff i * stride + block_size <= p + 1. Returns (o, lse) as `window`; config: a Config
    (None: default)."""
    _check(q, k_cmp, v_cmp, kv_lens, ("k_cmp", "v_cmp"))
    shapes = Shapes.of(q, k_cmp, v_cmp, block_size=int(block_size))
    cfg = default_config(shapes, q.dtype, device()) if config is None else config
    pages, pages_meta = paging(None, k_cmp)
    meta = dict(_meta(q, k_cmp, v_cmp, scale, cfg), NK=k_cmp.shape[1], BLOCK_N=cfg.block_n, COMPRESSED=True,
                WINDOW=0, BS=int(block_size), STRIDE=int(stride), **pages_meta)
    return _run(_interval_kernel, _interval_split_kernel, q, v_cmp,
                dict(Q=q, K=k_cmp, V=v_cmp, KV_LENS=kv_lens.astype(jnp.int32), Q_LENS=all_queries(q), PAGES=pages),
                cfg, meta)


def selected(q, k, v, block_indices, block_counts, kv_lens, *, block_size, scale, config=None):
    """Selected attention of the queries q [B, TQ, HQ, Dk] at the end of the cache k [B, TK, H, Dk], v
    [B, TK, H, Dv] (kv_lens int [B]): the query at p of KV head h attends to the keys at positions <= p of
    the blocks block_indices[b, t, h, :block_counts[b, t, h]] (int [B, TQ, H, S] and int32 [B, TQ, H]);
    entries < 0 or > p // block_size are ignored and never loaded, a block listed twice is attended twice.
    Returns (o, lse) as `window`; config: a Config (None: default)."""
    inputs, cfg, meta = _selected_launch(q, k, v, block_indices, block_counts, kv_lens, block_size=block_size,
                                         scale=scale, config=config)
    return _run(_selected_kernel, _selected_split_kernel, q, v, inputs, cfg, meta)


def _selected_launch(q, k, v, block_indices, block_counts, kv_lens, *, block_size, scale, config, page_table=None,
                     q_lens=None):
    """The inputs, Config and constexprs of the selected kernels (`selected`; with a page_table [B, MP], k and v
    are pools of pages, and with q_lens int32 [B] sequence b's queries are its first q_lens[b] rows:
    nsa._config.Step's)."""
    pages, pages_meta = paging(page_table, k)
    k_pool, v_pool = k, v
    k, v = as_sequences(k, page_table), as_sequences(v, page_table)
    _check(q, k, v, kv_lens)
    B, TQ, _, _ = q.shape
    TK, H, S = k.shape[1], k.shape[2], block_indices.shape[-1]
    check(block_indices.shape == (B, TQ, H, S), "block_indices", f"shape [B, TQ, H, S] = ({B}, {TQ}, {H}, S)",
          tuple(block_indices.shape))
    check(block_counts.shape == (B, TQ, H), "block_counts", f"shape [B, TQ, H] = ({B}, {TQ}, {H})",
          tuple(block_counts.shape))
    bs = int(block_size)
    shapes = Shapes.of(q, k, v, block_size=bs, block_counts=S)
    cfg = default_config(shapes, q.dtype, device()) if config is None else config
    idx = block_indices  # int32 ids past p // bs are skipped whatever their size; wider ones are clipped first
    if idx.dtype != jnp.int32:
        idx = jnp.clip(idx, -1, TK // bs + 1).astype(jnp.int32)  # the same validity
    tqp = triton.next_power_of_2(TQ)
    meta = dict(_meta(q, k, v, scale, cfg), TK=TK, S=S, TQP=tqp, SP=max(triton.next_power_of_2(S), 16 // tqp),
                BS=bs, BSP=cfg.block_n, NSUB=cdiv(bs, cfg.block_n), **pages_meta)
    inputs = dict(Q=q, K=k_pool, V=v_pool, IDX=idx, COUNTS=block_counts.astype(jnp.int32),
                  KV_LENS=kv_lens.astype(jnp.int32), PAGES=pages,
                  Q_LENS=all_queries(q) if q_lens is None else q_lens)
    return inputs, cfg, meta


def keeps_logits(R, Dk, dtype):
    """Whether the fused step's compressed splits store their logits for the selection (`attention`): when a
    compressed row's R float32 logits (R = TQ * G rows of a KV head's tile) take fewer bytes than its Dk keys in
    `dtype`, which the selection would otherwise read again (at decode, G = 16, Dk = 128, bf16: 64 bytes
    written and read once against 256 read)."""
    return R * 4 < Dk * jnp.dtype(dtype).itemsize


def attention(*arrays, block_counts, block_size, compress_block_size, compress_stride, window_size, scale):
    """One NSA decode step, fused: nsa.attention's output with the compressed branch on and the blocks
    selected, for the `Step` of arrays (positional, in its order); window_size 0 for no window. Returns
    o [B, TQ, HQ, Dv] in q's dtype.

    Three launches instead of the ops' ten (and XLA's gating): a step's kernels take a few microseconds each,
    so launching them is most of its time. (1) `_cmp_window_split_kernel`: the compressed rows' and the
    window's splits, float32 partials, and where `keeps_logits`, the compressed logits; (2) the selection
    (nsa/triton/decode_select.py) reading compressed attention's lse from those partials (and those logits
    rather than q and k_cmp), its last split of each (b, h) merging the splits' tops; (3)
    `_selected_gated_kernel`: the selected splits, the last of each (b, h) merging every branch's splits, rounded
    to q's dtype and gated, as nsa.attention sums them. Each split count and tile is its op's `default_config`
    (the last launch's merge: FOLD_ROWS, FOLD_COLS, FOLD_SPLITS); the first launch takes the larger warps and the
    fewer stages of its two branches. A paged cache (the Step's page_table [B, MP]): every kernel reads the pools' rows through the page
    table itself (`nsa.triton._common.cache_rows`), nothing is gathered. A ragged step (the Step's q_lens [B]):
    sequence b's queries are the first q_lens[b] rows of q, at positions kv_lens[b] - q_lens[b] + t; the other rows
    see nothing, their output 0 (their gates must be finite: nsa.attention zeroes them).
    """
    step = Step(*arrays)
    table = step.page_table
    q, k, v, k_cmp, v_cmp = step.q, *(as_sequences(x, table) for x in (step.k, step.v, step.k_cmp, step.v_cmp))
    _check(q, k, v, step.kv_lens)
    _check(q, k_cmp, v_cmp, step.kv_lens, ("k_cmp", "v_cmp"))
    pages, pages_meta = paging(table, step.k)
    q_lens = all_queries(q) if step.q_lens is None else step.q_lens.astype(jnp.int32)
    check(q_lens.shape == (q.shape[0],), "q_lens", f"shape [B] = ({q.shape[0]},)", tuple(q_lens.shape))
    if table is not None:
        check(table.ndim == 2 and table.shape[0] == q.shape[0], "page_table", f"shape [B, MP] with B = {q.shape[0]}",
              tuple(table.shape))
        check(step.k_cmp.shape[0] == step.k.shape[0] and step.k_cmp.shape[1] * int(compress_stride) == step.k.shape[1],
              "k_cmp", f"a pool of {step.k.shape[0]} pages of {step.k.shape[1]} // compress_stride = "
              f"{step.k.shape[1] // int(compress_stride)} rows (k's pages, compressed)", tuple(step.k_cmp.shape))
    B, TQ, HQ, _ = q.shape
    TK, NC, H, Dv = k.shape[1], k_cmp.shape[1], k.shape[2], v.shape[3]
    R = TQ * (HQ // H)
    kv_lens = step.kv_lens.astype(jnp.int32)
    W = min(int(window_size), TK)
    facts = device()
    cfg_c = default_config(Shapes.of(q, k_cmp, v_cmp, block_size=int(block_size)), q.dtype, facts)
    cfg_w = default_config(Shapes.of(q, k, v, window_size=W), q.dtype, facts) if W > 0 else cfg_c
    ns_w = cfg_w.splits if W > 0 else 0  # no window: no window programs, its (unread) partials of one split
    cmp_parts, win_parts = _partials(B, H, cfg_c.splits, R, Dv), _partials(B, H, max(1, ns_w), R, Dv)
    keep = keeps_logits(R, k_cmp.shape[3], q.dtype)
    logits = _launch.shape_dtype((B * H, R, NC) if keep else (1,), jnp.float32)
    acc_c, m_c, l_c, acc_w, m_w, l_w, logits = _launch.launch(
        _cmp_window_split_kernel, grid=(B * H, cfg_c.splits + ns_w),
        inputs=dict(Q=q, K=step.k, V=step.v, K_CMP=step.k_cmp, V_CMP=step.v_cmp, KV_LENS=kv_lens, Q_LENS=q_lens,
                    PAGES=pages),
        outputs={**{f"{name}_{branch}": shape for branch, parts in (("C", cmp_parts), ("W", win_parts))
                    for name, shape in parts.items()}, "LOGITS": logits},
        **dict(_meta(q, k, v, scale, cfg_c), num_warps=max(cfg_c.num_warps, cfg_w.num_warps),
               num_stages=min(cfg_c.num_stages, cfg_w.num_stages)),
        TK=TK, NC=NC, BLOCK_C=cfg_c.block_n, BLOCK_W=cfg_w.block_n, WINDOW=W, BS=int(compress_block_size),
        STRIDE=int(compress_stride), NS_C=cfg_c.splits, NS_W=ns_w, PAGE_C=pages_meta["PAGE"] // int(compress_stride),
        KEEP=keep, **pages_meta)
    idx = decode_select.forward(q, step.k_cmp, None, kv_lens, block_counts=block_counts, block_size=block_size,
                                scale=scale, lse_parts=(m_c, l_c), page_table=table, q_lens=q_lens,
                                logits=logits if keep else None)
    counts = jnp.full(idx.shape[:3], idx.shape[3], jnp.int32)  # every slot (unused ones are -1)
    inputs, cfg_s, meta = _selected_launch(q, step.k, step.v, idx, counts, kv_lens, block_size=block_size,
                                           scale=scale, config=None, page_table=table, q_lens=q_lens)
    gates = dict(G_CMP=step.g_cmp, G_SLC=step.g_slc, G_SWA=step.g_swa)
    nsp = {branch: triton.next_power_of_2(max(1, n)) for branch, n in zip("CSW", (cfg_c.splits, cfg_s.splits, ns_w))}
    cr, cd = min(FOLD_ROWS, pow2(R)), min(FOLD_COLS, pow2(Dv))
    _, _, _, _, o = _launch.launch(
        _selected_gated_kernel, grid=(B * H, cfg_s.splits),
        inputs=dict(inputs, ACC_C=acc_c, M_C=m_c, L_C=l_c, ACC_W=acc_w, M_W=m_w, L_W=l_w,
                    **{name: jnp.zeros((1,), q.dtype) if g is None else g for name, g in gates.items()}),
        outputs=dict(**{f"{name}_S": shape for name, shape in _partials(B, H, cfg_s.splits, R, Dv).items()},
                     DONE=_launch.shape_dtype((B * H,), jnp.int32), O=_launch.shape_dtype((B, TQ, HQ, Dv), q.dtype)),
        zeroed=("DONE",), **meta, NS_C=cfg_c.splits, NS_S=cfg_s.splits, NS_W=ns_w, CR=cr, CD=cd,
        **{f"NSP_{b}": n for b, n in nsp.items()}, **{f"CS_{b}": min(FOLD_SPLITS, n) for b, n in nsp.items()},
        GATED_C=step.g_cmp is not None, GATED_S=step.g_slc is not None, GATED_W=step.g_swa is not None)
    return o
