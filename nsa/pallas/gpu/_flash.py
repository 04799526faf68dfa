"""Flash attention over one interval of key rows per query, as Pallas Mosaic GPU kernels (NVIDIA Hopper).

The contract, the ranges and the packing of a KV cache's query heads are nsa/pallas/_flash.py's (the TPU
kernels): query t sees the key rows [lo[t], hi[t]] of k [B, NK, H, Dk] (lo, hi int32 [T], or [B, T] per batch
row with a KV cache), non-decreasing in t. Only the kernels differ: these are `plgpu.kernel`s (one warpgroup
of 128 threads per program, wgmma for the matmuls, TMA copies for every tile), which lower for CUDA on any
machine (`jax.export(..., platforms=["cuda"])`) and run with nothing but jax[cuda] (jax >= 0.11).

Layouts. q, o, do, dq stay [B, T, HQ, D] and k, v, dk, dv [B, NK, H, D]: a tile is a TMA copy of a strided
slice (`q.at[b, pl.ds(t0, BQ), hq]`), so nothing is transposed. D is padded to a multiple of 64 (the 128-byte
swizzle of a 2-byte row) and T, NK to a multiple of 8 rows (a TMA copy into a tiled shared-memory tile needs
it) and at least one tile: copies only for small or odd shapes (none at Dk = Dv = 128, T and NK multiples of 8,
at least 128). A tile reaching past the rows of the array reads zeros (TMA fills them) and its
stores there are dropped (TMA clips them). lo and hi are int32 [R, tp] (R = B with per-row ranges, else 1; tp
= T padded to a multiple of BQ, padded queries see nothing), lse and delta float32 [B, HQ, tp]: a tile's
slice of each is one 1-D TMA copy, loaded as a per-row (or per-column) vector of the wgmma layout.

Forward (`_forward_kernel`), grid (T / 128, HQ, B), three warpgroups (FA3's split, as jax's attention_mgpu.py):
one program owns 128 queries of head hq; two consumer warpgroups take 64 each, and a producer warpgroup copies
the band of key tiles (`_bands`: the first and last key tile any of the 128 queries sees, read as scalars from
HBM) into SLOTS buffers, refilling a slot once both consumers have released it. s = q k^T (wgmma, [64, BK]
float32), masked to [lo, hi], online softmax in base 2, acc += p v. With a KV cache v's rows past the last one
any query of the batch row sees are zeroed in XLA first (`_seen_values`: they may hold NaN, and 0 * NaN is NaN).

Backward. `_dq_kernel`, grid (T / 64, HQ, B), one warpgroup per 64 queries, recomputes p from lse: dq += ds k
with ds = p * (do v^T - delta) (k's rows past `ends` zeroed in shared memory). `_dkdv_kernel`, grid (NK / BK, H,
B * P), owns one key tile of a KV head and walks, for each of its G query heads, the query tiles that see it
(`query_ranges`, then `_bands` over the key tiles): s^T = k q^T, p^T, dv += p^T do, dp^T = v do^T, dk +=
ds^T q, all [BK, .] float32 in registers, in a fixed order (deterministic, no atomics). With few key tiles
(the compressed branch) P > 1 programs share that walk (`_dkdv_parts`), each storing float32 partial dk and dv
that XLA adds in a fixed order. Masked entries of p^T
and ds^T are set to 0 with jnp.where, so a NaN key or value past `ends` reaches no result.

Tiles: BQ = 64 query rows (wgmma's M, one warpgroup), BK = 64 key rows in dq and dk/dv, 128 in the forward
(`FORWARD_BLOCK_K`). Shared memory per program (the largest, the forward): two q [64, Dkp] and two o [64, Dvp]
tiles, SLOTS k [BK, Dkp] and v [BK, Dvp] buffers, in the input dtype: 192 KiB at Dk = Dv = 128 in bfloat16,
within the H200's 227 KiB (head dims Dkp + Dvp up to MAX_HEAD_DIMS).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nsa._varlen import cdiv, query_ranges
from nsa.pallas._batch import per_sequence
from nsa.pallas._flash import _bands, _padded as pad_to, packed_attend, packed_attend_backward
from nsa.reference._common import kernel_delta

BLOCK_Q = 64  # query rows per tile: wgmma's M (one warpgroup)
BLOCK_K = 64  # key rows per tile of the dq and dk/dv kernels
# The forward's key tiles: 128 rows (fewer, longer steps), or 64 where two buffers of k and v would not fit in
# shared memory beside q and o (Dkp + Dvp > 256). A query whose visible keys fit one tile then takes its softmax
# in one step, with no rescaling: a packed sequence's results equal its results alone (the varlen tests).
FORWARD_BLOCK_K = 128
# The dk/dv kernel splits a key tile's walk over several programs when there are few key tiles (the compressed
# branch: B * H * NC / 64 = 64 programs at T = 64k on the standard shape, 46.7 ms forward+backward against
# Triton's 17.6): about 4 waves of the H200's 132 SMs, each part at least 32 steps.
DKDV_PROGRAMS = 4 * 132
# The forward runs FA3's split (jax's attention_mgpu.py): two consumer warpgroups of 64 query rows each and one
# producer warpgroup that copies key tiles into SLOTS buffers; the producer gives its registers to the consumers.
FORWARD_ROWS = 2 * BLOCK_Q
SLOTS = 2
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40
MAX_HEAD_DIMS = 448  # Dkp + Dvp: 2 * (2 * 64 + SLOTS * 64) rows of 2 bytes each must fit the H200's 227 KiB
DKDV_MIN_STEPS = 32
SUBLANES = 8  # the rows of a shared-memory tile
LANE_BYTES = 128  # the swizzle of a shared-memory tile's rows: D is padded to a multiple of 128 bytes
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # wgmma on float32 is TF32: too coarse


def check_dtype(dtype, op):
    """TypeError unless the Mosaic GPU kernels take `dtype`."""
    if jnp.dtype(dtype) not in DTYPES:
        raise TypeError(f"{op}: the Mosaic GPU kernels take bfloat16 or float16 inputs (wgmma on float32 is TF32, "
                        f"too coarse for float32 results), got {jnp.dtype(dtype).name}")


def smem_tile(shape, dtype):
    """A shared-memory tile that wgmma and TMA read: (8, 128-byte) tiles, 128-byte swizzle."""
    cols = LANE_BYTES // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((SUBLANES, cols)), plgpu.SwizzleTransform(LANE_BYTES))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def padded_dim(d, dtype):
    """d rounded up to whole 128-byte rows."""
    cols = LANE_BYTES // jnp.dtype(dtype).itemsize
    return cdiv(d, cols) * cols


def tma_rows(x, tile):
    """x [B, N, heads, D] with N zero-padded to a multiple of 8 rows (a TMA copy of a tiled slice needs it) and
    to at least one tile of `tile` rows: a copy only when N is odd or short."""
    return pad_to(x, 1, max(tile, cdiv(x.shape[1], SUBLANES) * SUBLANES))


ROWS = plgpu.Layout.WGMMA.reduce(1)  # a value per row of a wgmma tile
COLS = plgpu.Layout.WGMMA.reduce(0)  # a value per column


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def by_row(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def by_col(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def matmul(a, b, shape):
    """a @ b ([M, N] float32) by wgmma; a, b shared-memory refs (b possibly `.transpose((1, 0))`) or a an array."""
    def scope(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def matmul_add(acc, a, b):
    """acc + a @ b by wgmma, acc a float32 array of the wgmma layout."""
    def scope(ref):
        plgpu.wgmma(ref, a, b)
    return pl.run_state(scope)(plgpu.ACC.init(acc))


def zero_rows_past(ref, first_row, end):
    """Zeroes the rows of the tile `ref` ([rows, D], its first row first_row of the array) past row `end`,
    when it has any: they may hold anything (a KV cache's rows past a sequence)."""
    @pl.when(first_row + ref.shape[0] - 1 > end)
    def _():
        x = plgpu.load(ref, layout=plgpu.Layout.WGMMA)
        ref[...] = jnp.where(first_row + iota(ref.shape, 0) <= end, x, jnp.zeros_like(x))
        plgpu.commit_smem()  # the writes, visible to wgmma's reads


def key_gradients(dk, dv, logits_t, visible, lse, delta, q_smem, do_smem, v_smem):
    """One step of a dk/dv kernel on its key tile against a tile of query rows: p^T = exp2(logits_t - lse)
    [keys, rows] (base-2 logits, lse and delta per column; 0 where not visible or where the column sees
    nothing), dv += p^T do, dp^T = v do^T, ds^T = p^T (dp^T - delta), dk += ds^T q (unscaled). q, do and v are
    shared-memory tiles (q and do [rows, D], v [keys, Dv]); returns (dk, dv), float32."""
    shape = logits_t.shape
    seen = lse > -jnp.inf
    visible = visible & by_col(seen, shape)
    p_t = jnp.where(visible, jnp.exp2(logits_t - by_col(jnp.where(seen, lse * LOG2E, 0.0), shape)), 0.0)
    dv = matmul_add(dv, p_t.astype(q_smem.dtype), do_smem)
    dp_t = matmul(v_smem, do_smem.transpose((1, 0)), shape)
    ds_t = jnp.where(visible, p_t * (dp_t - by_col(delta, shape)), 0.0)
    return matmul_add(dk, ds_t.astype(q_smem.dtype), q_smem), dv


def load_vector(src, dst, barrier, layout):
    """src (a 1-D slice of an HBM ref) copied into dst (shared memory) and loaded in `layout`."""
    plgpu.copy_gmem_to_smem(src, dst, barrier)
    plgpu.barrier_wait(barrier)
    return plgpu.load(dst, layout=layout)


def store(value, smem, dst):
    """value written to smem, then copied to dst (an HBM slice) and waited for."""
    smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst)
    plgpu.wait_smem_to_gmem(0)


