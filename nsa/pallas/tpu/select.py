"""Block selection (`select_blocks`) as one Pallas TPU (Mosaic) kernel: compressed-attention scores fused
with top-k.

The contract is nsa.reference.select's. Query t of KV head h, at in-sequence position p (t, or with a KV cache
kv_lens[b] - T + t: the queries are the last T tokens of batch row b's sequence), sees the compressed rows
first <= r < first + (p + 1) // block_size of k_cmp (first = its sequence's cmp_start, 0 with a cache; none
past row NC - 1); each of its G = HQ / H query heads takes the softmax p_g(r) of scale * q_g . k_cmp[r] over
them, and block c (row first + c) scores mean_g p_g(first + c) (0 for a row it does not see). Blocks 0,
p // bs - 1 and p // bs are forced (ranks FIRST, PREVIOUS, CURRENT of nsa.reference.select, above any score),
blocks after p // bs are never candidates; the block_counts best are kept in rank order, ties going to the
lower block id, unused slots -1. ../gpu/select.py and nsa/triton/select.py are GPU versions of the same
op. With compression windows of l tokens every d that are not the selection blocks of l' (Eq. 9), a token sees
the rows of its complete windows (`nsa._varlen.complete_rows`), the last walk stores each row's score instead
of its rank, and the last step turns the scores into the ranks of the blocks they name (`_eq9_ranks`: row
first + (l' / d) * j names block j; lane rolls across neighbouring chunks), which the top-k then reads.

Layouts. The kernel reads q as a [B, T, HQ * Dp] view and k_cmp as a [B, R, H * Dp] view (Dp = Dk padded to a
multiple of 128 lanes inside the op, T padded to a multiple of TB, R = the rows any token's current block may
name, padded to a multiple of BC with zero rows), so the block (1, TB, G * Dp) at column h holds the G query
heads of KV head h side by side (head g at lanes [g * Dp, (g + 1) * Dp): a static, aligned slice) and
(1, BC, Dp) at column h is one chunk of that head's compressed rows, with no transpose. Per token, int32
[1 or B, 3, T, 1] (per batch row with kv_lens): its first row, its end of visible rows and the row of its
current block (padded tokens: 0, 0, -1, no candidates), each read as a [TB, 1] column. A cache's rows past a
token's visible ones (incomplete blocks, rows never written: anything, NaN included) only ever enter logits
that the visibility mask replaces by -inf before any arithmetic, so they reach no result. lse travels as
[B, H, T, G] float32 (a (TB, G) block: its minor dim is the whole dim); head g's column, like m's and l's, is
picked by a masked lane reduction rather than an unaligned lane slice. The ids are written as [B, H, T, S]
int32 (S = min(block_counts, NB) slots, NB = cdiv(T, bs), or with kv_lens max(cdiv(T, bs), NC), as the
reference's: no token has more candidates), returned as [B, T, H, block_counts] with -1 in the slots past S.

Grid: (B, H, T / TB, PASSES * STEPS). One program owns the TB tokens of one token tile and one KV head, with
their G query heads, and walks the chunks of BC compressed rows its tokens may name, from the first to the
last (both scalar-prefetched into SMEM per token tile, and per batch row with kv_lens, as one flat int32
array: `nsa._plan.bands`; a step past the last re-maps to it, so no new DMA is issued, and is
skipped). Without lse (PASSES = 2) the first walk computes each query row's softmax maximum and sum online, in
the (TB, G) float32 scratch m and l; the last walk (the only one when lse is given) recomputes the logits of
each head, turns them into probabilities, averages them over the G heads and stores the chunk's ranks (forced
ranks, scores, -inf for non-candidates) in the float32 scratch [R / BC, TB, BC]: the [T, R] scores never reach
HBM. Everything is float32 whatever the input dtype.

Top-k (the last step; Mosaic has no sort): S rounds, each one walk over the tile's chunks of that scratch that
removes the previous round's pick (-inf) and keeps, lane by lane, the best rank and the lowest row holding it,
then two lane reductions: each token's maximum rank and the lowest row holding it (ties to the lower id); a
token whose maximum is -inf has no candidate left and gets -1. The reductions are float ones (row ids exact
below 2^24 rows).

Tiles: `Config` (TB tokens, BC compressed rows per step), `default_config`'s unless given.

VMEM per step (`vmem_bytes`; the pipeline double-buffers each block): q (TB, G * Dp) and k_cmp (BC, Dp) in
the input dtype, the token rows (3, TB, 1), lse (TB, G) and the ids (TB, S) (each padded to 128 lanes), plus
the float32 scratch: ranks [R / BC, TB, BC] and m, l (TB, G). `default_config` halves TB until that is
within `vmem_budget` (three quarters of the device's scoped VMEM limit: 12 MiB of Mosaic's default 16 MiB):
at the standard shape (T = 8192, block_size 64, G = 16, TB = 128) it is 1.9 MiB in bfloat16 at Dk = 128 and
5.1 MiB in float32 at Dk = 256. The ranks grow with R (T / block_size, or a cache's NC): TB = 128 holds R up
to about 16k rows in 8 MiB.
"""

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nsa._config import Shapes, expect, positive, validated
from nsa._device import facts
from nsa._plan import band, bands, blocks_of, num_candidates, one_row_per_block
from nsa._varlen import cdiv, complete_rows, num_compressed_blocks, round_up, tokens
from nsa.pallas._batch import per_sequence
from nsa.pallas.tpu._common import batch_row, clamped, dot, lane_padded, lanes, out_struct, sublanes, view
from nsa.reference.select import CURRENT, FIRST, PREVIOUS, overlaps

