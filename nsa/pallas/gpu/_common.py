"""What the Mosaic GPU kernels of nsa/pallas/gpu share: shared-memory tiles that wgmma and TMA read, the wgmma
matmuls and their layouts, copies in and out, the double-buffered loop, the dk/dv step, and the call of a kernel.

One warpgroup (128 threads) computes a tile of 64 rows (wgmma's M); shared-memory tiles are (8, 128-byte) tiles
with a 128-byte swizzle, so a head dim is padded to whole 128-byte rows (64 2-byte values).
"""

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from nsa._plan import padded
from nsa._varlen import round_up

SUBLANES = 8  # the rows of a shared-memory tile
LANE_BYTES = 128  # the swizzle of a shared-memory tile's rows: D is padded to a multiple of 128 bytes
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # wgmma on float32 is TF32: too coarse


def tokens_at_once(q):
    """The tokens of q [B, T, ...] one launch sees: B * T, or T where B is symbolic (jax.export's batch: its
    sequences run one at a time)."""
    return (q.shape[0] if isinstance(q.shape[0], int) else 1) * q.shape[1]


def check_dtype(dtype, argument):
    """TypeError naming `argument` unless the Mosaic GPU kernels take `dtype`."""
    if jnp.dtype(dtype) not in DTYPES:
        raise TypeError(f"{argument}: expected bfloat16 or float16 (the Mosaic GPU kernels' wgmma runs float32 as "
                        f"TF32, too coarse for float32 results), got {jnp.dtype(dtype).name}")


def smem_tile(shape, dtype):
    """A shared-memory tile that wgmma and TMA read: (8, 128-byte) tiles, 128-byte swizzle."""
    cols = LANE_BYTES // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((SUBLANES, cols)), plgpu.SwizzleTransform(LANE_BYTES))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def padded_dim(d, dtype):
    """d rounded up to whole 128-byte rows."""
    cols = LANE_BYTES // jnp.dtype(dtype).itemsize
    return round_up(d, cols)


def tma_rows(x, tile):
    """x [B, N, heads, D] with N zero-padded to a multiple of 8 rows (a TMA copy of a tiled slice needs it) and
    to at least one tile of `tile` rows: a copy only when N is odd or short."""
    return padded(x, 1, max(tile, round_up(x.shape[1], SUBLANES)))


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