def band(band_ref, row, tile, num_tiles):
    """(first, last) tile of the band of `tile` in row `row` of the flat bands (nsa/pallas/_flash.py `_bands`)."""
    base = row * 2 * num_tiles
    return band_ref[base + tile], band_ref[base + num_tiles + tile]


def _scratch(*tiles):
    """The shared-memory scratch of a kernel: (shape, dtype) pairs, wgmma tiles for the input dtypes (q, k, v,
    do), plain arrays for the int32 ranges and the float32 lse and delta."""
    return [smem_tile(shape, dtype) if jnp.dtype(dtype) in DTYPES else plgpu.SMEM(shape, dtype)
            for shape, dtype in tiles]


def _visible(key, lo, hi, shape, along):
    """[shape] bool: key (an int32 array of `shape`) within [lo, hi], vectors along dim `along` (0: one per
    row, 1: one per column)."""
    spread = by_row if along == 0 else by_col
    return (key >= spread(lo, shape)) & (key <= spread(hi, shape))


def _forward_kernel(band_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, q_smem, k_smem, v_smem, o_smem,
                    ranges, lse_smem, q_bar, vec_bar, k_bar, v_bar, k_free, v_free, *, sh, scale):
    """Warpgroups 0 and 1 each own 64 of the program's 128 query rows and compute; warpgroup 2 copies the key
    tiles of the band into SLOTS buffers, refilling a slot once both have released it (k_free, v_free)."""
    i, hq, b, wg = (lax.axis_index(axis) for axis in ("tile", "head", "batch", "wg"))
    row = b if sh.per_row else 0
    h = lax.div(hq, sh.G)
    first, last = band(band_ref, row, i, sh.nq_forward)
    count = jnp.maximum(last - first + 1, 0)

    @pl.when(wg < 2)
    def _consume():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        queries = pl.ds(i * FORWARD_ROWS + wg * BLOCK_Q, BLOCK_Q)
        q_tile = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, queries, hq], q_tile, q_bar.at[wg])
        lo = load_vector(lo_ref.at[row, queries], ranges.at[wg, 0], vec_bar.at[wg], ROWS)
        hi = load_vector(hi_ref.at[row, queries], ranges.at[wg, 1], vec_bar.at[wg], ROWS)
        plgpu.barrier_wait(q_bar.at[wg])

        def step(s, carry):
            acc, m, l = carry
            slot = lax.rem(s, SLOTS)
            plgpu.barrier_wait(k_bar.at[slot])
            logits = matmul(q_tile, k_smem.at[slot].transpose((1, 0)), (BLOCK_Q, sh.bk)) * (scale * LOG2E)
            plgpu.barrier_arrive(k_free.at[slot])
            visible = _visible((first + s) * sh.bk + iota(logits.shape, 1), lo, hi, logits.shape, 0)
            logits = jnp.where(visible, logits, -jnp.inf)
            m_new = jnp.maximum(m, logits.max(axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet: no NaN
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2(logits - by_row(m_use, logits.shape))
            l = l * alpha + p.sum(axis=1)
            acc = acc * by_row(alpha, acc.shape)
            plgpu.barrier_wait(v_bar.at[slot])
            acc = matmul_add(acc, p.astype(q_tile.dtype), v_smem.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        init = (plgpu.layout_cast(jnp.zeros((BLOCK_Q, sh.dvp), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), ROWS),
                plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), ROWS))
        acc, m, l = lax.fori_loop(0, count, step, init)
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        store(acc / by_row(l_safe, acc.shape), o_smem.at[wg], o_ref.at[b, queries, hq])
        store(jnp.where(seen, (m + jnp.log2(l_safe)) * LN2, -jnp.inf), lse_smem.at[wg], lse_ref.at[b, hq, queries])

    @pl.when(wg == 2)
    def _produce():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def fetch(s, slot):
            keys = pl.ds(pl.multiple_of((first + s) * sh.bk, sh.bk), sh.bk)
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[slot], v_bar.at[slot])

        for s in range(SLOTS):
            pl.when(s < count)(functools.partial(fetch, s, s))

        @pl.loop(SLOTS, count)
        def _refill(s):
            slot = lax.rem(s, SLOTS)
            keys = pl.ds(pl.multiple_of((first + s) * sh.bk, sh.bk), sh.bk)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[slot], k_bar.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[slot], v_bar.at[slot])


