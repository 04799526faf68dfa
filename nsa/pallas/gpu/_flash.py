"""Flash attention over one interval of key rows per query, as Pallas Mosaic GPU kernels (NVIDIA Hopper).

The contract is that of ../tpu/_flash.py (the TPU kernels): query t sees the key rows [lo[t], hi[t]]
of k [B, NK, H, Dk] (lo, hi int32 [T], or [B, T] per batch row with a KV cache), non-decreasing in t, and a KV
cache's G query heads of a KV head run as G rows of one head (`nsa._plan.packs`). These are `plgpu.kernel`s
(one warpgroup of 128 threads per 64 rows, wgmma for the matmuls, TMA copies for every tile), which lower for
CUDA on any machine (`jax.export(..., platforms=["cuda"])`) and run with nothing but jax[cuda] (jax >= 0.11).

Layouts. q, o, do, dq stay [B, T, HQ, D] and k, v, dk, dv [B, NK, H, D]: a tile is a TMA copy of a strided
slice (`q.at[b, pl.ds(t0, BQ), hq]`), so nothing is transposed. D is padded to a multiple of 64 (the 128-byte
swizzle of a 2-byte row) and T, NK to a multiple of 8 rows (a TMA copy into a tiled shared-memory tile needs
it) and at least one tile: copies only for small or odd shapes (none at Dk = Dv = 128, T and NK multiples of 8,
at least 128). A tile reaching past the rows of the array reads zeros (TMA fills them) and its
stores there are dropped (TMA clips them). lo and hi are int32 [R, tp] (R = B with per-row ranges, else 1; tp
= T padded to a multiple of BQ, padded queries see nothing), lse and delta float32 [B, HQ, tp]: a tile's
slice of each is one 1-D TMA copy, loaded as a per-row (or per-column) vector of the wgmma layout.

Forward (`_forward_kernel`), grid (T / 2BQ, HQ, B), three warpgroups (FA3's split, as jax's attention_mgpu.py):
one program owns 2BQ = 128 queries of head hq; two consumer warpgroups take BQ = 64 each, and a producer
warpgroup copies the band of key tiles (`nsa._plan.bands`: the first and last key tile any of the 128 queries
sees, read as scalars from HBM) into `slots` buffers, refilling a slot once both consumers have released it; the
producer gives its registers to the consumers. s = q k^T (wgmma, [64, BK] float32), masked to [lo, hi], online
softmax in base 2, acc += p v. With a KV cache v's rows past the last one any query of the batch row sees are
zeroed in XLA first (`_seen_values`: they may hold NaN, and 0 * NaN is NaN).

Backward. `_dq_kernel`, grid (T / BQ, HQ, B), one warpgroup per BQ = 64 queries, recomputes p from lse: dq += ds
k with ds = p * (do v^T - delta) (k's rows past `ends` zeroed in shared memory). `_dkdv_kernel`, grid (NK / BK,
H, B * P), owns one key tile of a KV head and walks, for each of its G query heads, the query tiles that see it
(`query_ranges`, then `nsa._plan.bands` over the key tiles): s^T = k q^T, p^T, dv += p^T do, dp^T = v do^T, dk
+= ds^T q, all [BK, .] float32 in registers, in a fixed order (deterministic, no atomics). With few key tiles
(the compressed branch) P > 1 programs share that walk (`_dkdv_parts`: about `dkdv_waves` programs per SM of
the device), each storing float32 partial dk and dv that XLA adds in a fixed order. Masked entries of p^T and
ds^T are set to 0 with jnp.where, so a NaN key or value past `ends` reaches no result.

Tiles: `Config` (`default_config`'s unless given): BQ = 64 query rows (wgmma's M, one warpgroup), BK = 64 key
rows in dq and dk/dv, `forward_block_k` in the forward: 128 (fewer, longer steps) where its tiles fit the
device's shared memory, else BK. Shared memory per program (the largest, the forward, `forward_shared_memory`):
two q [64, Dkp] and two o [64, Dvp] tiles, `slots` k [BK, Dkp] and v [BK, Dvp] buffers in the input dtype, and
the ranges and lse: 193.5 KiB at Dk = Dv = 128 in bfloat16 with 128-row key tiles; it must fit the device's
shared memory per block (nsa._device.facts("cuda").shared_memory), which bounds the head dims.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nsa._config import Shapes, expect, positive, validated
from nsa._device import facts
from nsa._plan import band, bands, kernel_delta, packed_attend, packed_attend_backward, padded, padded_ranges
from nsa._varlen import cdiv, query_ranges, round_up
from nsa.pallas._batch import per_sequence
from nsa.pallas.gpu._common import (COLS, DTYPES, LN2, LOG2E, ROWS, by_col, by_row, call, check_dtype, iota,
                                    kernel_name, key_gradients, load_vector, matmul, matmul_add, padded_dim,
                                    pipelined, smem_tile, store, tma_rows, zero_rows_past)


@validated
class Config(NamedTuple):
    """The tiles and the split of the work (module docstring)."""

    block_q: int = 64  # query rows per tile: wgmma's M (one warpgroup)
    block_k: int = 64  # key rows per tile of the dq and dk/dv kernels
    # the forward's key tiles: 128 rows (fewer, longer steps; `default_config` takes block_k where two buffers of
    # 128 would not fit in shared memory beside q and o). A query whose visible keys fit one tile then takes its
    # softmax in one step, with no rescaling: a packed sequence's results equal its results alone (the varlen tests)
    forward_block_k: int = 128
    slots: int = 2  # the forward's key and value buffers, filled by its producer warpgroup
    consumer_registers: int = 232  # per thread of the forward's two consumer warpgroups (setmaxnreg)
    producer_registers: int = 40  # per thread of its producer, which gives the rest to the consumers
    # the dk/dv kernel splits a key tile's walk over several programs where there are few key tiles (the compressed
    # branch) so as to run about dkdv_waves programs per SM of the device, each part at least dkdv_min_steps steps
    dkdv_waves: int = 4
    dkdv_min_steps: int = 32

    def check(self):
        positive(self, *self._fields)
        for field in ("block_q", "block_k"):
            expect(getattr(self, field) == 64, self, field, "64 (wgmma's M: every tile is one warpgroup's)")
        expect(self.forward_block_k % 64 == 0 and self.forward_block_k <= 256, self, "forward_block_k",
               "a multiple of 64 of at most 256 (one TMA copy)")
        expect(self.slots >= 2, self, "slots", "at least 2")
        for field in ("consumer_registers", "producer_registers"):
            value = getattr(self, field)
            expect(value % 8 == 0 and 24 <= value <= 256, self, field, "a multiple of 8 in [24, 256] (setmaxnreg)")


def forward_shared_memory(config, dkp, dvp, itemsize):
    """The bytes of shared memory one program of the forward holds (the largest kernel): two q [BQ, Dkp] and two o
    [BQ, Dvp] tiles and `slots` key [BK, Dkp] and value [BK, Dvp] buffers of itemsize bytes (BK = forward_block_k),
    the ranges [2, 2, BQ] int32 and lse [2, BQ] float32, and its 4 + 4 * slots barriers (8 bytes each)."""
    bq, bk = config.block_q, config.forward_block_k
    tiles = 2 * bq * (dkp + dvp) + config.slots * bk * (dkp + dvp)
    return tiles * itemsize + (4 * bq + 2 * bq) * 4 + (4 + 4 * config.slots) * 8


def default_config(shapes: Shapes, dtype, device) -> Config:
    """The Config of q [B, T, HQ, Dk] against k [B, NK, H, Dk], v [B, NK, H, Dv] (`Shapes.of(q, k, v)`) in `dtype`
    on `device`: Config()'s, the tiles and split the recorded H200 runs used (benchmarks/results/gpu-pallas.json,
    the layer, and ops-65536-pallas.json, each op at T = 65536: the dk/dv split of the compressed branch was made
    for that run), with the forward's key tiles of block_k rows where two buffers of 128 would not fit in the
    device's shared memory beside q and o (`forward_shared_memory`: Dk + Dv above 256 on an H200)."""
    config = Config()
    dkp, dvp = padded_dim(shapes.Dk, dtype), padded_dim(shapes.Dv, dtype)
    if forward_shared_memory(config, dkp, dvp, jnp.dtype(dtype).itemsize) > device.shared_memory:
        config = config._replace(forward_block_k=config.block_k)
    return config


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
    tiles of the band into its `slots` buffers, refilling a slot once both have released it (k_free, v_free)."""
    i, hq, b, wg = (lax.axis_index(axis) for axis in ("tile", "head", "batch", "wg"))
    bq, slots = sh.cfg.block_q, sh.cfg.slots
    row = b if sh.per_row else 0
    h = lax.div(hq, sh.G)
    first, last = band(band_ref, row, i, sh.nq_forward)
    count = jnp.maximum(last - first + 1, 0)

    @pl.when(wg < 2)
    def _consume():
        plgpu.set_max_registers(sh.cfg.consumer_registers, action="increase")
        queries = pl.ds(i * (2 * bq) + wg * bq, bq)
        q_tile = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, queries, hq], q_tile, q_bar.at[wg])
        lo = load_vector(lo_ref.at[row, queries], ranges.at[wg, 0], vec_bar.at[wg], ROWS)
        hi = load_vector(hi_ref.at[row, queries], ranges.at[wg, 1], vec_bar.at[wg], ROWS)
        plgpu.barrier_wait(q_bar.at[wg])

        def step(s, carry):
            acc, m, l = carry
            slot = lax.rem(s, slots)
            plgpu.barrier_wait(k_bar.at[slot])
            logits = matmul(q_tile, k_smem.at[slot].transpose((1, 0)), (bq, sh.bk)) * (scale * LOG2E)
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

        init = (plgpu.layout_cast(jnp.zeros((bq, sh.dvp), jnp.float32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), ROWS),
                plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), ROWS))
        acc, m, l = lax.fori_loop(0, count, step, init)
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        store(acc / by_row(l_safe, acc.shape), o_smem.at[wg], o_ref.at[b, queries, hq])
        store(jnp.where(seen, (m + jnp.log2(l_safe)) * LN2, -jnp.inf), lse_smem.at[wg], lse_ref.at[b, hq, queries])

    @pl.when(wg == 2)
    def _produce():
        plgpu.set_max_registers(sh.cfg.producer_registers, action="decrease")

        def fetch(s, slot):
            keys = pl.ds(pl.multiple_of((first + s) * sh.bk, sh.bk), sh.bk)
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[slot], v_bar.at[slot])

        for s in range(slots):
            pl.when(s < count)(functools.partial(fetch, s, s))

        @pl.loop(slots, count)
        def _refill(s):
            slot = lax.rem(s, slots)
            keys = pl.ds(pl.multiple_of((first + s) * sh.bk, sh.bk), sh.bk)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[slot], k_bar.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[slot], v_bar.at[slot])


def _dq_kernel(band_ref, end_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem,
               do_smem, k_smem, v_smem, ranges, stats, q_bar, do_bar, vec_bar, k_bar, v_bar, *, sh, scale):
    i, hq, b = lax.axis_index("tile"), lax.axis_index("head"), lax.axis_index("batch")
    bq, bk = sh.cfg.block_q, sh.cfg.block_k
    row = b if sh.per_row else 0
    h = lax.div(hq, sh.G)
    queries = pl.ds(i * bq, bq)
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
        keys = pl.ds(pl.multiple_of((first + step) * bk, bk), bk)
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[slot], v_bar.at[slot])

    def step(s, slot, acc):
        first_key = (first + s) * bk
        plgpu.barrier_wait(k_bar.at[slot])
        zero_rows_past(k_smem.at[slot], first_key, end)
        logits = matmul(q_smem, k_smem.at[slot].transpose((1, 0)), (bq, bk)) * (scale * LOG2E)
        shape = logits.shape
        visible = _visible(first_key + iota(shape, 1), lo, hi, shape, 0) & by_row(seen, shape)
        p = jnp.where(visible, jnp.exp2(logits - by_row(lse2, shape)), 0.0)
        plgpu.barrier_wait(v_bar.at[slot])
        dp = matmul(do_smem, v_smem.at[slot].transpose((1, 0)), shape)
        ds = jnp.where(visible, p * (dp - by_row(delta, shape)), 0.0)
        return matmul_add(acc, ds.astype(q_smem.dtype), k_smem.at[slot])

    init = plgpu.layout_cast(jnp.zeros((bq, sh.dkp), jnp.float32), plgpu.Layout.WGMMA)
    acc = pipelined(last - first + 1, fetch, step, init)
    store(acc * scale, q_smem, dq_ref.at[b, queries, hq])


def _dkdv_kernel(band_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem,
                 v_smem, q_smem, do_smem, ranges, stats, k_bar, v_bar, q_bar, do_bar, vec_bar, *, sh, scale, parts):
    n, h = lax.axis_index("tile"), lax.axis_index("head")
    bq, bk = sh.cfg.block_q, sh.cfg.block_k
    b, part = lax.div(lax.axis_index("batch"), parts), lax.rem(lax.axis_index("batch"), parts)
    row = b if sh.per_row else 0
    keys = pl.ds(n * bk, bk)
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
        queries = pl.ds(pl.multiple_of((first + lax.rem(step, tiles)) * bq, bq), bq)
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
        logits_t = matmul(k_smem, q_smem.at[slot].transpose((1, 0)), (bk, bq)) * (scale * LOG2E)
        shape = logits_t.shape
        plgpu.barrier_wait(do_bar.at[slot])
        return key_gradients(dk, dv, logits_t, _visible(n * bk + iota(shape, 0), lo, hi, shape, 1), lse, delta,
                             q_smem.at[slot], do_smem.at[slot], v_smem)

    plgpu.barrier_wait(k_bar.at[0])
    plgpu.barrier_wait(v_bar.at[0])
    init = tuple(plgpu.layout_cast(jnp.zeros((bk, d), jnp.float32), plgpu.Layout.WGMMA) for d in (sh.dkp, sh.dvp))
    dk, dv = pipelined(count, fetch, step, init)
    if parts == 1:
        store(dk * scale, k_smem, dk_ref.at[b, keys, h])
        store(dv, v_smem, dv_ref.at[b, keys, h])
    else:  # float32 partial sums, added in XLA in part order
        for value, out, d in ((dk * scale, dk_ref, sh.dkp), (dv, dv_ref, sh.dvp)):
            pl.run_scoped(lambda smem: store(value, smem, out.at[part, b, keys, h]),
                          plgpu.SMEM((bk, d), jnp.float32))


class _Layout:
    """The static sizes of one call and the arrays its kernels take besides q, k, v (see the module
    docstring), for `config` on `device`."""

    def __init__(self, q, k, v, lo, hi, config, device):
        self.cfg, self.device = config, device
        self.B, self.T, self.HQ, self.dk = q.shape
        self.NK, self.H, self.dv = k.shape[1], k.shape[2], v.shape[3]
        self.G = self.HQ // self.H
        self.dkp, self.dvp = padded_dim(self.dk, q.dtype), padded_dim(self.dv, v.dtype)
        bq, bk = config.block_q, config.block_k
        self.tp = round_up(self.T, bq)
        self.nq, self.nk = self.tp // bq, max(1, cdiv(self.NK, bk))
        self.bk = config.forward_block_k  # the forward's key tile
        used = forward_shared_memory(config, self.dkp, self.dvp, jnp.dtype(q.dtype).itemsize)
        if used > device.shared_memory:
            raise ValueError(f"q, v: expected head dims Dk, Dv (each rounded up to 64) whose Mosaic GPU flash forward "
                             f"tiles (two {bq}-row q and o tiles, {config.slots} key and value tiles of {self.bk} "
                             f"rows) fit the {device.shared_memory} bytes of shared memory of a {device.kind} block, "
                             f"got Dk = {self.dk}, Dv = {self.dv} ({used} bytes)")
        self.per_row = lo.ndim == 2
        self.lo, self.hi = (x.astype(jnp.int32).reshape(-1, self.T) for x in (lo, hi))
        self.lo_p, self.hi_p = padded_ranges(self.lo, self.hi, self.tp)  # padded queries see nothing: lo 1, hi 0
        self.ends = jnp.max(self.hi, axis=1)  # [R]: the last key row any query of the batch row sees
        rows = 2 * bq  # the forward's queries per program
        self.tp_forward = round_up(self.T, rows)
        self.nq_forward = self.tp_forward // rows
        self.lo_forward, self.hi_forward = padded_ranges(self.lo, self.hi, self.tp_forward)

    def queries(self, x, d):
        return tma_rows(padded(x, 3, d), self.cfg.block_q)

    def keys(self, x, d):
        return tma_rows(padded(x, 3, d), self.bk)

    def by_head(self, x):
        """[B, T, HQ] -> [B, HQ, tp] float32, the layout of lse and delta in the kernels."""
        return padded(jnp.transpose(x.astype(jnp.float32), (0, 2, 1)), 2, self.tp)


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


def _config(config, q, k, v, device):
    return config if config is not None else default_config(Shapes.of(q, k, v), q.dtype, device)


def _attend(q, k, v, lo, hi, *, scale, config, name):
    device = facts("cuda")
    lay = _Layout(q, k, v, lo, hi, _config(config, q, k, v, device), device)
    bq, slots = lay.cfg.block_q, lay.cfg.slots
    qv, kv, vv = lay.queries(q, lay.dkp), lay.keys(k, lay.dkp), lay.keys(_seen_values(v, lay), lay.dvp)
    dtype = q.dtype
    o, lse = _call(
        functools.partial(_forward_kernel, sh=lay, scale=float(scale)), (lay.nq_forward, lay.HQ, lay.B),
        (jax.ShapeDtypeStruct(qv.shape[:3] + (lay.dvp,), dtype),
         jax.ShapeDtypeStruct((lay.B, lay.HQ, lay.tp_forward), jnp.float32)),
        [((2, bq, lay.dkp), dtype), ((slots, lay.bk, lay.dkp), dtype), ((slots, lay.bk, lay.dvp), dtype),
         ((2, bq, lay.dvp), dtype), ((2, 2, bq), jnp.int32), ((2, bq), jnp.float32)],
        bands(lay.lo_forward, lay.hi_forward, lay.nq_forward, lay.bk), lay.lo_forward, lay.hi_forward, qv, kv, vv,
        barriers=(2, 2, slots, slots, (slots, 2), (slots, 2)), name=name, num_threads=3, thread_name="wg")
    return o[:, :lay.T, :, :lay.dv], jnp.transpose(lse[:, :, :lay.T], (0, 2, 1))


def _attend_backward(q, k, v, lo, hi, o, lse, do, dlse, *, scale, query_span, config, name):
    device = facts("cuda")
    lay = _Layout(q, k, v, lo, hi, _config(config, q, k, v, device), device)
    bq, bk = lay.cfg.block_q, lay.cfg.block_k
    dtype = q.dtype
    delta = kernel_delta(o, do, dtype, lse, dlse)
    qv, kv, vv = lay.queries(q, lay.dkp), lay.keys(k, lay.dkp), lay.keys(v, lay.dvp)
    dov = lay.queries(do.astype(dtype), lay.dvp)
    lse_h, delta_h = lay.by_head(lse), lay.by_head(delta)
    dq = _call(
        functools.partial(_dq_kernel, sh=lay, scale=float(scale)), (lay.nq, lay.HQ, lay.B),
        jax.ShapeDtypeStruct(qv.shape, dtype),
        [((bq, lay.dkp), dtype), ((bq, lay.dvp), dtype), ((2, bk, lay.dkp), dtype),
         ((2, bk, lay.dvp), dtype), ((2, bq), jnp.int32), ((2, bq), jnp.float32)],
        bands(lay.lo_p, lay.hi_p, lay.nq, bk), lay.ends, lay.lo_p, lay.hi_p, qv, kv, vv, dov, lse_h, delta_h,
        barriers=(1, 1, 1, 2, 2), name=name)
    first, last = query_ranges(lay.lo, lay.hi, lay.nk * bk)  # the queries that see each key row
    parts = _dkdv_parts(lay, query_span)
    out = lambda x, dtype: jax.ShapeDtypeStruct(x.shape if parts == 1 else (parts,) + x.shape,
                                                dtype if parts == 1 else jnp.float32)
    dk, dv = _call(
        functools.partial(_dkdv_kernel, sh=lay, scale=float(scale), parts=parts), (lay.nk, lay.H, lay.B * parts),
        (out(kv, k.dtype), out(vv, v.dtype)),
        [((bk, lay.dkp), dtype), ((bk, lay.dvp), dtype), ((2, bq, lay.dkp), dtype),
         ((2, bq, lay.dvp), dtype), ((2, 2, bq), jnp.int32), ((2, 2, bq), jnp.float32)],
        bands(first, last, lay.nk, bq), lay.lo_p, lay.hi_p, qv, kv, vv, dov, lse_h, delta_h,
        barriers=(1, 1, 2, 2, 8), name=name)
    if parts > 1:
        dk, dv = jnp.sum(dk, axis=0).astype(k.dtype), jnp.sum(dv, axis=0).astype(v.dtype)
    return (dq[:, :lay.T, :, :lay.dk], dk[:, :lay.NK, :, :lay.dk], dv[:, :lay.NK, :, :lay.dv])


def _dkdv_parts(lay, query_span):
    """How many programs share the walk of one key tile: enough for dkdv_waves programs per SM of the device in
    all (the compressed branch has few key tiles, each seen by every query: B * H * NC / 64 programs would leave
    most of the GPU idle), each with at least dkdv_min_steps of the G * (query tiles) steps the tile may take
    (query_span: the most queries one key row sees, a static bound)."""
    bq, bk = lay.cfg.block_q, lay.cfg.block_k
    programs = lay.nk * lay.H * lay.B
    steps = lay.G * (cdiv(min(query_span, lay.T) + bk - 1, bq) + 1)
    return max(1, min(cdiv(lay.cfg.dkdv_waves * lay.device.cores, programs), steps // lay.cfg.dkdv_min_steps))


@per_sequence
def attend(q, k, v, lo, hi, *, scale, config=None, name="flash"):
    """o [B, T, HQ, Dv] (q's dtype) and lse [B, T, HQ] float32 of query t over key rows [lo[t], hi[t]]:
    ../tpu/_flash.py's `attend` on Mosaic GPU (bfloat16, float16). config: a Config (None:
    `default_config` for this process's CUDA device, nsa._device.facts("cuda")); name names the branch. A symbolic
    batch runs once per sequence (`per_sequence`): no Mosaic GPU grid takes a symbolic dimension, and every kernel
    here has the batch in its grid."""
    check_dtype(q.dtype, "q")
    return packed_attend(functools.partial(_attend, scale=scale, config=config, name=name), q, k, v, lo, hi)


@per_sequence
def attend_backward(q, k, v, lo, hi, o, lse, do, dlse=None, *, scale, query_span, config=None, name="flash"):
    """(dq, dk, dv) of `attend`; dlse [B, T, HQ] is lse's cotangent or None. query_span (static) bounds how many
    queries see one key row: it sets how many programs share a key tile's walk (`_dkdv_parts`)."""
    return packed_attend_backward(functools.partial(_attend_backward, scale=scale, config=config, name=name), q, k,
                                  v, lo, hi, o, lse, do, dlse, query_span=query_span)
