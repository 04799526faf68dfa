"""Compressed attention on the Triton flash kernels (nsa/triton/_flash.py).

The query at in-sequence position t sees the compressed rows [cmp_start, cmp_start + (t + 1) //
block_size) of k_cmp / v_cmp (trailing rows are never read); signatures and residuals are those of
nsa.reference.compressed, the gradient also flows through lse.
"""

import jax.numpy as jnp

from nsa._varlen import tokens
from nsa.reference import compressed as reference
from nsa.triton import _flash

_KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # float64 runs the reference


def _key_range(T, block_size, cu_seqlens):
    """lo, hi int32 [T]: the visible compressed rows of query t (empty before its first full block)."""
    tok = tokens(T, block_size, cu_seqlens)
    lo = tok.cmp_start[0]
    return lo, lo + (tok.pos[0] + 1) // block_size - 1


def forward(q, k_cmp, v_cmp, cu_seqlens, *, block_size, scale):
    """Returns (o [B, T, HQ, Dv], lse [B, T, HQ] float32) and the residuals."""
    if q.dtype not in _KERNEL_DTYPES:
        return reference.forward(q, k_cmp, v_cmp, cu_seqlens, block_size=block_size, scale=scale)
    lo, hi = _key_range(q.shape[1], block_size, cu_seqlens)
    o, lse = _flash.attend(q, k_cmp, v_cmp, lo, hi, scale=scale)
    return (o, lse), (q, k_cmp, v_cmp, cu_seqlens, o, lse)


def backward(residuals, cotangents, *, block_size, scale):
    """Gradients (dq, dk_cmp, dv_cmp, None), including the path through lse."""
    q, k_cmp, v_cmp, cu_seqlens, o, lse = residuals
    if q.dtype not in _KERNEL_DTYPES:
        return reference.backward(residuals, cotangents, block_size=block_size, scale=scale)
    do, dlse = cotangents
    lo, hi = _key_range(q.shape[1], block_size, cu_seqlens)
    dq, dk, dv = _flash.attend_backward(q, k_cmp, v_cmp, lo, hi, o, lse, do, dlse, scale=scale,
                                        query_span=q.shape[1])
    return dq, dk, dv, None
