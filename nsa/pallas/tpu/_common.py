"""What the Mosaic TPU kernels of nsa/pallas/tpu share: the vreg's shape, the matmul, the outputs' types, the
compiler parameters, and the reading of a scalar-prefetched band of tiles.

The vreg's lanes and sublanes are `nsa._device.facts("tpu")`'s, read when a kernel is traced (128 and 8 on every
TPU; for a program exported for TPU from a CPU, the table's smallest values).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from nsa._device import facts
from nsa._plan import padded
from nsa._varlen import round_up


def lanes():
    """A vreg's lanes: the minor dim of every block is a multiple of it (or the whole dim)."""
    return facts("tpu").lanes


def sublanes(dtype):
    """The rows of one vreg tile of `dtype`: 8 for 4-byte types, 16 for 2-byte ones (packed two per sublane)."""
    return facts("tpu").sublanes * 4 // jnp.dtype(dtype).itemsize


def lane_padded(d):
    """d rounded up to whole lanes: a head dim as the kernels read it."""
    return round_up(d, lanes())


def out_struct(shape, dtype, like):
    """The out_shape of a pallas_call output: jax.ShapeDtypeStruct(shape, dtype) varying over the mesh axes
    the array `like` varies over inside shard_map (pallas_call asks for it when shard_map checks them)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def dot(a, b, precision, *, transpose_b=False):
    """a @ b, or a @ b.T, with float32 accumulation. precision None is lax.Precision.DEFAULT, said explicitly: left
    as None, a caller's jax_default_matmul_precision("highest") reaches the kernel, and Mosaic refuses a float32
    contraction of 16-bit operands ("Bad lhs type", seen on a TPU v5e)."""
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=lax.Precision.DEFAULT if precision is None else precision,
                           preferred_element_type=jnp.float32)


def params(q, interpret, semantics):
    """(the pallas_call keywords: compiler params with the grid's dimension semantics, interpret; the kernels'
    keywords: the precision of their matmuls, HIGHEST for float32 inputs)."""
    return dict(compiler_params=pltpu.CompilerParams(dimension_semantics=semantics), interpret=interpret), dict(
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)


def batch_row(b, per_row):
    """The row of the bands, ends and ranges that batch row b reads: b with per-row ranges, else the shared 0."""
    return b if per_row else 0


def clamped(first, last, step):
    """The tile of step `step` of the band [first, last]: a step past its last tile re-maps to it (no DMA)."""
    return jnp.minimum(first + step, jnp.maximum(last, first))


def view(x, rows, dim):
    """x [B, R, H, D] as the kernels read it: [B, rows, H * dim], zero-padded (a block (1, ., dim) at column h
    is head h, with no transpose)."""
    return padded(padded(x, 3, dim), 1, rows).reshape(x.shape[0], rows, x.shape[2] * dim)
