"""Sliding-window attention on the Triton flash kernels (nsa/triton/_flash.py).

Query t, at key row r (its own token's row of k: t itself, or kv_lens[b] - T + t when the queries are the
last T tokens of longer sequences in a KV cache k, v [B, TK, H, D]), sees the key rows
[max(sequence start, r - window_size + 1), r]; signatures and residuals are those of
nsa.reference.window. decode: whether the flash-decoding forward of nsa/triton/decode.py runs instead (None:
where it applies, a few queries at the end of a cache: `nsa.triton._splits.decoding`). config: the Config of
the kernels that run (a _flash.Config, or a decode.Config for the decode forward; None: its default).
"""

from nsa._config import Shapes
from nsa._varlen import window_key_range
from nsa.triton import _flash, _splits
from nsa.triton import decode as flash_decoding
from nsa.triton._common import device


def _config(q, k, v, window_size, config):
    """config, or the flash kernels' default for this window."""
    shapes = Shapes.of(q, k, v, window_size=int(window_size))
    return _flash.default_config(shapes, q.dtype, device()) if config is None else config


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale, config=None, decode=None):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ])."""
    if _splits.decoding(decode, q, k, kv_lens, config, (_flash.Config, flash_decoding.Config)):
        o, lse = flash_decoding.window(q, k, v, kv_lens, window_size=window_size, scale=scale, config=config)
    else:
        lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens, kv_lens)
        o, lse = _flash.attend(q, k, v, lo, hi, scale=scale, config=_config(q, k, v, window_size, config))
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale, config=None):
    """Gradients (dq, dk, dv, None, None); config: a _flash.Config (None: its default)."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens, kv_lens)
    dq, dk, dv = _flash.attend_backward(q, k, v, lo, hi, o, lse, do, scale=scale,
                                        config=_config(q, k, v, window_size, config))
    return dq, dk, dv, None, None
