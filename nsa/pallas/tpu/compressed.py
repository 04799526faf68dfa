"""Compressed attention on TPUs: the resident kernels of nsa/pallas/tpu/_resident.py where they apply (`resident`:
training, G query heads per KV head a multiple of the sublanes, at most RESIDENT_COMPRESSED_ROWS compressed rows),
else jax's own splash attention kernels where they apply (`by_splash`), else the Pallas TPU flash kernels of
nsa/pallas/tpu/_flash.py.

The query at in-sequence position p (its index t, or kv_lens[b] - T + t at the end of a KV cache's sequence
b) sees the compressed rows [cmp_start, cmp_start + n) of k_cmp / v_cmp, n the windows of block_size tokens
every `stride` wholly in its past (`nsa._varlen.complete_rows`; (p + 1) // block_size for stride = block_size),
that exist (trailing rows, such as a cache's incomplete blocks, are never read); signatures and residuals are
those of nsa.reference.compressed, the gradient also flows through lse. `interpret` (False: Mosaic, or a
pltpu.InterpretParams) and `config` (a _flash.Config; None: its default_config, or splash where it applies) go to
the kernels.

Splash attention (run through nsa/pallas/tpu/_splash.py: its layout, tiles, and a backward from the forward's o
and lse, with lse's cotangent): without a KV cache or packed sequences query t sees row i iff
i * stride + block_size - 1 <= t and i < NC (NC = k_cmp's rows), a function of the indices alone, which splash
evaluates in its kernels (`CompressedMask`: no [T, NC] array in memory; NC is padded to whole lanes, the padded
rows masked), skipping the blocks of up to 512 queries by 512 rows that the mask leaves empty. (Packed sequences'
and a cache's rows are no static function of the token index.) The flash kernels here took 13.1 ms forward +
backward for it on a TPU v5e at 8k tokens, compression 64 / 64 (1/64 of dense causal attention's work, which dense
splash attention does in 45 ms); by splash 6.95 ms (1.37x splash's own
compressed-mask kernels, 2026-12-06, docs/tpu.md). A query before its first complete
window (t < block_size - 1) sees no row: splash leaves it a finite mean of its block's values, set here to o = 0,
lse = -inf (the reference's), and its backward a p of exactly 0 (`_splash.backward`). `by_splash` takes bfloat16
and float32 heads of whole lanes (Dk, Dv multiples of 128), a static batch (folded into the heads), no KV cache,
no packed sequences, at least one compressed row and no Config (a Config sets the flash kernels' tiles).

The flash kernels take the rest. A query may see any of the NC rows (packed sequences, or a cache), and a row any
of the T queries: the spans that size the kernels' grids.
"""

import jax.numpy as jnp
import numpy as np

from nsa._varlen import compressed_key_range
from nsa.pallas.tpu import _flash, _resident, _splash

# Resident kernels (nsa/pallas/tpu/_resident.py; training: no KV cache, no Config): a step's TB = 16 tokens x G heads
# against all NC compressed rows of its (b, h), resident in VMEM, in nsa's token-major layout (no transposes into
# splash's head-major layout and back around the gated sum); a step reads the shortest prefix of them, in multiples
# of _resident.PREFIX_ROWS, that holds the rows its tokens see (branch tpu-resident-compressed-prefix; before it, every
# row, so that its work grew with NC where splash's causal blocks skip the rows no query of theirs sees): up to
# RESIDENT_COMPRESSED_ROWS rows (NC = T / 64 at 64k tokens, T / 16 at 16k). Reading every row, on a TPU v5e
# (2026-12-07, docs/tpu.md) the branch's forward+backward at 1024 rows (16k,
# the paper's 32/16) took 17.47 ms against splash's 18.94 under the same mask; at 2048 rows (32k) 59.26 against 58.23,
# at 4096 (64k) 220.06 against 199.40: a step reads every row, twice splash's useful work there. Yet nsa.attention's
# paper row took 330.12 ms at 32k against 342.50 with splash's branch in the same run (its layout copies gone; peak
# 5.3 GiB against 5.6) and 931.72 at 64k against an earlier run's 926.56: hence 4096 (tpu-resident-compressed-rows).
RESIDENT_COMPRESSED = True  # False: splash (or the flash kernels) where they apply
RESIDENT_COMPRESSED_ROWS = 4096


class CompressedMask(_splash.ComputableMask):
    """Splash's mask of compressed attention without packed sequences or a KV cache, [TP, KP] (T and NC padded):
    query t sees row i iff i * stride + block_size - 1 <= t (its window complete) and i < num_rows (NC: the padded
    rows masked). Evaluated in splash's kernels from the indices (a computable mask, like splash's CausalMask)."""

    def __init__(self, shape, *, block_size, stride, num_rows):
        self.block_size, self.stride, self.num_rows = int(block_size), int(stride), int(num_rows)

        def seen(q_ids, kv_ids):
            return (kv_ids * self.stride + (self.block_size - 1) <= q_ids) & (kv_ids < self.num_rows)

        super().__init__(shape=shape, mask_function=seen)

    def _key(self):
        return self.shape, self.block_size, self.stride, self.num_rows

    def __eq__(self, other):
        if not isinstance(other, CompressedMask):
            return NotImplemented
        return self._key() == other._key() and np.array_equal(self.q_sequence, other.q_sequence)

    def __hash__(self):
        return hash((type(self), self._key()))