MAX_TOKENS = 128  # TB at most: 128 rows fill the MXU's M and make a chunk's ranks (TB, 128) 16 vregs


@validated
class Config(NamedTuple):
    """The tiles: TB tokens per program (a multiple of the sublane tile: 8, 16 for 2-byte inputs), BC
    compressed rows per step (a multiple of the lanes, 128)."""

    tokens: int
    chunk: int

    def check(self):
        positive(self, "tokens", "chunk")
        expect(self.tokens % facts("tpu").sublanes == 0, self, "tokens", "a positive multiple of the sublanes (8)")
        expect(self.chunk % lanes() == 0, self, "chunk", f"a positive multiple of {lanes()}")


def vmem_budget(device):
    """The VMEM `default_config` lets one grid step hold: three quarters of the device's scoped limit, the rest
    left to Mosaic's own temporaries (12 MiB of the default 16 MiB)."""
    return device.scoped_vmem * 12 // 16


def _slots(T, NC, block_counts, block_size, kv_lens, stride):
    """S: the slots the kernel fills, as many as a token may have candidates (`nsa._plan.num_candidates`)."""
    return min(block_counts, num_candidates(T, NC, block_size, kv_lens, stride))


def _num_rows(T, NC, stride, cu_seqlens):
    """R: the rows of k_cmp (one every `stride` tokens) a token may see or name as its current block (rows past
    NC score 0; a cache's k_cmp covers its sequences: kv_lens <= NC * stride)."""
    return max(NC, num_compressed_blocks(T, stride, cu_seqlens), 1)


def vmem_bytes(G, dk, itemsize, num_rows, slots, config):
    """The VMEM one grid step holds: every block double-buffered (int32 and float32 blocks padded to the
    lanes), plus the float32 scratch (ranks of every chunk of `num_rows` rows, m and l)."""
    tb, bc = config
    lane = lanes()
    dkp = lane_padded(dk)
    padded_lanes = lambda n: round_up(n, lane)
    blocks = (tb * G * dkp + bc * dkp) * itemsize + tb * (3 * lane + padded_lanes(G) + padded_lanes(slots)) * 4
    return 2 * blocks + (round_up(num_rows, bc) * tb + 2 * tb * padded_lanes(G)) * 4