def _dq_kernel(band_ref, end_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem,
               do_smem, k_smem, v_smem, ranges, stats, q_bar, do_bar, vec_bar, k_bar, v_bar, *, sh, scale):
    i, hq, b = lax.axis_index("tile"), lax.axis_index("head"), lax.axis_index("batch")
    row = b if sh.per_row else 0
    h = lax.div(hq, sh.G)
    queries = pl.ds(i * BLOCK_Q, BLOCK_Q)
    plgpu.copy_gmem_to_smem(q_ref.at[b, queries, hq], q_smem, q_bar.at[0])
    plgpu.copy_gmem_to_smem(do_ref.at[b, queries, hq], do_smem, do_bar.at[0])
    lo = load_vector(lo_ref.at[row, queries], ranges.at[0], vec_bar.at[0], ROWS)
    hi = load_vector(hi_ref.at[row, queries], ranges.at[1], vec_bar.at[0], ROWS)
    lse = load_vector(lse_ref.at[b, hq, queries], stats.at[0], vec_bar.at[0], ROWS)
    delta = load_vector(delta_ref.at[b, hq, queries], stats.at[1], vec_bar.at[0], ROWS)
    seen = lse > -jnp.inf
    lse2 = jnp.where(seen, lse * LOG2E, 0.0)
    plgpu.barrier_wait(q_bar.at[0])
    plgpu.barrier_wait(do_bar.at[0])
    first, last = band(band_ref, row, i, sh.nq)
    end = end_ref[row]

    def fetch(step, slot):
        keys = pl.ds(pl.multiple_of((first + step) * BLOCK_K, BLOCK_K), BLOCK_K)
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[slot], v_bar.at[slot])

    def step(s, slot, acc):
        first_key = (first + s) * BLOCK_K
        plgpu.barrier_wait(k_bar.at[slot])
        zero_rows_past(k_smem.at[slot], first_key, end)
        logits = matmul(q_smem, k_smem.at[slot].transpose((1, 0)), (BLOCK_Q, BLOCK_K)) * (scale * LOG2E)
        shape = logits.shape
        visible = _visible(first_key + iota(shape, 1), lo, hi, shape, 0) & by_row(seen, shape)
        p = jnp.where(visible, jnp.exp2(logits - by_row(lse2, shape)), 0.0)
        plgpu.barrier_wait(v_bar.at[slot])
        dp = matmul(do_smem, v_smem.at[slot].transpose((1, 0)), shape)
        ds = jnp.where(visible, p * (dp - by_row(delta, shape)), 0.0)
        return matmul_add(acc, ds.astype(q_smem.dtype), k_smem.at[slot])

    init = plgpu.layout_cast(jnp.zeros((BLOCK_Q, sh.dkp), jnp.float32), plgpu.Layout.WGMMA)
    acc = pipelined(last - first + 1, fetch, step, init)
    store(acc * scale, q_smem, dq_ref.at[b, queries, hq])


