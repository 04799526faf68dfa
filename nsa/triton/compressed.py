"""Compressed attention on the Triton flash kernels (nsa/triton/_flash.py).

The query at in-sequence position p (t, or kv_lens[b] - T + t when the queries are the last T tokens of
longer sequences in a KV cache) sees the compressed rows [cmp_start, cmp_start + n) of k_cmp / v_cmp that
exist, n the windows of block_size tokens every `stride` wholly in its past (`nsa._varlen.complete_rows`:
with stride = block_size, n = (p + 1) // block_size) (trailing rows, such as a cache's blocks past each sequence, are never read);
signatures and residuals are those of nsa.reference.compressed, the gradient also flows through lse.
decode: whether the flash-decoding forward of nsa/triton/decode.py runs instead (None: where it applies, a
few queries at the end of a cache: `nsa.triton._splits.decoding`). config: the Config of the kernels that run
(a _flash.Config, or a decode.Config for the decode forward; None: its default).
"""

from nsa._config import Shapes
from nsa._varlen import compressed_key_range
from nsa.triton import _flash, _splits
from nsa.triton import decode as flash_decoding
from nsa.triton._common import device


def _config(q, k_cmp, v_cmp, block_size, config):
    """config, or the flash kernels' default for the compressed rows."""
    shapes = Shapes.of(q, k_cmp, v_cmp, block_size=int(block_size))
    return _flash.default_config(shapes, q.dtype, device()) if config is None else config


def forward(q, k_cmp, v_cmp, cu_seqlens, kv_lens=None, *, block_size, stride, scale, config=None, decode=None):
    """Returns (o [B, T, HQ, Dv], lse [B, T, HQ] float32) and the residuals."""
    if _splits.decoding(decode, q, k_cmp, kv_lens, config, (_flash.Config, flash_decoding.Config)):
        o, lse = flash_decoding.compressed(q, k_cmp, v_cmp, kv_lens, block_size=block_size, stride=stride,
                                           scale=scale, config=config)
    else:
        lo, hi = compressed_key_range(q.shape[1], k_cmp.shape[1], block_size, cu_seqlens, kv_lens, stride)
        o, lse = _flash.attend(q, k_cmp, v_cmp, lo, hi, scale=scale,
                               config=_config(q, k_cmp, v_cmp, block_size, config))
    return (o, lse), (q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse)


def backward(residuals, cotangents, *, block_size, stride, scale, config=None):
    """Gradients (dq, dk_cmp, dv_cmp, None, None), including the path through lse; config: a _flash.Config
    (None: its default)."""
    q, k_cmp, v_cmp, cu_seqlens, kv_lens, o, lse = residuals
    do, dlse = cotangents
    lo, hi = compressed_key_range(q.shape[1], k_cmp.shape[1], block_size, cu_seqlens, kv_lens, stride)
    dq, dk, dv = _flash.attend_backward(q, k_cmp, v_cmp, lo, hi, o, lse, do, dlse, scale=scale,
                                        config=_config(q, k_cmp, v_cmp, block_size, config))
    return dq, dk, dv, None, None