def default_config(shapes: Shapes, dtype, device) -> Config:
    """The Config of a call of `shapes` (TK: R, the rows of k_cmp a token may see or name, `_num_rows`) in
    `dtype` on `device`.

    BC = the lanes (128): one chunk's ranks (TB, 128) are lane-dense and its logits one MXU pass of N = 128. TB =
    MAX_TOKENS (no more than T, rounded up to the dtype's sublanes), halved while a step would hold more than
    `vmem_budget` (`vmem_bytes`: wide heads of a large group, or many compressed rows), down to the sublanes.
    On a TPU v5e (2026-12-07, scripts/tpu_select_probe.py, TB = 128) BC = 128 was the fastest: 2.95 / 3.73 ms at 8k
    (blocks 64/64, the paper's 32/16), 30.76 / 81.53 at 64k; BC = 256 took 3.43 / 4.10 and 33.55 / 82.98, BC = 512
    5.06 / 5.51 and 42.55 / 89.98 (a wider chunk's top-k walk keeps more vregs than the register file holds).
    """
    rows = shapes.TK
    # the slots a token may fill (`_slots`): cdiv(T, bs), or with a KV cache up to NC; Shapes does not say whether
    # there is one, so the larger bounds it (the same lanes, hence the same tiles, for block_counts up to 128)
    slots = min(shapes.block_counts, max(cdiv(shapes.T, shapes.block_size), rows))
    sub = sublanes(dtype)
    lane = lanes()
    tb = min(MAX_TOKENS, round_up(shapes.T, sub))
    while tb > sub and vmem_bytes(shapes.G, shapes.Dk, jnp.dtype(dtype).itemsize, rows, slots, Config(tb, lane)) \
            > vmem_budget(device):
        tb = max(sub, round_up(tb // 2, sub))
    return Config(tb, lane)


def _config(config, q, k_cmp, cu_seqlens, *, block_counts, block_size, stride):
    """config (its tokens checked against q's dtype), or the default_config of q [B, T, HQ, Dk] against k_cmp
    [B, NC, H, Dk] (B may be symbolic; one row every `stride` tokens)."""
    if config is None:
        T = q.shape[1]
        rows = _num_rows(T, k_cmp.shape[1], stride, cu_seqlens)
        shapes = Shapes(q.shape[0], T, rows, q.shape[2], k_cmp.shape[2], q.shape[3], q.shape[3],
                        block_size=block_size, block_counts=block_counts)
        return default_config(shapes, q.dtype, facts("tpu"))
    sub = sublanes(q.dtype)
    if config.tokens % sub:
        raise ValueError(f"config.tokens: expected a positive multiple of {sub} for {q.dtype}, got {config.tokens}")
    return config


# ------------------------------------------------------------------------------------------ kernel


def _logits(q_ref, k, g, visible, *, scale, dkp, precision):
    """scale * q_g . k [TB, BC] float32 of head g against the chunk k [BC, Dp]; -inf where not visible."""
    q = q_ref[0, :, g * dkp:(g + 1) * dkp]
    if q.dtype == jnp.float16:  # the MXU takes no float16: float32 is exact for it
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    return jnp.where(visible, dot(q, k, precision, transpose_b=True) * scale, -jnp.inf)


def _pick(x, g):
    """Column g [TB, 1] of x [TB, G] float32, by a masked lane reduction (no unaligned lane slice)."""
    return jnp.max(jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, 1) == g, x, -jnp.inf), axis=1, keepdims=True)


def _online_softmax(q_ref, k, visible, m_scr, l_scr, **kw):
    """The first pass: folds the chunk into each query row's running maximum m and sum l, (TB, G)."""
    m_all, l_all = m_scr[...], l_scr[...]
    head = lax.broadcasted_iota(jnp.int32, m_all.shape, 1)
    for g in range(m_all.shape[1]):
        s = _logits(q_ref, k, g, visible, **kw)
        m_prev = _pick(m_all, g)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet: no NaN
        l_new = _pick(l_all, g) * jnp.exp(m_prev - m_use) + jnp.sum(jnp.exp(s - m_use), axis=1, keepdims=True)
        m_all, l_all = jnp.where(head == g, m_new, m_all), jnp.where(head == g, l_new, l_all)
    m_scr[...], l_scr[...] = m_all, l_all


def _chunk_scores(q_ref, k, visible, lse_ref, m_scr, l_scr, **kw):
    """The mean over the G heads of the probabilities [TB, BC] of the chunk's rows: exp(s - lse) with a given
    lse (as nsa.reference.compressed.probabilities), else exp(s - m) / l (as its softmax); 0 where a row is
    not visible or a query sees nothing."""
    G = m_scr.shape[1]
    m_all, l_all = m_scr[...], l_scr[...]
    lse_all = None if lse_ref is None else lse_ref[0, 0]
    total = None
    for g in range(G):
        s = _logits(q_ref, k, g, visible, **kw)
        if lse_ref is None:
            m, l = _pick(m_all, g), _pick(l_all, g)
            seen = l > 0
            p = jnp.exp(s - jnp.where(seen, m, 0.0)) / jnp.where(seen, l, 1.0)
        else:
            lse = _pick(lse_all, g)
            seen = lse > -jnp.inf
            p = jnp.exp(s - jnp.where(seen, lse, 0.0))
        p = jnp.where(visible & seen, p, 0.0)
        total = p if total is None else total + p
    return total / G