def _dkdv_kernel(band_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem,
                 v_smem, q_smem, do_smem, ranges, stats, k_bar, v_bar, q_bar, do_bar, vec_bar, *, sh, scale, parts):
    n, h = lax.axis_index("tile"), lax.axis_index("head")
    b, part = lax.div(lax.axis_index("batch"), parts), lax.rem(lax.axis_index("batch"), parts)
    row = b if sh.per_row else 0
    keys = pl.ds(n * BLOCK_K, BLOCK_K)
    plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem, k_bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem, v_bar.at[0])
    first, last = band(band_ref, row, n, sh.nk)
    tiles = jnp.maximum(last - first + 1, 0)
    steps = tiles * sh.G  # this part's share: steps start ... start + count - 1 of them
    share = lax.div(steps + parts - 1, parts)
    start = part * share
    count = jnp.clip(steps - start, 0, share)

    def fetch(e, slot):  # step start + e: query head g = step // tiles, query tile first + step % tiles
        step = start + e
        hq = h * sh.G + lax.div(step, tiles)
        queries = pl.ds(pl.multiple_of((first + lax.rem(step, tiles)) * BLOCK_Q, BLOCK_Q), BLOCK_Q)
        plgpu.copy_gmem_to_smem(q_ref.at[b, queries, hq], q_smem.at[slot], q_bar.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[b, queries, hq], do_smem.at[slot], do_bar.at[slot])
        for j, (src, dst) in enumerate(((lo_ref.at[row, queries], ranges.at[slot, 0]),
                                        (hi_ref.at[row, queries], ranges.at[slot, 1]),
                                        (lse_ref.at[b, hq, queries], stats.at[slot, 0]),
                                        (delta_ref.at[b, hq, queries], stats.at[slot, 1]))):
            plgpu.copy_gmem_to_smem(src, dst, vec_bar.at[4 * slot + j])

    def step(s, slot, carry):
        dk, dv = carry
        for j in range(4):
            plgpu.barrier_wait(vec_bar.at[4 * slot + j])
        lo, hi = (plgpu.load(ranges.at[slot, j], layout=COLS) for j in range(2))
        lse, delta = (plgpu.load(stats.at[slot, j], layout=COLS) for j in range(2))
        plgpu.barrier_wait(q_bar.at[slot])
        logits_t = matmul(k_smem, q_smem.at[slot].transpose((1, 0)), (BLOCK_K, BLOCK_Q)) * (scale * LOG2E)
        shape = logits_t.shape
        plgpu.barrier_wait(do_bar.at[slot])
        return key_gradients(dk, dv, logits_t, _visible(n * BLOCK_K + iota(shape, 0), lo, hi, shape, 1), lse, delta,
                             q_smem.at[slot], do_smem.at[slot], v_smem)

    plgpu.barrier_wait(k_bar.at[0])
    plgpu.barrier_wait(v_bar.at[0])
    init = tuple(plgpu.layout_cast(jnp.zeros((BLOCK_K, d), jnp.float32), plgpu.Layout.WGMMA) for d in (sh.dkp, sh.dvp))
    dk, dv = pipelined(count, fetch, step, init)
    if parts == 1:
        store(dk * scale, k_smem, dk_ref.at[b, keys, h])
        store(dv, v_smem, dv_ref.at[b, keys, h])
    else:  # float32 partial sums, added in XLA in part order
        for value, out, d in ((dk * scale, dk_ref, sh.dkp), (dv, dv_ref, sh.dvp)):
            pl.run_scoped(lambda smem: store(value, smem, out.at[part, b, keys, h]),
                          plgpu.SMEM((BLOCK_K, d), jnp.float32))


