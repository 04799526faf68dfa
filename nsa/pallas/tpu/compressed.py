"""Compressed attention on the Pallas TPU flash kernels (nsa/pallas/tpu/_flash.py).

The query at in-sequence position p (its index t, or kv_lens[b] - T + t at the end of a KV cache's sequence
b) sees the compressed rows [cmp_start, cmp_start + n) of k_cmp / v_cmp, n the windows of block_size tokens
every `stride` wholly in its past (`nsa._varlen.complete_rows`; (p + 1) // block_size for stride = block_size),
that exist
(trailing rows, such as a cache's incomplete blocks, are never read); signatures and residuals are those
of nsa.reference.compressed, the gradient also flows through lse. A query may see any of the NC rows (packed
sequences, or a cache), and a row any of the T queries: the spans that size the kernels' grids. `interpret`
(False: Mosaic, or a pltpu.InterpretParams) and `config` (a _flash.Config; None: its default_config) are
passed to the kernels.
"""

from nsa._varlen import compressed_key_range
from nsa.pallas.tpu import _flash


def forward(q, k_cmp, v_cmp, cu_seqlens, kv_lens=None, *, block_size, stride, scale, interpret=False, config=None):
    """Returns (o [B, T, HQ, Dv], lse [B, T, HQ] float32) and the residuals; kv_lens None or int32 [B]."""
    lo, hi = compressed_key_range(q.shape[1], k_cmp.shape[1], block_size, cu_seqlens, kv_lens, stride)
    o, lse = _flash.attend(q, k_cmp, v_cmp, lo, hi, scale=scale, key_span=k_cmp.shape[1], interpret=interpret,
                           config=config, name="compressed")
    return (o, lse), (q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse)


def backward(residuals, cotangents, *, block_size, stride, scale, interpret=False, config=None):
    """Gradients (dq, dk_cmp, dv_cmp, None, None), including the path through lse."""
    q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse = residuals
    do, dlse = cotangents
    lo, hi = compressed_key_range(q.shape[1], k_cmp.shape[1], block_size, cu_seqlens, kv_lens, stride)
    dq, dk, dv = _flash.attend_backward(q, k_cmp, v_cmp, lo, hi, o, lse, do, dlse, scale=scale,
                                        key_span=k_cmp.shape[1], query_span=q.shape[1], interpret=interpret,
                                        config=config, name="compressed")
    return dq, dk, dv, None, None
