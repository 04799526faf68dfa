"""Flash attention over one interval of key rows per query, as a Pallas TPU (Mosaic) kernel.

The sliding-window and compressed branches differ only in which keys a query sees, and in both the
visible key rows of query t form one interval [lo[t], hi[t]] (empty when lo > hi), non-decreasing in t
(nsa/triton/_flash.py has the same decomposition): the window's keys are k [B, NK, H, Dk] with lo =
max(sequence start, p - window_size + 1), hi = p (p: the query's key row); the compressed branch's are
k_cmp [B, NC, H, Dk] with lo = the sequence's first row, hi = lo + (pos + 1) // block_size - 1. lo and hi
are [T], shared by the batch, or [B, T], per batch row: with a KV cache (kv_lens) query t of batch row b
sits at key row p = kv_lens[b] - T + t, and k holds NK >= T rows, those past the sequence holding anything
(NaN included). A key tile's rows past the last one any query of its batch row sees (`ends`) are zeroed
when loaded, in every kernel: a probability of 0 times a NaN key or value would still reach a result.

`attend` is the forward, `attend_backward` the backward (dq, dk, dv; the lse cotangent folds into delta).
With per-row ranges (a KV cache: a decode step's one or few queries per sequence) both first pack the G
query heads of each KV head as G consecutive rows of one head (`nsa._plan.packs`): the grid then has H heads,
a query tile holds the group's rows of BQ / G tokens, and each KV head's keys are read once per tile
instead of once per query head (G times); o, lse and the gradients are unpacked after.

Layouts. The kernel reads q as a [B, T, HQ * Dp] view and k, v as [B, NK, H * Dp] ones (Dp = the head dim
padded to a multiple of 128 lanes inside the op: no copy when it already is one, as at Dk = Dv = 128), so a
block (1, BQ, Dp) at column h is head h, with no transpose. T is padded to a multiple of BQ (padded queries see
nothing); k and v are not (only NK < BK is padded to one tile): copying a long KV cache every decode step is
what the op must not do. The last key tile may reach past NK, and the BlockSpec pipeline fills its rows past
the array with unspecified values, which `_seen_keys` zeroes (the dk/dv kernel's writes there are dropped).
lo and hi travel as one int32 [1 or B, T, 2] array, read as (BQ, 2) blocks; lse and delta as [B, HQ, T, 1]
float32 (a (BQ, 1) block is tile-legal: its minor dim is the whole dim), returned as [B, T, HQ].

Grid: (B, HQ, T / BQ, STEPS). One program owns the BQ queries of one query tile of one head hq, against
KV head hq // G: it walks STEPS key tiles of BK rows from the first one any of its queries sees (STEPS from
key_span, the most key rows one query sees). Scalar prefetch into SMEM: both ends of each query tile's band
of key tiles (`nsa._plan.bands`: one flat int32 array, per batch row with per-row ranges) and `ends` (int32
[1 or B]); a step past the tile's last key tile re-maps to it (so no new DMA is issued) and is skipped.
Online softmax in float32 (natural exp on TPU).

Backward. `_dq_kernel` runs on the forward's grid and tiles, recomputing p from lse. `_dkdv_kernel` runs on
(B, H, NK / BK, G, QSTEPS): one program owns a key tile of one KV head and walks, for each of its G query
heads, the query tiles that see it (the query interval of each key row follows from lo and hi, which
are non-decreasing: `query_ranges`; per batch row with per-row ranges), accumulating dk and dv in float32
VMEM scratch in a fixed order (deterministic, no atomics), stored at its last step.

Tiles: `Config` (BQ = block_q queries, BK = block_k key rows), `default_config`'s unless given.

VMEM per step (`vmem_bytes`, the largest of the three kernels; the pipeline double-buffers each block):
the dk/dv kernel's q, k [., Dkp], v, do [., Dvp] in the input dtype, lo/hi [BQ, 2] int32 and lse, delta
[BQ, 1] float32 (each padded to 128 lanes in VMEM), plus the float32 scratch dk [BK, Dkp], dv [BK, Dvp]
and its outputs. At BQ = BK = 128, Dkp = Dvp = 128 in bf16 that is under 1 MiB, far inside the scoped
VMEM limit of every TPU (16 MiB or more); it depends on neither T nor NK (these only set the grid and the
SMEM bands: 2 ints per tile, per batch row with per-row ranges).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nsa._config import Shapes, expect, positive, validated
from nsa._device import facts
from nsa._plan import band, bands, kernel_delta, packed_attend, packed_attend_backward, padded, padded_ranges
from nsa._varlen import cdiv, query_ranges, round_up
from nsa.pallas._batch import per_sequence
from nsa.pallas.tpu._common import batch_row, clamped, dot, lane_padded, lanes, out_struct, params, view


@validated
class Config(NamedTuple):
    """The tiles: BQ queries and BK key rows."""

    block_q: int = 128
    block_k: int = 128

    def check(self):
        positive(self, "block_q", "block_k")
        expect(self.block_q % facts("tpu").sublanes == 0, self, "block_q", "a multiple of the sublanes (8)")
        expect(self.block_k % lanes() == 0, self, "block_k", "a multiple of the lanes (128): the logits' minor dim")


def default_config(shapes: Shapes, dtype, device) -> Config:
    """The tiles for `shapes` on `device`: 128 x 128 at every shape, one MXU pass of M = N = 128 per matmul. Not
    measured on a TPU yet (none here): benchmarks/tpu_roofline.py models these kernels at these tiles."""
    del shapes, dtype, device
    return Config()


def _config(config, q, k, v):
    """config, or the default_config of q [B, T, HQ, Dk], k [B, NK, H, Dk], v [B, NK, H, Dv] (B may be
    symbolic)."""
    if config is not None:
        return config
    shapes = Shapes(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    return default_config(shapes, q.dtype, facts("tpu"))


def _seen_keys(k, v, key_tile, block_k, end):
    """k [BK, Dkp], v [BK, Dvp] of key tile `key_tile` with the rows past `end` (the last key row any query of
    the batch row sees) zeroed: they may hold anything (a KV cache's rows past a sequence, its incomplete
    compressed blocks), and a probability of 0 times NaN would still reach p v and do v^T."""
    key = key_tile * block_k + lax.broadcasted_iota(jnp.int32, (k.shape[0], 1), 0)
    keep = key <= end
    return jnp.where(keep, k, jnp.zeros_like(k)), jnp.where(keep, v, jnp.zeros_like(v))


def _kernel(band_ref, end_ref, range_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, *, scale,
            block_k, steps, per_row, precision):
    row, i, j = batch_row(pl.program_id(0), per_row), pl.program_id(2), pl.program_id(3)
    first, last = band(band_ref, row, i, pl.num_programs(2))

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    key_tile = first + j

    @pl.when(key_tile <= last)
    def _step():
        k, v = _seen_keys(k_ref[0], v_ref[0], key_tile, block_k, end_ref[row])  # [BK, Dkp], [BK, Dvp]
        s = dot(q_ref[0], k, precision, transpose_b=True) * scale  # [BQ, BK]
        rows = range_ref[0]  # [BQ, 2]: lo, hi
        key = key_tile * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where((key >= rows[:, :1]) & (key <= rows[:, 1:]), s, -jnp.inf)
        m_prev = m_scr[...][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet: no NaN
        alpha = jnp.exp(m_prev - m_use)
        p = jnp.exp(s - m_use)
        l_new = l_scr[...][:, :1] * alpha + jnp.sum(p, axis=1, keepdims=True)
        acc_scr[...] = acc_scr[...] * alpha + dot(p.astype(v.dtype), v, precision)
        m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)
        l_scr[...] = jnp.broadcast_to(l_new, l_scr.shape)

    @pl.when(j == steps - 1)
    def _store():
        l = l_scr[...][:, :1]
        seen = l > 0
        o_ref[0] = (acc_scr[...] / jnp.where(seen, l, 1.0)).astype(o_ref.dtype)
        lse = jnp.where(seen, m_scr[...][:, :1] + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        lse_ref[0, 0] = lse


def _grad_logits(q, k, v, do, rows, key_tile, lse, delta, *, scale, block_k, precision):
    """p and ds = p * (do v^T - delta), [BQ, BK] float32, of the query tile q [BQ, Dkp] (with do [BQ, Dvp],
    lse and delta [BQ, 1]) against the key tile k [BK, Dkp], v [BK, Dvp]: p recomputed from lse, 0 where a
    query sees nothing or the key row is outside its [lo, hi] (rows [BQ, 2])."""
    s = dot(q, k, precision, transpose_b=True) * scale
    key = key_tile * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    seen = lse > -jnp.inf
    visible = (key >= rows[:, :1]) & (key <= rows[:, 1:]) & seen
    p = jnp.where(visible, jnp.exp(s - jnp.where(seen, lse, 0.0)), 0.0)
    return p, p * (dot(do, v, precision, transpose_b=True) - delta)


def _dq_kernel(band_ref, end_ref, range_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, acc_scr, *,
               scale, block_k, steps, per_row, precision):
    row, i, j = batch_row(pl.program_id(0), per_row), pl.program_id(2), pl.program_id(3)
    first, last = band(band_ref, row, i, pl.num_programs(2))

    @pl.when(j == 0)
    def _init():
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    key_tile = first + j

    @pl.when(key_tile <= last)
    def _step():
        k, v = _seen_keys(k_ref[0], v_ref[0], key_tile, block_k, end_ref[row])
        _, ds = _grad_logits(q_ref[0], k, v, do_ref[0], range_ref[0], key_tile, lse_ref[0, 0], delta_ref[0, 0],
                             scale=scale, block_k=block_k, precision=precision)
        acc_scr[...] += dot(ds.astype(k.dtype), k, precision)

    @pl.when(j == steps - 1)
    def _store():
        dq_ref[0] = (acc_scr[...] * scale).astype(dq_ref.dtype)


def _dkdv_kernel(band_ref, end_ref, range_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                 dk_scr, dv_scr, *, scale, block_k, steps, per_row, precision):
    row, n, g, s = batch_row(pl.program_id(0), per_row), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    first, last = band(band_ref, row, n, pl.num_programs(2))

    @pl.when((g == 0) & (s == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    @pl.when(first + s <= last)
    def _step():
        q, do = q_ref[0], do_ref[0]
        k, v = _seen_keys(k_ref[0], v_ref[0], n, block_k, end_ref[row])
        p, ds = _grad_logits(q, k, v, do, range_ref[0], n, lse_ref[0, 0], delta_ref[0, 0], scale=scale,
                             block_k=block_k, precision=precision)  # [BQ, BK]
        dv_scr[...] += dot(p.T.astype(do.dtype), do, precision)
        dk_scr[...] += dot(ds.T.astype(q.dtype), q, precision)

    @pl.when((g == pl.num_programs(3) - 1) & (s == steps - 1))
    def _store():
        dk_ref[0] = (dk_scr[...] * scale).astype(dk_ref.dtype)
        dv_ref[0] = dv_scr[...].astype(dv_ref.dtype)


def vmem_bytes(dk, dv, itemsize, config=None):
    """The VMEM one grid step of the dk/dv kernel (the largest) holds: every block double-buffered (int32
    and (BQ, 1) float32 blocks padded to the lanes), plus the float32 scratch. T and NK do not enter it.
    config: the tiles (None: `Config()`)."""
    bq, bk = config or Config()
    lane = lanes()
    dkp, dvp = lane_padded(dk), lane_padded(dv)
    blocks = (bq * dkp + bk * dkp + bk * dvp + bq * dvp + bk * dkp + bk * dvp) * itemsize + 3 * bq * lane * 4
    return 2 * blocks + (bk * dkp + bk * dvp) * 4


class _Layout(NamedTuple):
    """The padded sizes, views and ranges the kernels take (see the module docstring)."""

    tp: int  # T padded to a multiple of BQ
    nkp: int  # NK padded to a multiple of BK: the key tiles of the grid
    nkv: int  # the rows of the k, v views: NK, or BK when NK < BK (no copy of a long cache)
    dkp: int
    dvp: int
    per_row: bool  # lo, hi per batch row (a KV cache), else shared by the batch
    lo: jax.Array  # int32 [R, T], R = B with per-row ranges, else 1
    hi: jax.Array  # int32 [R, T]
    rows: jax.Array  # int32 [R, tp, 2]: lo, hi (padded queries: 1, 0)
    ends: jax.Array  # int32 [R]: the last key row any query of the batch row sees (later rows are zeroed)


def _layout(q, k, v, lo, hi, config):
    T, NK = q.shape[1], k.shape[1]
    tp, nkp = round_up(T, config.block_q), max(1, cdiv(NK, config.block_k)) * config.block_k
    nkv = max(NK, config.block_k)
    per_row = lo.ndim == 2
    lo, hi = (x.astype(jnp.int32).reshape(-1, T) for x in (lo, hi))
    rows = jnp.stack(padded_ranges(lo, hi, tp), axis=2)
    return _Layout(tp, nkp, nkv, lane_padded(q.shape[3]), lane_padded(v.shape[3]), per_row, lo, hi, rows,
                   jnp.max(hi, axis=1))


def _by_head(x, tp):
    """[B, T, HQ] float32 -> [B, HQ, tp, 1], the layout of lse and delta in the kernels."""
    return padded(jnp.transpose(x.astype(jnp.float32), (0, 2, 1)), 2, tp)[..., None]


def _query_grid(kernel, q, k, v, lay, extra, outputs, scratch, *, scale, key_span, interpret, config, name):
    """pallas_call of the forward or the dq kernel on the query grid (B, HQ, tp / BQ, STEPS).

    The kernel takes the key bands and ends (scalar prefetch), rows, q, k, v, then `extra`: (array, width)
    pairs, read per query tile of a head: [B, tp, HQ * width] views for width > 0, [B, HQ, tp, 1] ones for
    width 0; `outputs` are (ShapeDtypeStruct, width) pairs of the same kinds.
    """
    B, _, HQ, _ = q.shape
    G = HQ // k.shape[2]
    bq, bk = config
    nq = lay.tp // bq
    steps = min(cdiv(bq + key_span - 1, bk) + 1, lay.nkp // bk)  # a tile's queries see bq + key_span - 1 rows
    table = bands(lay.rows[..., 0], lay.rows[..., 1], nq, bk)

    def key_map(b, h, i, j, table, ends):
        return b, clamped(*band(table, batch_row(b, lay.per_row), i, nq), j), lax.div(h, G)

    def spec(width):
        if width:
            return pl.BlockSpec((1, bq, width), lambda b, h, i, j, *_: (b, i, h))
        return pl.BlockSpec((1, 1, bq, 1), lambda b, h, i, j, *_: (b, h, i, 0))

    compiler, dots = params(q, interpret, ("parallel", "parallel", "parallel", "arbitrary"))
    return pl.pallas_call(
        functools.partial(kernel, scale=float(scale), block_k=bk, steps=steps, per_row=lay.per_row, **dots),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, HQ, nq, steps),
            in_specs=[pl.BlockSpec((1, bq, 2), lambda b, h, i, j, *_: (batch_row(b, lay.per_row), i, 0)),
                      spec(lay.dkp), pl.BlockSpec((1, bk, lay.dkp), key_map), pl.BlockSpec((1, bk, lay.dvp), key_map)]
            + [spec(width) for _, width in extra],
            out_specs=[spec(width) for _, width in outputs], scratch_shapes=scratch),
        out_shape=[shape for shape, _ in outputs], name=name, **compiler,
    )(table, lay.ends, lay.rows, view(q, lay.tp, lay.dkp), view(k, lay.nkv, lay.dkp), view(v, lay.nkv, lay.dvp),
      *[x for x, _ in extra])


def attend(q, k, v, lo, hi, *, scale, key_span, interpret=False, config=None, name="flash"):
    """o [B, T, HQ, Dv] (q's dtype) and lse [B, T, HQ] float32 of query t over key rows [lo[t], hi[t]].

    q [B, T, HQ, Dk], k [B, NK, H, Dk], v [B, NK, H, Dv]; lo, hi int32 [T] (shared by the batch) or [B, T]
    (per batch row), non-decreasing in t. key_span (static) bounds the key rows one query sees (a tile of BQ
    queries sees at most BQ + key_span - 1): it sets the steps of the grid. interpret: a pltpu.InterpretParams
    to run in Pallas's TPU interpret mode (on any platform), or False. config: a Config (None: `default_config`).
    name: the branch, which names the kernel (`{name}_forward`). With per-row ranges the G query heads of a KV
    head run as the rows of one head (`nsa._plan.packs`): a tile of BQ rows then spans BQ / G tokens, within
    the bound; and a symbolic batch runs once per sequence (`_per_row_batch`).
    """
    run = functools.partial(packed_attend, functools.partial(_attend, scale=scale, key_span=key_span,
                                                             interpret=interpret, config=config, name=name))
    return _per_row_batch(run, lo)(q, k, v, lo, hi)


def _per_row_batch(fn, lo):
    """fn, run once per sequence for a symbolic batch (`per_sequence`) with per-row ranges: their SMEM bands and
    ends are [B * ...] tables, which Pallas's TPU lowering takes only static. Ranges shared by the batch leave it
    in the grid alone."""
    return per_sequence(fn) if lo.ndim == 2 else fn


def _attend(q, k, v, lo, hi, *, scale, key_span, interpret, config, name):
    config = _config(config, q, k, v)
    B, T, HQ, _ = q.shape
    dv = v.shape[3]
    lay = _layout(q, k, v, lo, hi, config)
    bq = config.block_q
    o, lse = _query_grid(
        _kernel, q, k, v, lay, [],
        [(out_struct((B, lay.tp, HQ * lay.dvp), q.dtype, q), lay.dvp),
         (out_struct((B, HQ, lay.tp, 1), jnp.float32, q), 0)],
        [pltpu.VMEM((bq, lanes()), jnp.float32), pltpu.VMEM((bq, lanes()), jnp.float32),
         pltpu.VMEM((bq, lay.dvp), jnp.float32)],
        scale=scale, key_span=key_span, interpret=interpret, config=config, name=f"{name}_forward")
    return o.reshape(B, lay.tp, HQ, lay.dvp)[:, :T, :, :dv], jnp.transpose(lse[:, :, :T, 0], (0, 2, 1))


def attend_backward(q, k, v, lo, hi, o, lse, do, dlse=None, *, scale, key_span, query_span, interpret=False,
                    config=None, name="flash"):
    """(dq, dk, dv) of `attend`, in q's, k's and v's dtypes; dlse [B, T, HQ] is lse's cotangent or None.

    key_span as for `attend`; query_span (static) bounds how many queries see one key row: it sets the
    steps of the dk/dv grid. The kernels are named `{name}_dq` and `{name}_dkdv`. Packed as `attend` is
    (then G times as many rows see one key row), and once per sequence as it is.
    """
    run = functools.partial(packed_attend_backward, functools.partial(
        _attend_backward, scale=scale, key_span=key_span, interpret=interpret, config=config, name=name))
    return _per_row_batch(run, lo)(q, k, v, lo, hi, o, lse, do, dlse, query_span=query_span)


def _attend_backward(q, k, v, lo, hi, o, lse, do, dlse, *, scale, key_span, query_span, interpret, config,
                     name):
    config = _config(config, q, k, v)
    B, T, HQ, dk_dim = q.shape
    NK, H, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    G = HQ // H
    bq, bk = config
    lay = _layout(q, k, v, lo, hi, config)
    # the pre-pass: ds = p * (dp - delta), with the lse path folded into delta
    delta = kernel_delta(o, do, q.dtype, lse, dlse)
    do = do.astype(q.dtype)
    lse_h, delta_h, do_v = _by_head(lse, lay.tp), _by_head(delta, lay.tp), view(do, lay.tp, lay.dvp)
    [dq] = _query_grid(
        _dq_kernel, q, k, v, lay, [(do_v, lay.dvp), (lse_h, 0), (delta_h, 0)],
        [(out_struct((B, lay.tp, HQ * lay.dkp), q.dtype, q), lay.dkp)],
        [pltpu.VMEM((bq, lay.dkp), jnp.float32)], scale=scale, key_span=key_span, interpret=interpret,
        config=config, name=f"{name}_dq")

    # the queries that see each key row: an interval, since lo and hi are non-decreasing
    first, last = query_ranges(lay.lo, lay.hi, lay.nkp)
    nk = lay.nkp // bk
    table = bands(first, last, nk, bq)
    steps = min(cdiv(query_span + bk - 1, bq) + 1, lay.tp // bq)

    def query_tile(b, n, s, table):  # the clamped query tile of step s
        return clamped(*band(table, batch_row(b, lay.per_row), n, nk), s)

    query_map = lambda b, h, n, g, s, table, ends: (b, query_tile(b, n, s, table), h * G + g)
    head_map = lambda b, h, n, g, s, table, ends: (b, h * G + g, query_tile(b, n, s, table), 0)
    rows_map = lambda b, h, n, g, s, table, ends: (batch_row(b, lay.per_row), query_tile(b, n, s, table), 0)
    key_map = lambda b, h, n, *_: (b, n, h)
    compiler, dots = params(q, interpret, ("parallel", "parallel", "parallel", "arbitrary", "arbitrary"))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, scale=float(scale), block_k=bk, steps=steps, per_row=lay.per_row, **dots),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, H, nk, G, steps),
            in_specs=[pl.BlockSpec((1, bq, 2), rows_map), pl.BlockSpec((1, bq, lay.dkp), query_map),
                      pl.BlockSpec((1, bk, lay.dkp), key_map), pl.BlockSpec((1, bk, lay.dvp), key_map),
                      pl.BlockSpec((1, bq, lay.dvp), query_map), pl.BlockSpec((1, 1, bq, 1), head_map),
                      pl.BlockSpec((1, 1, bq, 1), head_map)],
            out_specs=[pl.BlockSpec((1, bk, lay.dkp), key_map), pl.BlockSpec((1, bk, lay.dvp), key_map)],
            scratch_shapes=[pltpu.VMEM((bk, lay.dkp), jnp.float32), pltpu.VMEM((bk, lay.dvp), jnp.float32)]),
        out_shape=[out_struct((B, lay.nkv, H * lay.dkp), k.dtype, q),
                   out_struct((B, lay.nkv, H * lay.dvp), v.dtype, q)], name=f"{name}_dkdv", **compiler,
    )(table, lay.ends, lay.rows, view(q, lay.tp, lay.dkp), view(k, lay.nkv, lay.dkp), view(v, lay.nkv, lay.dvp),
      do_v, lse_h, delta_h)
    return (dq.reshape(B, lay.tp, HQ, lay.dkp)[:, :T, :, :dk_dim],
            dk.reshape(B, lay.nkv, H, lay.dkp)[:, :NK, :, :dk_dim],
            dv.reshape(B, lay.nkv, H, lay.dvp)[:, :NK, :, :dv_dim])