def pipelined(count, fetch, body, carry):
    """carry through body(step, slot, carry) for step < count, each step's copies (fetch(step, slot))
    double-buffered: the next step's are issued before this one is computed (the slot they fill was last
    read by the step before, whose wgmmas have completed)."""
    @pl.when(count > 0)
    def _():
        fetch(0, 0)

    def step(s, carry):
        slot = lax.rem(s, 2)

        @pl.when(s + 1 < count)
        def _():
            fetch(s + 1, 1 - slot)
        return body(s, slot, carry)

    return lax.fori_loop(0, count, step, carry)


class _Layout:
    """The static sizes of one call and the arrays its kernels take besides q, k, v (see the module
    docstring)."""

    def __init__(self, q, k, v, lo, hi):
        self.B, self.T, self.HQ, self.dk = q.shape
        self.NK, self.H, self.dv = k.shape[1], k.shape[2], v.shape[3]
        self.G = self.HQ // self.H
        self.dkp, self.dvp = padded_dim(self.dk, q.dtype), padded_dim(self.dv, v.dtype)
        self.tp = cdiv(self.T, BLOCK_Q) * BLOCK_Q
        self.nq, self.nk = self.tp // BLOCK_Q, max(1, cdiv(self.NK, BLOCK_K))
        self.bk = FORWARD_BLOCK_K if self.dkp + self.dvp <= 256 else BLOCK_K  # the forward's key tile
        if self.dkp + self.dvp > MAX_HEAD_DIMS:
            raise ValueError(f"q, v: the Mosaic GPU flash forward holds two 64-row q and o tiles and two key tiles in "
                             f"shared memory, for head dims Dk + Dv of at most {MAX_HEAD_DIMS} (each rounded up to "
                             f"64), got Dk = {self.dk}, Dv = {self.dv}")
        self.per_row = lo.ndim == 2
        self.lo, self.hi = (x.astype(jnp.int32).reshape(-1, self.T) for x in (lo, hi))
        padding = jnp.arange(self.tp) >= self.T  # padded queries see nothing: lo 1, hi 0
        self.lo_p = jnp.where(padding, 1, pad_to(self.lo, 1, self.tp))
        self.hi_p = jnp.where(padding, 0, pad_to(self.hi, 1, self.tp))
        self.ends = jnp.max(self.hi, axis=1)  # [R]: the last key row any query of the batch row sees
        self.tp_forward = cdiv(self.T, FORWARD_ROWS) * FORWARD_ROWS  # the forward's queries, in tiles of 128
        self.nq_forward = self.tp_forward // FORWARD_ROWS
        forward_padding = jnp.arange(self.tp_forward) >= self.T
        self.lo_forward = jnp.where(forward_padding, 1, pad_to(self.lo, 1, self.tp_forward))
        self.hi_forward = jnp.where(forward_padding, 0, pad_to(self.hi, 1, self.tp_forward))

    def queries(self, x, d):
        return tma_rows(pad_to(x, 3, d), BLOCK_Q)

    def keys(self, x, d):
        return tma_rows(pad_to(x, 3, d), self.bk)

    def by_head(self, x):
        """[B, T, HQ] -> [B, HQ, tp] float32, the layout of lse and delta in the kernels."""
        return pad_to(jnp.transpose(x.astype(jnp.float32), (0, 2, 1)), 2, self.tp)


