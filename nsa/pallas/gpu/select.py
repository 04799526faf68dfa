"""Block selection (`select_blocks`) for NVIDIA GPUs (sm90, H100 / H200) as two Pallas Mosaic GPU kernels: the
compressed-attention scores (`scores`), then the top-k of their ranks (`top_k`), with the ranks built in XLA
between them.

The contract is nsa.reference.select's (../tpu/select.py is the TPU version of the same op, with the
details spelled out). Query t of KV head h, at in-sequence position p (t, or with a KV cache kv_lens[b] - T + t),
sees the compressed rows first <= r < end = min(first + n, NC) of k_cmp (first = its sequence's cmp_start, 0
with a cache; n its complete windows, `nsa._varlen.complete_rows`: (p + 1) // l when the windows of l =
compress_block_size tokens every d = compress_stride do not overlap); each of its G = HQ / H query heads takes
the softmax p_g(r) = exp(scale * q_g . k_cmp[r] - lse_g) over them, and the kernel stores each row's
mean_g p_g(r) (0 for a row it does not see). In XLA, selection block j of l' = block_size tokens then scores the
rows it overlaps (Eq. 9, the reference's `block_scores`; with l = d = l', row first + j alone). Blocks 0,
p // l' - 1 and p // l' are forced, blocks after p // l' are never candidates, the block_counts best are kept in
rank order, ties to the lower block id, unused slots -1: the ranks are the reference's own `block_ranks` (XLA, on
the kernel's scores), and `top_k` picks from them exactly what the reference's `top_blocks` (lax.top_k) would.

Grid: (NT, B * H), one warpgroup (128 threads) per program. Tile: 64 rows, wgmma's M: TB = 64 // GR tokens
x GR head slots (GR = G rounded up to a multiple of 8, G <= 64; row j * GR + g is token i * TB + j, head g;
the 64 - TB * GR rows past them, when GR does not divide 64, are unused). Each program
- copies its TB tokens' query heads with one TMA copy each, q[b, t, h] [GR, Dp] -> rows j * GR.. of the
  SMEM tile [64, Dp] (a token past T copies token T - 1: it is never written out);
- copies its rows' visible range (first, end) [2, 64] int32 and, when lse is given, its rows' lse [64]
  float32 (TMA), read as per-row vectors of the wgmma layout;
- walks the chunks of BC = 64 compressed rows of k_cmp[b, :, h] that any of its rows sees (`_chunk_bands`:
  about half of them, causally; TMA, one chunk at a time):
  s = q k^T [64, 64] (wgmma, float32 accumulation), then logits scale * s where the row sees the key and
  -inf elsewhere (a jnp.where ahead of any other arithmetic: a cache's rows that no token sees may hold NaN,
  and their column of s is dropped before it reaches a max, a sum or an exp);
- without lse, a first walk folds each row's logits into its running max m and sum l (online softmax), and
  p = exp(s - m) / l as the reference's softmax; with lse, p = exp(s - lse) as its `probabilities`;
- stores p [64, 64] float32 to SMEM and sums each token's G head rows back from it, one row at a time in
  float32 (exact adds, not a matmul: wgmma on float32 is TF32), divided by G: the token's score of each of
  the chunk's 64 rows, [TB, 64], written to scores[b, h, i * TB : (i + 1) * TB, chunk] by TMA.

Layouts. q [B, T, HQ, Dk] goes in as its [B, T, H, GR, Dp] view, padded in XLA (zero head slots, zero columns)
only when GR != G or Dk is not a multiple of 64 (Dp = Dk rounded up to 64: the 128-byte swizzle of the SMEM
operands); k_cmp as [B, NCP, H, Dp] (NCP = NC rounded up to 64; zero rows and columns, only where needed: a TMA
copy into a tiled SMEM operand takes the array's rows in whole tiles of 8, and no chunk then reads past the
array; the zero rows are no token's visible rows). Per tile row, int32 [R, NT, 2, 64] (R = B with kv_lens, else
1): first and end (0, 0, no visible row, for padded head slots, tokens past T and unused rows: their
probabilities are 0 and no token's score reads them); lse as [B, H, NT, 64] float32 (0 in those rows).

Memory: the output scores [B, H, TP, NCP] float32 (TP = NT * TB) is B * H * TP * NCP * 4 bytes, about
B * H * T * NC * 4: 16 MiB at the standard shape (B = 1, T = 8192, H = 4, bs = 64: NC = 128 rows). XLA then
builds the [B, T, H, NB] ranks from a transposed copy (NB = cdiv(T, bs), or with kv_lens max(cdiv(T, bs), NC)),
which `top_k` reads once: a few times that in all, growing as T^2 / bs (1 GiB of scores at T = 64k). The top-k
is its own kernel rather than XLA's lax.top_k, which took most of select's time at T = 64k on the H200; the
kernel, its share and that of the scores and XLA's ranks: benchmarks/results/trace-65536-pallas.json. Fusing the
top-k into the scores kernel would also keep the scores on chip.

SMEM per program: q [64, Dp] and one chunk of k_cmp [64, Dp] in the input dtype, p [64, 64] and the scores
[TB, 64] float32, the row ranges and lse: about 50 KiB at Dp = 128. Every copy is waited for before its use (no
pipelining yet: exactness first). Dtypes: bfloat16 and float16 (the wgmma operands; float32 would run as TF32).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nsa._config import Shapes, expect, validated
from nsa._device import facts
from nsa._plan import blocks_of, num_candidates
from nsa._varlen import cdiv, complete_rows, round_up, tokens
from nsa.pallas._batch import per_sequence
from nsa.pallas.gpu._common import by_row, call, check_dtype, iota, matmul, padded_dim, pipelined, smem_tile
from nsa.reference.select import block_ranks, block_scores, top_blocks

ROWS = 64  # the tile: wgmma's M
CHUNK = ROWS  # BC: compressed rows per step (wgmma's N): a row of a chunk's p is read as a per-row vector of a tile
TOP_ROWS = 64  # rows (token, KV head) per top-k program: the wgmma layout's tile


@validated
class Config(NamedTuple):
    """The top-k kernel's ranks per step: a [64, top_chunk] float32 tile (32 KiB of shared memory per buffer at
    128, two buffers)."""

    top_chunk: int = 128

    def check(self):
        expect(self.top_chunk > 0 and self.top_chunk % 64 == 0, self, "top_chunk", "a positive multiple of 64")


def default_config(shapes: Shapes, dtype, device) -> Config:
    """The Config of q [B, T, HQ, Dk] against k_cmp [B, NC, H, Dk] (`Shapes.of(q, k_cmp, block_size=...,
    block_counts=...)`) in `dtype` on `device`: Config()'s chunks of 128 ranks at every shape, those of the recorded
    H200 run (select's kernels at T = 65536: benchmarks/results/trace-65536-pallas.json)."""
    del shapes, dtype, device
    return Config()


def _head_slots(G):
    """GR: the G query heads of a KV head rounded up to a multiple of 8 rows (TMA copies whole SMEM tiles)."""
    return round_up(G, 8)


def _check(q, k_cmp):
    B, T, HQ, Dk = q.shape
    if k_cmp.ndim != 4 or k_cmp.shape[0] != B or k_cmp.shape[3] != Dk:
        raise ValueError(f"k_cmp: expected [B={B}, NC, H, Dk={Dk}], got {k_cmp.shape}")
    H = k_cmp.shape[2]
    if H == 0 or HQ % H:
        raise ValueError(f"k_cmp: expected KV heads H dividing q's {HQ} query heads, got H = {H}")
    if HQ // H > ROWS:
        raise ValueError(f"q: expected at most {ROWS} query heads per KV head (the Mosaic GPU kernel's one 64-row "
                         f"tile), got G = HQ / H = {HQ // H}")
    for name, x in (("q", q), ("k_cmp", k_cmp)):
        check_dtype(x.dtype, name)
    if k_cmp.dtype != q.dtype:
        raise TypeError(f"k_cmp: expected q's dtype {q.dtype}, got {k_cmp.dtype}")


# ------------------------------------------------------------------------------------------ XLA side


def _row_ranges(T, NC, G, window, stride, cu_seqlens, kv_lens):
    """int32 [R, NT, 2, 64]: per tile row (token j * GR + g) its visible compressed rows [first, end); 0, 0
    (none) for head slots g >= G, tokens past T and the rows past TB * GR."""
    GR = _head_slots(G)
    TB = ROWS // GR
    NT = cdiv(T, TB)
    tok = tokens(T, stride, cu_seqlens, kv_lens)
    first = tok.cmp_start
    end = jnp.minimum(first + complete_rows(tok.pos, window, stride), NC)
    ranges = jnp.stack([first, end], axis=-1).astype(jnp.int32)  # [R, T, 2]
    ranges = jnp.pad(ranges, [(0, 0), (0, NT * TB - T), (0, 0)])  # padded tokens: 0, 0
    R = ranges.shape[0]
    slots = jnp.arange(GR) < G
    per_row = jnp.where(slots[None, None, :, None], ranges[:, :, None, :], 0)  # [R, NT * TB, GR, 2]
    per_row = per_row.reshape(R, NT, TB * GR, 2)
    per_row = jnp.pad(per_row, [(0, 0), (0, 0), (0, ROWS - TB * GR), (0, 0)])
    return jnp.swapaxes(per_row, 2, 3)


def _chunk_bands(ranges):
    """int32 [R, NT, 2]: the first and last chunk of BC rows of k_cmp that any row of each tile sees (from
    `_row_ranges`); 0, -1 (none) for a tile that sees nothing. A program walks only those chunks: the scores of
    the others are never written, and `forward` reads them as 0."""
    first, end = ranges[:, :, 0], ranges[:, :, 1]  # [R, NT, 64]
    seen = first < end
    lo = jnp.min(jnp.where(seen, first, jnp.iinfo(jnp.int32).max), axis=-1) // CHUNK
    hi = jnp.max(jnp.where(seen, end - 1, -1), axis=-1) // CHUNK
    any_seen = jnp.any(seen, axis=-1)
    return jnp.stack([jnp.where(any_seen, lo, 0), jnp.where(any_seen, hi, -1)], axis=-1).astype(jnp.int32)


def _lse_rows(lse, H, G):
    """lse [B, T, HQ] -> float32 [B, H, NT, 64] in the tile's rows (0 in the rows that are no query head's)."""
    B, T, _ = lse.shape
    GR = _head_slots(G)
    TB = ROWS // GR
    NT = cdiv(T, TB)
    x = lse.astype(jnp.float32).reshape(B, T, H, G)
    x = jnp.pad(x, [(0, 0), (0, NT * TB - T), (0, 0), (0, GR - G)])
    x = jnp.transpose(x, (0, 2, 1, 3)).reshape(B, H, NT, TB * GR)
    return jnp.pad(x, [(0, 0), (0, 0), (0, 0), (0, ROWS - TB * GR)])


def _padded_inputs(q, k_cmp, H):
    """q as [B, T, H, GR, Dp] and k_cmp as [B, NCP, H, Dp] (zero head slots, rows and columns, only where
    needed: the chunks' TMA copies then never leave the array)."""
    B, T, HQ, Dk = q.shape
    NC = k_cmp.shape[1]
    G = HQ // H
    GR, Dp, NCP = _head_slots(G), padded_dim(Dk, q.dtype), round_up(NC, CHUNK)
    q5 = q.reshape(B, T, H, G, Dk)
    if GR != G or Dp != Dk:
        q5 = jnp.pad(q5, [(0, 0)] * 3 + [(0, GR - G), (0, Dp - Dk)])
    if Dp != Dk or NCP != NC:
        k_cmp = jnp.pad(k_cmp, [(0, 0), (0, NCP - NC), (0, 0), (0, Dp - Dk)])
    return q5, k_cmp


def ranks_from_scores(by_row, cu_seqlens, kv_lens=None, *, num_blocks, block_size, compress_block_size=None,
                      compress_stride=None):
    """The ranks float32 [B, T, H, NB] of the in-sequence selection blocks (the reference's `block_ranks`) from the
    score of each row of k_cmp, by_row float32 [B, T, H, NC] (the mean over the G heads of p_g(r), 0 where the
    token does not see row r), mapped onto the blocks by the reference's `block_scores` (Eq. 9; with one row per
    block, in-sequence block c is row first + c; rows past NC score 0); compress_block_size and compress_stride None:
    block_size."""
    blocks = dict(zip(("block_size", "compress_block_size", "compress_stride"),
                      blocks_of(block_size, compress_block_size, compress_stride)))
    tok = tokens(by_row.shape[1], blocks["compress_stride"], cu_seqlens, kv_lens)
    by_block = block_scores(by_row, tok.cmp_start, num_blocks, **blocks)
    return block_ranks(by_block, tok.pos, block_size=block_size)


def indices_from_scores(by_row, cu_seqlens, kv_lens=None, *, block_counts, num_blocks, **blocks):
    """block_indices int32 [B, T, H, block_counts] from `ranks_from_scores`, picked by the reference's own
    `top_blocks` in XLA: what the top-k kernel (`top_k`) must reproduce exactly."""
    ranks = ranks_from_scores(by_row, cu_seqlens, kv_lens, num_blocks=num_blocks, **blocks)
    return top_blocks(ranks, block_counts)


# ------------------------------------------------------------------------------------------ kernel


def _row_vector(ref):
    """A [64] SMEM vector as one value per tile row (the wgmma accumulator's row layout)."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def _by_row(x):
    """A per-row vector [64] broadcast over the chunk's columns: [64, BC]."""
    return by_row(x, (ROWS, CHUNK))


def _logits(q_smem, k_smem, k_ref, barrier, b, h, chunk, first, end, *, scale):
    """The chunk's masked logits [64, BC] float32 (-inf where a row does not see the key) and the mask."""
    x = pl.multiple_of(chunk * CHUNK, CHUNK)
    plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(x, CHUNK), h], k_smem, barrier)
    plgpu.barrier_wait(barrier)
    s = matmul(q_smem, k_smem.transpose((1, 0)), (ROWS, CHUNK))
    key = x + iota((ROWS, CHUNK), 1)
    visible = (key >= _by_row(first)) & (key < _by_row(end))
    return jnp.where(visible, s * scale, -jnp.inf), visible


