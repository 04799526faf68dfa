"""Flash attention over one interval of key rows per query, as a Pallas TPU (Mosaic) kernel.

The sliding-window and compressed branches differ only in which keys a query sees, and in both the
visible key rows of query t form one interval [lo[t], hi[t]] (empty when lo > hi), non-decreasing in t
(nsa/triton/_flash.py has the same decomposition): the window's keys are k [B, T, H, Dk] with lo =
max(sequence start, t - window_size + 1), hi = t; the compressed branch's are k_cmp [B, NC, H, Dk] with
lo = the sequence's first row, hi = lo + (pos + 1) // block_size - 1.

This module holds the forward (`attend`); its backward is to come, and until then no op dispatches to it.

Layouts. The kernel reads q, k and v as [B, T, H * Dp] views (Dp = the head dim padded to a multiple of
128 lanes inside the op: no copy when it already is one, as at Dk = Dv = 128), so a block (1, BQ, Dp) at
column h is head h, with no transpose; T is padded to a multiple of the tiles (padded queries see
nothing, padded keys are never visible). lo and hi travel as one int32 [T, 2] array, and lse is written
lane-broadcast, [B, HQ, T, 128] (Mosaic's (8, 128) tiling), then returned as [B, T, HQ].

Grid: (B, HQ, T / BQ, STEPS). One program owns the BQ queries of one query tile of one head hq, against
KV head hq // G: it walks STEPS key tiles of BK rows from the first one any of its queries sees (both
ends per query tile are scalar-prefetched into SMEM); a step past the tile's last key tile re-maps to it
(so no new DMA is issued) and is skipped. Online softmax in float32 (natural exp on TPU).

VMEM per step (`vmem_bytes`; the pipeline double-buffers each block): q [BQ, Dkp], k [BK, Dkp], v
[BK, Dvp] and o [BQ, Dvp] in the input dtype, lo/hi [BQ, 2] int32 and lse [BQ, 128] float32, plus the
float32 scratch m, l [BQ, 128] and acc [BQ, Dvp]. At BQ = BK = 128, Dkp = Dvp = 128 in bf16: 2 * (4 * 32
+ 1 + 64) KiB + 3 * 64 KiB = 578 KiB, far inside the scoped VMEM limit of every TPU (16 MiB or more).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128  # a vreg's lanes: the minor dim of every block is a multiple of it (or the whole dim)


class Config(NamedTuple):
    """The tiles: BQ queries and BK key rows."""

    block_q: int = 128
    block_k: int = 128


def _cdiv(a, b):
    return -(-a // b)


def _padded(x, axis, size):
    """x zero-padded along `axis` to `size` (x itself when it already has that size)."""
    missing = size - x.shape[axis]
    return x if missing == 0 else jnp.pad(x, [(0, missing if a == axis else 0) for a in range(x.ndim)])


def _kernel(band_ref, range_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, *, scale, block_k,
            steps, precision):
    i, j = pl.program_id(2), pl.program_id(3)
    num_q_tiles = pl.num_programs(2)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    key_tile = band_ref[i] + j

    @pl.when(key_tile <= band_ref[num_q_tiles + i])
    def _step():
        q, k, v = q_ref[0], k_ref[0], v_ref[0]  # [BQ, Dkp], [BK, Dkp], [BK, Dvp]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [BQ, BK]
        rows = range_ref[...]  # [BQ, 2]: lo, hi
        key = key_tile * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where((key >= rows[:, :1]) & (key <= rows[:, 1:]), s, -jnp.inf)
        m_prev = m_scr[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet: no NaN
        alpha = jnp.exp(m_prev - m_use)
        p = jnp.exp(s - m_use)
        l_new = l_scr[...][:, :1] * alpha + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        acc_scr[...] = acc_scr[...] * alpha + pv
        m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)
        l_scr[...] = jnp.broadcast_to(l_new, l_scr.shape)

    @pl.when(j == steps - 1)
    def _store():
        l = l_scr[...][:, :1]
        seen = l > 0
        o_ref[0] = (acc_scr[...] / jnp.where(seen, l, 1.0)).astype(o_ref.dtype)
        lse = jnp.where(seen, m_scr[...][:, :1] + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        lse_ref[0, 0] = jnp.broadcast_to(lse, lse_ref.shape[2:])


def _bands(lo, hi, num_q_tiles, config):
    """int32 [2 * num_q_tiles]: the first key tile any query of each query tile sees, then the last (0 and
    -1 for a tile whose queries see nothing)."""
    seen = (lo <= hi).reshape(num_q_tiles, config.block_q)
    first = jnp.min(jnp.where(seen, lo.reshape(seen.shape), jnp.iinfo(jnp.int32).max), axis=1)
    last = jnp.max(jnp.where(seen, hi.reshape(seen.shape), -1), axis=1)
    any_seen = jnp.any(seen, axis=1)
    return jnp.concatenate([jnp.where(any_seen, first // config.block_k, 0),
                            jnp.where(any_seen, last // config.block_k, -1)]).astype(jnp.int32)


def vmem_bytes(dk, dv, itemsize, config=Config()):
    """The VMEM one grid step holds: every block double-buffered, plus the float32 scratch."""
    bq, bk = config.block_q, config.block_k
    dkp, dvp = _cdiv(dk, LANES) * LANES, _cdiv(dv, LANES) * LANES
    blocks = (bq * dkp + bk * dkp + bk * dvp + bq * dvp) * itemsize + bq * 2 * 4 + bq * LANES * 4
    return 2 * blocks + (2 * bq * LANES + bq * dvp) * 4


def attend(q, k, v, lo, hi, *, scale, key_span, interpret=False, config=Config()):
    """o [B, T, HQ, Dv] (q's dtype) and lse [B, T, HQ] float32 of query t over key rows [lo[t], hi[t]].

    q [B, T, HQ, Dk], k [B, NK, H, Dk], v [B, NK, H, Dv]; lo, hi int32 [T], non-decreasing. key_span
    (static) bounds the key rows one tile of BQ queries can see: it sets the steps of the grid.
    interpret: a pltpu.InterpretParams to run in Pallas's TPU interpret mode (on any platform), or False.
    """
    B, T, HQ, dk = q.shape
    NK, H, dv = k.shape[1], k.shape[2], v.shape[3]
    bq, bk = config
    dkp, dvp = _cdiv(dk, LANES) * LANES, _cdiv(dv, LANES) * LANES
    tp, nkp = _cdiv(T, bq) * bq, max(1, _cdiv(NK, bk)) * bk
    steps = min(_cdiv(key_span, bk) + 1, nkp // bk)
    lo = _padded(lo.astype(jnp.int32), 0, tp) + jnp.where(jnp.arange(tp) < T, 0, 1)  # padded: lo = 1 > hi = 0
    hi = _padded(hi.astype(jnp.int32), 0, tp)
    view = lambda x, t, d: _padded(_padded(x, 3, d), 1, t).reshape(B, t, x.shape[2] * d)
    G = HQ // H

    def key_map(b, h, i, j, band):  # the clamped key tile: a skipped step re-maps to the last one
        return b, jnp.minimum(band[i] + j, jnp.maximum(band[tp // bq + i], band[i])), lax.div(h, G)

    o, lse = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), block_k=bk, steps=steps,
                          precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B, HQ, tp // bq, steps),
            in_specs=[pl.BlockSpec((bq, 2), lambda b, h, i, j, band: (i, 0)),
                      pl.BlockSpec((1, bq, dkp), lambda b, h, i, j, band: (b, i, h)),
                      pl.BlockSpec((1, bk, dkp), key_map),
                      pl.BlockSpec((1, bk, dvp), key_map)],
            out_specs=[pl.BlockSpec((1, bq, dvp), lambda b, h, i, j, band: (b, i, h)),
                       pl.BlockSpec((1, 1, bq, LANES), lambda b, h, i, j, band: (b, h, i, 0))],
            scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                            pltpu.VMEM((bq, dvp), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((B, tp, HQ * dvp), q.dtype),
                   jax.ShapeDtypeStruct((B, HQ, tp, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(_bands(lo, hi, tp // bq, config), jnp.stack([lo, hi], axis=1), view(q, tp, dkp), view(k, nkp, dkp),
      view(v, nkp, dvp))
    o = o.reshape(B, tp, HQ, dvp)[:, :T, :, :dv]
    return o, jnp.transpose(lse[:, :, :T, 0], (0, 2, 1))