def call(body, out_type, *args, **params):
    """plgpu.kernel(body, out_type=out_type, **params)(*args), its outputs varying over the shard_map axes that
    its first floating-point argument varies over (plgpu.kernel's outputs vary over none, and the branches of
    platform_dependent must agree on them)."""
    like = next(a for a in args if jnp.issubdtype(a.dtype, jnp.floating))
    axes = tuple(sorted(jax.typeof(like).manual_axis_type.varying))
    outputs = plgpu.kernel(body, out_type=out_type, **params)(*args)
    return outputs if not axes else jax.tree_util.tree_map(lambda x: lax.pcast(x, axes, to="varying"), outputs)


def kernel_name(branch, kernel):
    """`{branch}{kernel's function name}`, e.g. window_forward_kernel: what profiles and compute-sanitizer's
    --kernel-name filter (scripts/gpu.sh sanitize: kns=_kernel) see."""
    return branch + getattr(kernel, "func", kernel).__name__


def _call(kernel, grid, outputs, scratch, *args, barriers, name, **params):
    """`call` of `kernel` on `grid` (named tile, head, batch), with the shared-memory `scratch` and one group of
    barriers per entry of `barriers` (a count, or (count, arrivals)) after the outputs; the branch `name` names it;
    `params` go to plgpu.kernel (num_threads, thread_name)."""
    groups = [plgpu.Barrier(num_barriers=n) if isinstance(n, int) else plgpu.Barrier(num_barriers=n[0],
                                                                                     num_arrivals=n[1])
              for n in barriers]
    return call(kernel, outputs, *args, grid=grid, grid_names=("tile", "head", "batch"),
                scratch_types=_scratch(*scratch) + groups, kernel_name=kernel_name(name, kernel), **params)