def _online_softmax(logits, first_chunk, last_chunk):
    """The first walk: each row's max m and sum l of exp(s - m) over the tile's chunks (m = 0, l = 0 where a
    row sees nothing)."""
    def step(chunk, carry):
        m, l = carry
        s, _ = logits(chunk)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet: no NaN
        l = l * jnp.exp(m - m_use) + jnp.exp(s - _by_row(m_use)).sum(axis=1)
        return m_new, l

    row = lambda v: plgpu.layout_cast(jnp.full((ROWS,), v, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    m, l = lax.fori_loop(first_chunk, last_chunk + 1, step, (row(-jnp.inf), row(0.0)))
    return jnp.where(m == -jnp.inf, 0.0, m), l


def _token_scores(p_smem, out_smem, *, G, GR, TB):
    """out_smem[j] = (sum over g < G of p_smem[j * GR + g]) / G: token j's score of the chunk's rows, summed in
    float32 one head row at a time."""
    for j in range(TB):
        total = _row_vector(p_smem.at[j * GR])
        for g in range(1, G):
            total = total + _row_vector(p_smem.at[j * GR + g])
        out_smem.at[j][...] = total / G


def _kernel(*refs, H, G, TB, T, scale, has_lse, per_row):
    """One program: token tile i of KV head h of batch row b (see the module docstring)."""
    if has_lse:
        q_ref, k_ref, ranges_ref, band_ref, lse_ref, scores_ref, scratch = refs
    else:
        (q_ref, k_ref, ranges_ref, band_ref, scores_ref, scratch), lse_ref = refs, None
    q_smem, k_smem, ranges_smem, lse_smem, p_smem, out_smem, q_barrier, aux_barrier, k_barrier = scratch
    GR = _head_slots(G)
    i = lax.axis_index("tile")
    bh = lax.axis_index("bh")
    b, h = lax.div(bh, H), lax.rem(bh, H)

    for j in range(TB):  # one copy per token; a token past T copies the last one (never written out)
        t = jnp.minimum(i * TB + j, T - 1)
        plgpu.copy_gmem_to_smem(q_ref.at[b, t, h], q_smem.at[pl.ds(j * GR, GR)], q_barrier)
    plgpu.copy_gmem_to_smem(ranges_ref.at[b if per_row else 0, i], ranges_smem, aux_barrier)
    if has_lse:
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, i], lse_smem, aux_barrier)
    plgpu.barrier_wait(q_barrier)
    plgpu.barrier_wait(aux_barrier)
    first, end = _row_vector(ranges_smem.at[0]), _row_vector(ranges_smem.at[1])
    first_chunk, last_chunk = band_ref[b if per_row else 0, i, 0], band_ref[b if per_row else 0, i, 1]
    logits = functools.partial(_logits, q_smem, k_smem, k_ref, k_barrier, b, h, first=first, end=end,
                               scale=scale)

    if has_lse:
        lse = _row_vector(lse_smem)
        seen = lse > -jnp.inf
        shift, norm = jnp.where(seen, lse, 0.0), None
    else:
        shift, norm = _online_softmax(logits, first_chunk, last_chunk)
        seen = norm > 0
        norm = jnp.where(seen, norm, 1.0)

    @pl.loop(first_chunk, last_chunk + 1)
    def _score(chunk):
        s, visible = logits(chunk)
        p = jnp.exp(s - _by_row(shift))
        if norm is not None:
            p = p / _by_row(norm)
        p_smem[...] = jnp.where(visible & _by_row(seen), p, 0.0)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's scores have left out_smem
        _token_scores(p_smem, out_smem, G=G, GR=GR, TB=TB)
        plgpu.commit_smem()
        x = pl.multiple_of(chunk * CHUNK, CHUNK)
        plgpu.copy_smem_to_gmem(out_smem, scores_ref.at[b, h, pl.ds(pl.multiple_of(i * TB, TB), TB),
                                                        pl.ds(x, CHUNK)])

    plgpu.wait_smem_to_gmem(0)


