"""Compressed attention on the Mosaic GPU flash kernels (nsa/pallas/gpu/_flash.py).

The contract and the residuals are nsa.reference.compressed's (the gradient also flows through lse): the query at
in-sequence position p sees the compressed rows [cmp_start, cmp_start + n) of k_cmp / v_cmp, n the windows of
block_size tokens every `stride` wholly in its past (`nsa._varlen.complete_rows`; (p + 1) // block_size for
stride = block_size), that exist (`nsa._varlen.compressed_key_range`), and a row may be seen by any of the T
queries (the span that
splits the dk/dv walk over programs). `config` (a _flash.Config; None: its default_config) goes to the kernels.
"""

from nsa._varlen import compressed_key_range
from nsa.pallas.gpu import _flash


def forward(q, k_cmp, v_cmp, cu_seqlens, kv_lens=None, *, block_size, stride, scale, config=None):
    """Returns (o [B, T, HQ, Dv], lse [B, T, HQ] float32) and the residuals; kv_lens None or int32 [B]."""
    lo, hi = compressed_key_range(q.shape[1], k_cmp.shape[1], block_size, cu_seqlens, kv_lens, stride)
    o, lse = _flash.attend(q, k_cmp, v_cmp, lo, hi, scale=scale, config=config, name="compressed")
    return (o, lse), (q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse)


def backward(residuals, cotangents, *, block_size, stride, scale, config=None):
    """Gradients (dq, dk_cmp, dv_cmp, None, None), including the path through lse."""
    q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse = residuals
    do, dlse = cotangents
    lo, hi = compressed_key_range(q.shape[1], k_cmp.shape[1], block_size, cu_seqlens, kv_lens, stride)
    dq, dk, dv = _flash.attend_backward(q, k_cmp, v_cmp, lo, hi, o, lse, do, dlse, scale=scale,
                                        query_span=q.shape[1], config=config, name="compressed")
    return dq, dk, dv, None, None