def _seen_values(v, lay):
    """v with the rows past the last one any query of its batch row sees zeroed, with per-row ranges (a KV cache's
    rows past a sequence may hold NaN, and p = 0 times NaN is NaN); v itself otherwise (every row is a key)."""
    if not lay.per_row:
        return v
    keep = jnp.arange(v.shape[1])[None, :, None, None] <= lay.ends[:, None, None, None]
    return jnp.where(keep, v, jnp.zeros_like(v))


def _attend(q, k, v, lo, hi, *, scale, name):
    lay = _Layout(q, k, v, lo, hi)
    qv, kv, vv = lay.queries(q, lay.dkp), lay.keys(k, lay.dkp), lay.keys(_seen_values(v, lay), lay.dvp)
    dtype = q.dtype
    o, lse = _call(
        functools.partial(_forward_kernel, sh=lay, scale=float(scale)), (lay.nq_forward, lay.HQ, lay.B),
        (jax.ShapeDtypeStruct(qv.shape[:3] + (lay.dvp,), dtype),
         jax.ShapeDtypeStruct((lay.B, lay.HQ, lay.tp_forward), jnp.float32)),
        [((2, BLOCK_Q, lay.dkp), dtype), ((SLOTS, lay.bk, lay.dkp), dtype), ((SLOTS, lay.bk, lay.dvp), dtype),
         ((2, BLOCK_Q, lay.dvp), dtype), ((2, 2, BLOCK_Q), jnp.int32), ((2, BLOCK_Q), jnp.float32)],
        _bands(lay.lo_forward, lay.hi_forward, lay.nq_forward, lay.bk), lay.lo_forward, lay.hi_forward, qv, kv, vv,
        barriers=(2, 2, SLOTS, SLOTS, (SLOTS, 2), (SLOTS, 2)), name=name, num_threads=3, thread_name="wg")
    return o[:, :lay.T, :, :lay.dv], jnp.transpose(lse[:, :, :lay.T], (0, 2, 1))