def _scratch(dtype, Dp, TB, has_lse):
    return (smem_tile((ROWS, Dp), dtype),  # q
            smem_tile((CHUNK, Dp), dtype),  # k_cmp chunk
            plgpu.SMEM((2, ROWS), jnp.int32),  # first, end per row
            plgpu.SMEM((ROWS,), jnp.float32) if has_lse else None,
            plgpu.SMEM((ROWS, CHUNK), jnp.float32),  # p
            plgpu.SMEM((TB, CHUNK), jnp.float32),  # the tile's scores of one chunk
            plgpu.Barrier(num_arrivals=TB),  # the TB copies of q
            plgpu.Barrier(num_arrivals=2 if has_lse else 1),  # row ranges (and lse)
            plgpu.Barrier())  # k_cmp


def scores(q, k_cmp, lse, cu_seqlens, kv_lens=None, *, block_size, stride, scale):
    """The kernel: float32 [B, H, TP, NCP] (TP = T rounded up to TB tokens, NCP = NC rounded up to 64), the
    score mean_g p_g(r) of row r of k_cmp for token t of KV head h at [b, h, t, r] (0 where not seen); k_cmp holds
    windows of block_size tokens every `stride`."""
    B, T, HQ, Dk = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    G = HQ // H
    GR = _head_slots(G)
    TB = ROWS // GR
    NT, num_chunks = cdiv(T, TB), cdiv(NC, CHUNK)
    q5, k_p = _padded_inputs(q, k_cmp, H)
    ranges = _row_ranges(T, NC, G, block_size, stride, cu_seqlens, kv_lens)
    args = [q5, k_p, ranges, _chunk_bands(ranges)]
    if lse is not None:
        args.append(_lse_rows(lse, H, G))
    kernel = functools.partial(_kernel, H=H, G=G, TB=TB, T=T, scale=float(scale),
                               has_lse=lse is not None, per_row=kv_lens is not None)
    scratch = _scratch(q.dtype, k_p.shape[3], TB, lse is not None)

    def entry(*refs):
        pl.run_scoped(lambda *s: kernel(*refs, s), *scratch)

    return call(entry, jax.ShapeDtypeStruct((B, H, NT * TB, num_chunks * CHUNK), jnp.float32), *args,
                grid=(NT, B * H), grid_names=("tile", "bh"), kernel_name="select_scores_kernel")


