"""Block compression by mean pooling (fla's form of the paper's Eq. 7 with block = stride).

Compressed row r is the mean of the tokens of one block of block_size tokens of one sequence; the
last block of a sequence is averaged over its true length. With cu_seqlens the rows of all sequences
are packed one after the other: sequence i's block c is row sum_{j<i} ceil(len_j / bs) + c.

Each row gathers its own tokens (no scatter-add) and sums them in one fixed order (`_sum_in_order`), so a
row is bitwise the same on every platform and whatever the shape of the array around it: a KV cache's
compressed rows, written a block at a time, equal `compress` of the whole sequence bitwise. The backward
hands each token its row's gradient divided by the row's length.
"""

import jax.numpy as jnp

from nsa._varlen import cdiv, tokens
from nsa.reference import _common as c


def _row_tokens(T, cu_seqlens, block_size, num_blocks):
    """The tokens of each compressed row: index [NC, bs] (0 where unused), used [NC, bs], length [NC]."""
    if cu_seqlens is None:
        starts, ends = jnp.arange(num_blocks) * block_size, jnp.full(num_blocks, T)
    else:
        cu = cu_seqlens.astype(jnp.int32)
        blocks = cdiv(cu[1:] - cu[:-1], block_size)
        first_row = jnp.cumsum(blocks) - blocks
        seq = jnp.clip(jnp.searchsorted(first_row + blocks, jnp.arange(num_blocks), side="right"), 0, len(blocks) - 1)
        starts = cu[seq] + (jnp.arange(num_blocks) - first_row[seq]) * block_size
        ends = jnp.where(jnp.arange(num_blocks) < first_row[seq] + blocks[seq], cu[seq + 1], starts)  # padding rows
    index = starts[:, None] + jnp.arange(block_size)
    used = index < jnp.minimum(ends, starts + block_size)[:, None]
    return jnp.where(used, index, 0), used, jnp.maximum(jnp.sum(used, axis=1), 1)


def _token_rows(T, cu_seqlens, block_size):
    """The compressed row of each token [T]."""
    tok = tokens(T, block_size, cu_seqlens)
    return (tok.cmp_start + tok.pos // block_size)[0]


def _sum_in_order(x, axis):
    """The sum over `axis` as one fixed tree of elementwise additions (neighbours, then neighbouring pairs, ...).
    XLA may group a reduction's terms differently for arrays of different shapes (a block summed inside a
    long sequence or alone), which changes the last bit; elementwise additions it never regroups."""
    x = jnp.moveaxis(x, axis, 0)
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = jnp.concatenate([x, jnp.zeros_like(x[:1])])
        x = x[0::2] + x[1::2]
    return x[0]


def forward(x, cu_seqlens, *, block_size, num_blocks):
    """x [B, T, H, D] -> the block means [B, NC, H, D], NC = num_blocks."""
    index, used, length = _row_tokens(x.shape[1], cu_seqlens, block_size, num_blocks)
    gathered = jnp.where(used[None, :, :, None, None], x[:, index].astype(c.acc_dtype(x.dtype)), 0.0)
    mean = _sum_in_order(gathered, axis=2) / length[None, :, None, None]  # [B, NC, H, D]
    return mean.astype(x.dtype), (x, cu_seqlens)


def backward(residuals, dy, *, block_size, num_blocks):
    """Each token gets its row's gradient divided by the row's length: (dx, None)."""
    x, cu_seqlens = residuals
    _, _, length = _row_tokens(x.shape[1], cu_seqlens, block_size, num_blocks)
    row = _token_rows(x.shape[1], cu_seqlens, block_size)
    dx = dy.astype(c.acc_dtype(x.dtype)) / length[None, :, None, None]
    return dx[:, row].astype(x.dtype), None