def resident(q, k_cmp, v_cmp, kv_lens, config, backward):
    """(_resident.Layout, passes) of compressed attention of q [B, T, HQ, Dk] over k_cmp, v_cmp [B, NC, H, D] when the
    resident kernels run it (RESIDENT_COMPRESSED; 1 <= NC <= RESIDENT_COMPRESSED_ROWS; `_resident.takes`), else None:
    every step reads all NC rows (ADVANCE = 0), passes by `_resident.plan`."""
    NC = k_cmp.shape[1]
    if not RESIDENT_COMPRESSED or not 1 <= NC <= RESIDENT_COMPRESSED_ROWS:
        return None
    if not _resident.takes(q, k_cmp, kv_lens, config):
        return None
    lay = _resident.layout(q, k_cmp, v_cmp, span=NC, pad=0, advance=0)
    passes = _resident.plan(lay, k_cmp.dtype, backward)
    return None if passes is None else (lay, passes)


def by_splash(q, k_cmp, v_cmp, cu_seqlens, kv_lens, config):
    """Whether compressed attention of q [B, T, HQ, Dk] over k_cmp, v_cmp [B, NC, H, D] runs splash attention
    (module docstring)."""
    return (config is None and kv_lens is None and cu_seqlens is None and k_cmp.shape[1] >= 1
            and _splash.takes(q, v_cmp))


def forward(q, k_cmp, v_cmp, cu_seqlens, kv_lens=None, *, block_size, stride, scale, interpret=False, config=None):
    """Returns (o [B, T, HQ, Dv], lse [B, T, HQ] float32) and the residuals; kv_lens None or int32 [B]."""
    plan = resident(q, k_cmp, v_cmp, kv_lens, config, backward=False)
    if plan is not None:
        lo, hi = _key_range(q, k_cmp, cu_seqlens, kv_lens, block_size, stride)
        o, lse = _resident.forward(q, k_cmp, v_cmp, lo, hi, plan[0], scale=scale, interpret=interpret,
                                   name="compressed")
        return (o, lse), (q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse)
    if by_splash(q, k_cmp, v_cmp, cu_seqlens, kv_lens, config):
        o, lse = _splash.forward(_mask(block_size, stride, k_cmp.shape[1]), q, k_cmp, v_cmp, None, scale=scale,
                                 interpret=interpret)
        blind = min(block_size - 1, q.shape[1])  # the queries t < block_size - 1, before their first whole window
        o, lse = o.at[:, :blind].set(0), lse.at[:, :blind].set(-jnp.inf)  # in place: not a pass over all of o
        return (o, lse), (q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse)
    lo, hi = _key_range(q, k_cmp, cu_seqlens, kv_lens, block_size, stride)
    o, lse = _flash.attend(q, k_cmp, v_cmp, lo, hi, scale=scale, key_span=k_cmp.shape[1], interpret=interpret,
                           config=config, name="compressed")
    return (o, lse), (q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse)


def backward(residuals, cotangents, *, block_size, stride, scale, interpret=False, config=None):
    """Gradients (dq, dk_cmp, dv_cmp, None, None), including the path through lse."""
    q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse = residuals
    do, dlse = cotangents
    plan = resident(q, k_cmp, v_cmp, kv_lens, config, backward=True)
    if plan is not None:
        lo, hi = _key_range(q, k_cmp, cu_seqlens, kv_lens, block_size, stride)
        return (*_resident.backward(q, k_cmp, v_cmp, lo, hi, o, lse, do, *plan, scale=scale, interpret=interpret,
                                    name="compressed", dlse=dlse), None, None)
    if by_splash(q, k_cmp, v_cmp, cu_seqlens, kv_lens, config):
        dq, dk, dv = _splash.backward(_mask(block_size, stride, k_cmp.shape[1]), q, k_cmp, v_cmp, None, o, lse, do,
                                      dlse, scale=scale, interpret=interpret)
        return dq, dk, dv, None, None
    lo, hi = _key_range(q, k_cmp, cu_seqlens, kv_lens, block_size, stride)
    dq, dk, dv = _flash.attend_backward(q, k_cmp, v_cmp, lo, hi, o, lse, do, dlse, scale=scale,
                                        key_span=k_cmp.shape[1], query_span=q.shape[1], interpret=interpret,
                                        config=config, name="compressed")
    return dq, dk, dv, None, None


def _key_range(q, k_cmp, cu_seqlens, kv_lens, block_size, stride):
    """(lo, hi) int32: each query's first and last compressed row (`nsa._varlen.compressed_key_range`)."""
    return compressed_key_range(q.shape[1], k_cmp.shape[1], block_size, cu_seqlens, kv_lens, stride)


def _mask(block_size, stride, num_rows):
    """The CompressedMask of a padded shape."""
    return lambda shape: CompressedMask(shape, block_size=block_size, stride=stride, num_rows=num_rows)