# ------------------------------------------------------------------------------------------ top-k kernel

NO_ID = float(1 << 23)  # ids travel as float32, exact below 2^24: block ids are below NO_ID, fillers above it


def _insert(best, m, at):
    """best = (values, ids) [64, SP] float32, each row's running top, unordered; the candidate (m, at) [64]
    replaces the row's worst (lowest value, highest id on ties) where m is larger. A candidate's id exceeds every
    id of its value in best (chunks come in id order, and a chunk's candidates in rank order), so "strictly
    larger" is the rank order, ties to the lower id."""
    values, ids = best
    low = values.min(axis=1)
    is_low = values == by_row(low, values.shape)
    worst = jnp.where(is_low, ids, -1.0).max(axis=1)
    replace = is_low & (ids == by_row(worst, ids.shape)) & (by_row(m, values.shape) > by_row(low, values.shape))
    return jnp.where(replace, by_row(m, values.shape), values), jnp.where(replace, by_row(at, ids.shape), ids)


def _top_k_kernel(chunks_ref, x_ref, out_ref, x_smem, out_smem, barrier, *, k, slots, top_chunk):
    """Tile i: rows 64 i .. 64 i + 63 of x [RP, NP], its first chunks_ref[i] chunks of top_chunk columns."""
    i = lax.axis_index("tile")
    rows = pl.ds(pl.multiple_of(i * TOP_ROWS, TOP_ROWS), TOP_ROWS)

    def fetch(c, slot):
        cols = pl.ds(c * top_chunk, top_chunk)
        plgpu.copy_gmem_to_smem(x_ref.at[rows, cols], x_smem.at[slot], barrier.at[slot])

    def step(c, slot, best):
        plgpu.barrier_wait(barrier.at[slot])
        x = plgpu.load(x_smem.at[slot], layout=plgpu.Layout.WGMMA)
        plgpu.commit_smem()  # every thread has read the slot before the next copy into it is issued
        col = (iota(x.shape, 1) + c * top_chunk).astype(jnp.float32)

        def extract(_, carry):  # the chunk's best left: its value m and lowest column, then out of the chunk
            x, best = carry
            m = x.max(axis=1)
            at = jnp.where(x == by_row(m, x.shape), col, NO_ID).min(axis=1)
            x = jnp.where(col == by_row(at, x.shape), -jnp.inf, x)
            return x, _insert(best, m, at)

        return lax.fori_loop(0, min(k, top_chunk), extract, (x, best))[1]

    slot_id = iota((TOP_ROWS, slots), 1)
    init = (jnp.where(slot_id < k, -jnp.inf, jnp.inf),  # slots past k: never the worst, never reported
            (slot_id + int(NO_ID)).astype(jnp.float32))
    values, ids = pipelined(chunks_ref[i], fetch, step, init)
    values = jnp.where(slot_id < k, values, -jnp.inf)

    def report(s, values):  # rank s: the best left (lowest id on ties), -1 for -inf
        m = values.max(axis=1)
        at = jnp.where(values == by_row(m, values.shape), ids, 2 * NO_ID).min(axis=1)
        out_smem.at[s][...] = jnp.where(m == -jnp.inf, -1, at.astype(jnp.int32))
        return jnp.where(ids == by_row(at, ids.shape), -jnp.inf, values)

    lax.fori_loop(0, k, report, values)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[i])
    plgpu.wait_smem_to_gmem(0)