def _ranks(score, row, first, cur):
    """nsa.reference.select.block_ranks on global rows [TB, BC]: the forced ranks on rows first, cur - 1 and
    cur (in its order), the scores elsewhere, -inf outside the candidates first <= row <= cur."""
    rank = jnp.where(row == first, FIRST, score)
    rank = jnp.where(row == cur - 1, PREVIOUS, rank)
    rank = jnp.where(row == cur, CURRENT, rank)
    return jnp.where((row >= first) & (row <= cur), rank, -jnp.inf)


def _eq9_ranks(rank_scr, lo, hi, first, cur, *, blocks):
    """Overwrites the row scores of the chunks lo..hi of rank_scr [R / BC, TB, BC] (mean_g p_g(r), 0 where not
    seen) with the ranks of the selection blocks they name (Eq. 9, as nsa.reference.select's `block_scores`):
    in-sequence row UB * j names block j and ranks it by sum_o count(o) * score[row + o] (o ascending, from
    -(UR - 1) to UB - 1, `overlaps`), with the forced ranks on block 0 (row first), cur - 1 (row cur - UB) and
    cur (row cur, first + UB * (p // l')); every other row ranks -inf. A row's neighbours o lanes away come from
    the chunk itself or the one before or after it (lane rolls; chunks outside lo..hi read as 0: no token sees
    their rows). blocks: (l', l, d)."""
    block_size, _, stride = blocks
    per_block = block_size // stride
    tb, bc = rank_scr.shape[1], rank_scr.shape[2]
    lane = lax.broadcasted_iota(jnp.int32, (tb, bc), 1)
    raw = lambda c: jnp.where((c >= lo) & (c <= hi), rank_scr[jnp.clip(c, 0, rank_scr.shape[0] - 1)], 0.0)

    def convert(c, carry):
        before, this = carry
        after = raw(c + 1)
        total = None
        for o, count in overlaps(*blocks).items():
            if o == 0:
                term = this
            else:
                beyond = (lane + o >= bc) if o > 0 else (lane + o < 0)  # the lanes of the next (previous) chunk
                shift = (-o) % bc  # roll: lane i takes lane i + o
                term = jnp.where(beyond, pltpu.roll(after if o > 0 else before, shift, 1), pltpu.roll(this, shift, 1))
            term = term if count == 1 else count * term
            total = term if total is None else total + term
        rel = (c * bc + lane - first).astype(jnp.float32)  # the in-sequence row, exact below 2^24
        named = (rel >= 0) & (jnp.floor(rel / per_block) * per_block == rel)
        row = c * bc + lane
        rank = jnp.where(row == first, FIRST, total)
        rank = jnp.where(row == cur - per_block, PREVIOUS, rank)
        rank = jnp.where(row == cur, CURRENT, rank)
        rank_scr[c] = jnp.where(named & (row <= cur), rank, -jnp.inf)
        return this, after

    lax.fori_loop(lo, hi + 1, convert, (raw(lo - 1), raw(lo)))


def _top_k(rank_scr, lo, hi, first, slots, per_block=1):
    """ids int32 [TB, slots]: in rank order, each token's best in-sequence blocks among the ranks of the chunks
    lo..hi of rank_scr [R / BC, TB, BC] (ties to the lower row; block (row - first) / per_block), -1 once none is
    left. Consumes rank_scr.

    One walk over the chunks per slot: it removes the last pick (-inf) and keeps, lane by lane, the best rank seen
    and the lowest row holding it ([TB, BC]: a strict > keeps the earlier chunk's row, chunks ascend), elementwise
    on the VPU; two lane reductions per slot then give the token's best rank and the lowest row at it."""
    tb, bc = rank_scr.shape[1], rank_scr.shape[2]
    lane = lax.broadcasted_iota(jnp.int32, (tb, bc), 1)
    slot = lax.broadcasted_iota(jnp.int32, (tb, slots), 1)
    none = jnp.iinfo(jnp.int32).max

    def one_round(r, carry):
        ids, taken = carry  # taken [TB, 1]: the row the last round picked (-1: none)

        def remove_and_keep(c, kept):
            value, at = kept
            row = c * bc + lane
            x = jnp.where(row == taken, -jnp.inf, rank_scr[c])
            rank_scr[c] = x
            better = x > value
            return jnp.where(better, x, value), jnp.where(better, row, at)

        init = (jnp.full((tb, bc), -jnp.inf, jnp.float32), jnp.full((tb, bc), none, jnp.int32))
        value, at = lax.fori_loop(lo, hi + 1, remove_and_keep, init)
        best = jnp.max(value, axis=1, keepdims=True)
        # the lowest row at the best rank, as a float reduction (rows exact below 2^24)
        low = jnp.min(jnp.where(value == best, at.astype(jnp.float32), jnp.inf), axis=1, keepdims=True)
        found = best > -jnp.inf
        block = low.astype(jnp.int32) - first
        if per_block > 1:  # rows first + per_block * j name the blocks (`_eq9_ranks`): an exact float division
            block = ((low - first.astype(jnp.float32)) / per_block).astype(jnp.int32)
        ids = jnp.where(slot == r, jnp.where(found, block, -1), ids)
        return ids, jnp.where(found, low.astype(jnp.int32), -1)

    init = (jnp.full((tb, slots), -1, jnp.int32), jnp.full((tb, 1), -1, jnp.int32))
    return lax.fori_loop(0, slots, one_round, init)[0]


