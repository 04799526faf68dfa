"""Compressed attention on the Triton flash kernels (nsa/triton/_flash.py).

The query at in-sequence position p (t, or kv_lens[b] - T + t when the queries are the last T tokens of
longer sequences in a KV cache) sees the compressed rows [cmp_start, cmp_start + (p + 1) // block_size)
of k_cmp / v_cmp that exist (trailing rows, such as a cache's blocks past each sequence, are never read);
signatures and residuals are those of nsa.reference.compressed, the gradient also flows through lse.
`config` (a _flash.Config; None: its default) sets the kernels' tiles. A few queries at the end of a cache
(`decode.applies`; config None) run the flash-decoding forward of nsa/triton/decode.py.
"""

from nsa._varlen import compressed_key_range
from nsa.triton import _flash, decode


def forward(q, k_cmp, v_cmp, cu_seqlens, kv_lens=None, *, block_size, scale, config=None):
    """Returns (o [B, T, HQ, Dv], lse [B, T, HQ] float32) and the residuals."""
    if kv_lens is not None and config is None and decode.applies(q, k_cmp):
        o, lse = decode.compressed(q, k_cmp, v_cmp, kv_lens, block_size=block_size, scale=scale)
    else:
        lo, hi = compressed_key_range(q.shape[1], k_cmp.shape[1], block_size, cu_seqlens, kv_lens)
        o, lse = _flash.attend(q, k_cmp, v_cmp, lo, hi, scale=scale, config=config)
    return (o, lse), (q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse)


def backward(residuals, cotangents, *, block_size, scale, config=None):
    """Gradients (dq, dk_cmp, dv_cmp, None, None), including the path through lse."""
    q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse = residuals
    do, dlse = cotangents
    lo, hi = compressed_key_range(q.shape[1], k_cmp.shape[1], block_size, cu_seqlens, kv_lens)
    dq, dk, dv = _flash.attend_backward(q, k_cmp, v_cmp, lo, hi, o, lse, do, dlse, scale=scale,
                                        query_span=q.shape[1], config=config)
    return dq, dk, dv, None, None