def top_k(x, k, chunks, *, config=None, interpret=None):
    """The k best columns of each row of x float32 [R, N] in rank order, int32 [R, k]: value descending, ties to
    the lower column, -1 for -inf (nsa.reference.select's `top_blocks`; x must hold no NaN). chunks int32
    [cdiv(R, 64)]: how many chunks of `config.top_chunk` columns (a Config; None: Config()) each tile of 64 rows
    walks (the columns past them must be -inf in all its rows; causally, about half the chunks).

    Grid (cdiv(R, 64),), one warpgroup per program. A program walks its chunks, each a TMA copy of x [64, 128] (at
    the default top_chunk) into shared memory (double-buffered), loaded as one wgmma-layout tile: k times the
    chunk's best entry is taken out (a row max, then the row min of the columns that hold it) and offered to the
    row's running top, k (value, id) pairs in registers [64, SP] (SP = k rounded up to 8), which replaces its worst.
    At the end the top is reported in rank order into an int32 [SP, 64] tile of shared memory, one TMA copy out.
    Cost: about k x 6 passes over each walked chunk in registers; exact, deterministic. interpret: None, or a
    plgpu.InterpretGPUParams to run it in Mosaic GPU's interpret mode (on the CPU: the tests)."""
    R, N = x.shape
    if N >= NO_ID:
        raise ValueError(f"x: expected fewer than {int(NO_ID)} columns (the top-k kernel carries column ids in "
                         f"float32), got {N}")
    top_chunk = (config or Config()).top_chunk
    slots = round_up(max(k, 1), 8)
    RP, NP = round_up(R, TOP_ROWS), round_up(N, top_chunk)
    x = jnp.pad(x.astype(jnp.float32), [(0, RP - R), (0, NP - N)], constant_values=-jnp.inf)
    nt = RP // TOP_ROWS
    out = call(functools.partial(_top_k_kernel, k=k, slots=slots, top_chunk=top_chunk),
               jax.ShapeDtypeStruct((nt, slots, TOP_ROWS), jnp.int32), chunks.astype(jnp.int32), x,
               grid=(nt,), grid_names=("tile",),
               scratch_types=[plgpu.SMEM((2, TOP_ROWS, top_chunk), jnp.float32),
                              plgpu.SMEM((slots, TOP_ROWS), jnp.int32), plgpu.Barrier(num_barriers=2)],
               kernel_name="select_top_k_kernel", interpret=interpret)
    return jnp.transpose(out, (0, 2, 1)).reshape(RP, slots)[:R, :k]