def _kernel(band_ref, rows_ref, q_ref, k_ref, *refs, scale, dkp, steps, has_lse, per_row, precision, blocks):
    """One step: chunk band[i] + j % STEPS of pass j // STEPS (see the module docstring)."""
    lse_ref = refs[0] if has_lse else None
    out_ref, rank_scr, m_scr, l_scr = refs[1:] if has_lse else refs
    i, j = pl.program_id(2), pl.program_id(3)
    last_pass = 0 if has_lse else 1
    lo, hi = band(band_ref, batch_row(pl.program_id(0), per_row), i, pl.num_programs(2))
    chunk = lo + lax.rem(j, steps)
    tb, bc = rank_scr.shape[1], rank_scr.shape[2]
    first, end, cur = rows_ref[0], rows_ref[1], rows_ref[2]  # [TB, 1] each
    row = chunk * bc + lax.broadcasted_iota(jnp.int32, (tb, bc), 1)
    visible = (row >= first) & (row < end)
    kw = dict(scale=scale, dkp=dkp, precision=precision)

    if not has_lse:
        @pl.when(j == 0)
        def _init():
            m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
            l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)

        @pl.when((j < steps) & (chunk <= hi))
        def _first_pass():
            _online_softmax(q_ref, k_ref[0], visible, m_scr, l_scr, **kw)

    @pl.when((lax.div(j, steps) == last_pass) & (chunk <= hi))
    def _score():
        score = _chunk_scores(q_ref, k_ref[0], visible, lse_ref, m_scr, l_scr, **kw)
        if one_row_per_block(*blocks):
            rank_scr[chunk] = _ranks(score, row, first, cur)
        else:  # the rows' scores, turned into the blocks' ranks once every chunk is scored
            rank_scr[chunk] = score

    @pl.when(j == pl.num_programs(3) - 1)
    def _select():
        if not one_row_per_block(*blocks):
            _eq9_ranks(rank_scr, lo, hi, first, cur, blocks=blocks)
        out_ref[0, 0] = _top_k(rank_scr, lo, hi, first, out_ref.shape[3], blocks[0] // blocks[2])


# ------------------------------------------------------------------------------------------ wrapper


def _token_rows(T, tp, NC, blocks, cu_seqlens, kv_lens):
    """int32 [R, 3, tp, 1] (R = B with kv_lens, else 1: shared by the batch): per token its first row of
    k_cmp, the end of its visible rows (at most NC) and the row naming its current block (first + l' / d *
    (p // l')); padded tokens 0, 0, -1 (no candidates). blocks: (l', l, d)."""
    block_size, window, stride = blocks
    tok = tokens(T, stride, cu_seqlens, kv_lens)
    first, pos = tok.cmp_start, tok.pos  # [R, T]
    end = jnp.minimum(first + complete_rows(pos, window, stride), NC)
    current = first + pos // block_size if stride == block_size else first + block_size // stride * (pos // block_size)
    rows = jnp.stack([first, end, current], axis=1).astype(jnp.int32)  # [R, 3, T]
    padding = jnp.broadcast_to(jnp.array([[0], [0], [-1]], jnp.int32), (rows.shape[0], 3, tp - T))
    return jnp.concatenate([rows, padding], axis=2)[..., None]


def forward(q, k_cmp, lse, cu_seqlens, kv_lens=None, **static):
    """Returns block_indices int32 [B, T, H, block_counts] (in-sequence block ids), as the reference.

    q [B, T, HQ, Dk], k_cmp [B, NC, H, Dk]; lse [B, T, HQ] float32 is compressed attention's log-sum-exp of
    the same q and k_cmp (it saves the kernel its first pass), or None; cu_seqlens None or int32 [N + 1]
    (packed sequences, B = 1); kv_lens None or int32 [B] (the queries are the last T tokens of sequences of
    kv_lens[b] tokens, which k_cmp covers). Keywords: block_counts, block_size, scale, compress_block_size and
    compress_stride (None: block_size; windows other than the selection blocks: Eq. 9, `_eq9_ranks`); interpret (a
    pltpu.InterpretParams to run in Pallas's TPU interpret mode on any platform, or False) and config (a Config;
    None: `default_config`). With kv_lens the token rows are per batch row, a [B * ...] table in SMEM: a symbolic
    batch then runs once per sequence (`per_sequence`).
    """
    run = _forward if kv_lens is None else per_sequence(_forward)
    return run(q, k_cmp, lse, cu_seqlens, kv_lens, **static)


def _forward(q, k_cmp, lse, cu_seqlens, kv_lens, *, block_counts, block_size, scale, compress_block_size=None,
             compress_stride=None, interpret=False, config=None):
    blocks = blocks_of(block_size, compress_block_size, compress_stride)
    _, compress_block_size, compress_stride = blocks
    B, T, HQ, Dk = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    G = HQ // H
    slots = _slots(T, NC, block_counts, block_size, kv_lens, compress_stride)
    if B * T * slots == 0:
        return jnp.full((B, T, H, block_counts), -1, jnp.int32)
    config = _config(config, q, k_cmp, cu_seqlens, block_counts=block_counts, block_size=block_size,
                     stride=compress_stride)
    tb, bc = config
    tp, dkp = round_up(T, tb), lane_padded(Dk)
    rp = round_up(_num_rows(T, NC, compress_stride, cu_seqlens), bc)
    nt, steps = tp // tb, rp // bc
    rows = _token_rows(T, tp, NC, blocks, cu_seqlens, kv_lens)
    last = rows[:, 2, :, 0]  # with Eq. 9 the current block's score needs the rows after its own (`_eq9_ranks`)
    if not one_row_per_block(*blocks):
        last = jnp.where(last >= 0, last + block_size // compress_stride - 1, -1)
    table = jnp.minimum(bands(rows[:, 0, :, 0], last, nt, bc), steps - 1)  # first, last chunk per tile
    passes = 1 if lse is not None else 2
    per_row = kv_lens is not None

    def chunk_map(b, h, i, j, table):  # the clamped chunk: a skipped step re-maps to the last one
        return b, clamped(*band(table, batch_row(b, per_row), i, nt), lax.rem(j, steps)), h

    tile_map = lambda b, h, i, j, table: (b, h, i, 0)
    in_specs = [pl.BlockSpec((None, 3, tb, 1), lambda b, h, i, j, table: (batch_row(b, per_row), 0, i, 0)),
                pl.BlockSpec((1, tb, G * dkp), lambda b, h, i, j, table: (b, i, h)),
                pl.BlockSpec((1, bc, dkp), chunk_map)]
    args = [table, rows, view(q, tp, dkp), view(k_cmp, rp, dkp)]
    if lse is not None:
        in_specs.append(pl.BlockSpec((1, 1, tb, G), tile_map))
        lse_by_head = jnp.transpose(lse.astype(jnp.float32).reshape(B, T, H, G), (0, 2, 1, 3))
        args.append(jnp.pad(lse_by_head, [(0, 0), (0, 0), (0, tp - T), (0, 0)]))
    kernel = functools.partial(_kernel, scale=float(scale), dkp=dkp, steps=steps, has_lse=lse is not None,
                               per_row=per_row, blocks=blocks,
                               precision=lax.Precision.HIGHEST if q.dtype != jnp.bfloat16 else None)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B, H, nt, passes * steps), in_specs=in_specs,
            out_specs=pl.BlockSpec((1, 1, tb, slots), tile_map),
            scratch_shapes=[pltpu.VMEM((steps, tb, bc), jnp.float32), pltpu.VMEM((tb, G), jnp.float32),
                            pltpu.VMEM((tb, G), jnp.float32)]),
        out_shape=out_struct((B, H, tp, slots), jnp.int32, q),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret, name="select",
    )(*args)
    idx = jnp.transpose(out[:, :, :T], (0, 2, 1, 3))
    return jnp.pad(idx, [(0, 0)] * 3 + [(0, block_counts - slots)], constant_values=-1)