def _attend_backward(q, k, v, lo, hi, o, lse, do, dlse, *, scale, query_span, name):
    lay = _Layout(q, k, v, lo, hi)
    dtype = q.dtype
    delta = kernel_delta(o, do, dtype, lse, dlse)
    qv, kv, vv = lay.queries(q, lay.dkp), lay.keys(k, lay.dkp), lay.keys(v, lay.dvp)
    dov = lay.queries(do.astype(dtype), lay.dvp)
    lse_h, delta_h = lay.by_head(lse), lay.by_head(delta)
    dq = _call(
        functools.partial(_dq_kernel, sh=lay, scale=float(scale)), (lay.nq, lay.HQ, lay.B),
        jax.ShapeDtypeStruct(qv.shape, dtype),
        [((BLOCK_Q, lay.dkp), dtype), ((BLOCK_Q, lay.dvp), dtype), ((2, BLOCK_K, lay.dkp), dtype),
         ((2, BLOCK_K, lay.dvp), dtype), ((2, BLOCK_Q), jnp.int32), ((2, BLOCK_Q), jnp.float32)],
        _bands(lay.lo_p, lay.hi_p, lay.nq, BLOCK_K), lay.ends, lay.lo_p, lay.hi_p, qv, kv, vv, dov, lse_h, delta_h,
        barriers=(1, 1, 1, 2, 2), name=name)
    first, last = query_ranges(lay.lo, lay.hi, lay.nk * BLOCK_K)  # the queries that see each key row
    parts = _dkdv_parts(lay, query_span)
    out = lambda x, dtype: jax.ShapeDtypeStruct(x.shape if parts == 1 else (parts,) + x.shape,
                                                dtype if parts == 1 else jnp.float32)
    dk, dv = _call(
        functools.partial(_dkdv_kernel, sh=lay, scale=float(scale), parts=parts), (lay.nk, lay.H, lay.B * parts),
        (out(kv, k.dtype), out(vv, v.dtype)),
        [((BLOCK_K, lay.dkp), dtype), ((BLOCK_K, lay.dvp), dtype), ((2, BLOCK_Q, lay.dkp), dtype),
         ((2, BLOCK_Q, lay.dvp), dtype), ((2, 2, BLOCK_Q), jnp.int32), ((2, 2, BLOCK_Q), jnp.float32)],
        _bands(first, last, lay.nk, BLOCK_Q), lay.lo_p, lay.hi_p, qv, kv, vv, dov, lse_h, delta_h,
        barriers=(1, 1, 2, 2, 8), name=name)
    if parts > 1:
        dk, dv = jnp.sum(dk, axis=0).astype(k.dtype), jnp.sum(dv, axis=0).astype(v.dtype)
    return (dq[:, :lay.T, :, :lay.dk], dk[:, :lay.NK, :, :lay.dk], dv[:, :lay.NK, :, :lay.dv])


def _dkdv_parts(lay, query_span):
    """How many programs share the walk of one key tile: enough for DKDV_PROGRAMS programs in all (the
    compressed branch has few key tiles, each seen by every query: B * H * NC / 64 programs would leave most
    of the GPU idle), each with at least DKDV_MIN_STEPS of the G * (query tiles) steps the tile may take
    (query_span: the most queries one key row sees, a static bound)."""
    programs = lay.nk * lay.H * lay.B
    steps = lay.G * (cdiv(min(query_span, lay.T) + BLOCK_K - 1, BLOCK_Q) + 1)
    return max(1, min(cdiv(DKDV_PROGRAMS, programs), steps // DKDV_MIN_STEPS))


@per_sequence
def attend(q, k, v, lo, hi, *, scale, key_span=None, name="flash"):
    """o [B, T, HQ, Dv] (q's dtype) and lse [B, T, HQ] float32 of query t over key rows [lo[t], hi[t]]:
    nsa/pallas/_flash.py's `attend` on Mosaic GPU. key_span is not used (each program walks its own band of
    key tiles); name names the branch. A symbolic batch runs once per sequence (`per_sequence`): no Mosaic
    GPU grid takes a symbolic dimension, and every kernel here has the batch in its grid."""
    del key_span
    check_dtype(q.dtype, name)
    return packed_attend(functools.partial(_attend, scale=scale, name=name), q, k, v, lo, hi)


@per_sequence
def attend_backward(q, k, v, lo, hi, o, lse, do, dlse=None, *, scale, query_span, key_span=None, name="flash"):
    """(dq, dk, dv) of `attend`; dlse [B, T, HQ] is lse's cotangent or None. query_span (static) bounds how many
    queries see one key row: it sets how many programs share a key tile's walk (`_dkdv_parts`); key_span is not
    used."""
    del key_span
    return packed_attend_backward(functools.partial(_attend_backward, scale=scale, name=name), q, k, v, lo, hi, o,
                                  lse, do, dlse, query_span=query_span)
