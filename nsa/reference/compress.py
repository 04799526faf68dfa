"""Compression by mean pooling: the paper's Eq. 7 with a mean for phi, over windows of l = block_size tokens
every d = stride tokens (d = l: fla's blocks that do not overlap; the paper's l = 32, d = 16 overlap).

Compressed row i of a sequence is the mean of its tokens [i * d, min(i * d + l, len)), for i = 0 ..
ceil(len / d) - 1: the last rows are averaged over their true length. With cu_seqlens the rows of all sequences
are packed one after the other: sequence i's row c is row sum_{j<i} ceil(len_j / d) + c.

Each row gathers its own tokens (no scatter-add) and sums them in one fixed order (`_sum_in_order`), so a
row is bitwise the same on every platform and whatever the shape of the array around it: a KV cache's
compressed rows, written a block at a time, equal `compress` of the whole sequence bitwise. The backward
hands each token its row's gradient divided by the row's length.
"""

import jax.numpy as jnp

from nsa._varlen import cdiv, tokens
from nsa.reference import _common as c


def row_tokens(T, cu_seqlens, block_size, stride, num_rows):
    """The tokens of each compressed row: index [NC, l] (0 where unused), used [NC, l], length [NC]."""
    if cu_seqlens is None:
        starts, ends = jnp.arange(num_rows) * stride, jnp.full(num_rows, T)
    else:
        cu = cu_seqlens.astype(jnp.int32)
        rows = cdiv(cu[1:] - cu[:-1], stride)
        first_row = jnp.cumsum(rows) - rows
        seq = jnp.clip(jnp.searchsorted(first_row + rows, jnp.arange(num_rows), side="right"), 0, len(rows) - 1)
        starts = cu[seq] + (jnp.arange(num_rows) - first_row[seq]) * stride
        ends = jnp.where(jnp.arange(num_rows) < first_row[seq] + rows[seq], cu[seq + 1], starts)  # padding rows
    index = starts[:, None] + jnp.arange(block_size)
    used = index < jnp.minimum(ends, starts + block_size)[:, None]
    return jnp.where(used, index, 0), used, jnp.maximum(jnp.sum(used, axis=1), 1)


def _token_rows(T, cu_seqlens, block_size, stride):
    """The compressed rows whose windows hold each token, as (row [T], valid [T] bool) for each of the
    block_size / stride windows, the latest first: token p of a sequence is in its rows p // d - j, j < l / d,
    those >= 0."""
    tok = tokens(T, stride, cu_seqlens)
    own = tok.pos // stride
    return [((tok.cmp_start + own - j)[0], (own >= j)[0]) for j in range(block_size // stride)]


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


def forward(x, cu_seqlens, *, block_size, num_blocks, stride=None):
    """x [B, T, H, D] -> the window means [B, NC, H, D], NC = num_blocks (stride None: block_size)."""
    stride = block_size if stride is None else stride
    index, used, length = row_tokens(x.shape[1], cu_seqlens, block_size, stride, num_blocks)
    gathered = jnp.where(used[None, :, :, None, None], x[:, index].astype(c.acc_dtype(x.dtype)), 0.0)
    mean = _sum_in_order(gathered, axis=2) / length[None, :, None, None]  # [B, NC, H, D]
    return mean.astype(x.dtype), (x[:0], cu_seqlens)  # x's T and dtype, not its values: the backward is linear


def backward(residuals, dy, *, block_size, num_blocks, stride=None):
    """Each token gets the gradients of the rows that hold it, each divided by its row's length: (dx, None)."""
    stride = block_size if stride is None else stride
    x, cu_seqlens = residuals  # x[:0]: its shape and dtype
    _, _, length = row_tokens(x.shape[1], cu_seqlens, block_size, stride, num_blocks)
    per_row = dy.astype(c.acc_dtype(x.dtype)) / length[None, :, None, None]
    (row, _), *earlier = _token_rows(x.shape[1], cu_seqlens, block_size, stride)
    dx = per_row[:, row]
    for row, valid in earlier:
        dx = dx + jnp.where(valid[None, :, None, None], per_row[:, jnp.maximum(row, 0)], 0.0)
    return dx.astype(x.dtype), None