def _top_chunks(pos, B, H, block_size, num_blocks, top_chunk):
    """int32 [cdiv(B * T * H, 64)]: the chunks of top_chunk ranks each top-k tile walks, rows (b, t, h) in order:
    a token's blocks past its current one, pos // block_size, rank -inf."""
    last = jnp.minimum(pos // block_size, num_blocks - 1) // top_chunk + 1  # [R_tok, T]
    T = pos.shape[1]
    per_row = jnp.broadcast_to(last[:, :, None], (B, T, H)).reshape(-1)
    per_row = jnp.pad(per_row, [(0, round_up(per_row.shape[0], TOP_ROWS) - per_row.shape[0])])
    return jnp.max(per_row.reshape(-1, TOP_ROWS), axis=1)


@per_sequence
def forward(q, k_cmp, lse, cu_seqlens, kv_lens=None, *, block_counts, block_size, scale, compress_block_size=None,
            compress_stride=None, config=None):
    """Returns block_indices int32 [B, T, H, block_counts] (in-sequence block ids), as the reference.

    q [B, T, HQ, Dk], k_cmp [B, NC, H, Dk] (bfloat16 or float16, the same); lse [B, T, HQ] float32 is
    compressed attention's log-sum-exp of the same q and k_cmp (it saves the kernel its first walk), or None;
    cu_seqlens None or int32 [N + 1] (packed sequences, B = 1); kv_lens None or int32 [B] (the queries are the
    last T tokens of sequences of kv_lens[b] tokens, which k_cmp covers). config: a Config (None:
    `default_config`). A symbolic batch runs once per sequence (`per_sequence`: no Mosaic GPU grid takes one).
    """
    _, compress_block_size, compress_stride = blocks_of(block_size, compress_block_size, compress_stride)
    _check(q, k_cmp)
    B, T, HQ, _ = q.shape
    NC, H = k_cmp.shape[1], k_cmp.shape[2]
    if config is None:
        shapes = Shapes.of(q, k_cmp, block_size=block_size, block_counts=block_counts)
        config = default_config(shapes, q.dtype, facts("cuda"))
    nb = num_candidates(T, NC, block_size, kv_lens, compress_stride)
    if B * T * H == 0:
        return jnp.zeros((B, T, H, block_counts), jnp.int32)
    tok = tokens(T, compress_stride, cu_seqlens, kv_lens)
    if NC == 0:  # no row to score: every score is 0
        by_row = jnp.zeros((B, T, H, NC), jnp.float32)
    else:
        out = scores(q, k_cmp, lse, cu_seqlens, kv_lens, block_size=compress_block_size, stride=compress_stride,
                     scale=scale)
        first = tok.cmp_start[:, :, None, None]
        end = jnp.minimum(first + complete_rows(tok.pos[:, :, None, None], compress_block_size, compress_stride), NC)
        row = jnp.arange(NC)
        # a tile writes only its chunks (`_chunk_bands`): the rows a token does not see read as 0
        by_row = jnp.where((row >= first) & (row < end), jnp.transpose(out[:, :, :T, :NC], (0, 2, 1, 3)), 0.0)
    ranks = ranks_from_scores(by_row, cu_seqlens, kv_lens, num_blocks=nb, block_size=block_size,
                              compress_block_size=compress_block_size, compress_stride=compress_stride)
    ids = top_k(ranks.reshape(B * T * H, nb), block_counts,
                _top_chunks(tok.pos, B, H, block_size, nb, config.top_chunk), config=config)
    return ids.reshape(B, T, H, block_counts)
