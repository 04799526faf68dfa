"""Block compression by mean pooling (fla's form of the paper's Eq. 7 with block = stride).

Compressed row r is the mean of the tokens of one block of block_size tokens of one sequence; the
last block of a sequence is averaged over its true length. With cu_seqlens the rows of all sequences
are packed one after the other: sequence i's block c is row sum_{j<i} ceil(len_j / bs) + c.
"""

import jax
import jax.numpy as jnp

from nsa._varlen import tokens
from nsa.reference import _common as c


def _rows(T, cu_seqlens, block_size, num_blocks):
    """The compressed row of each token [T] and the number of tokens of each row [NC]."""
    tok = tokens(T, block_size, cu_seqlens)
    row = (tok.cmp_start + tok.pos // block_size)[0]
    count = jax.ops.segment_sum(jnp.ones(T, jnp.int32), row, num_segments=num_blocks)
    return row, jnp.maximum(count, 1)


def forward(x, cu_seqlens, *, block_size, num_blocks):
    """x [B, T, H, D] -> the block means [B, NC, H, D], NC = num_blocks."""
    T = x.shape[1]
    row, count = _rows(T, cu_seqlens, block_size, num_blocks)
    total = jax.ops.segment_sum(jnp.swapaxes(x.astype(c.acc_dtype(x.dtype)), 0, 1), row, num_segments=num_blocks)
    mean = total / count[:, None, None, None]
    return jnp.swapaxes(mean, 0, 1).astype(x.dtype), (x, cu_seqlens)


def backward(residuals, dy, *, block_size, num_blocks):
    """Each token gets its block's gradient divided by the block's length: (dx, None)."""
    x, cu_seqlens = residuals
    row, count = _rows(x.shape[1], cu_seqlens, block_size, num_blocks)
    dx = dy.astype(c.acc_dtype(x.dtype)) / count[None, :, None, None]
    return dx[:, row].astype(x.dtype), None
