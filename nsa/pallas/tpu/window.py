"""Sliding-window attention on TPUs: the resident kernels of nsa/pallas/tpu/_resident.py where they apply
(`resident`: training, G query heads per KV head a multiple of the sublanes, k and v within VMEM), else jax's own
splash attention kernels where they apply (`by_splash`), else the Pallas TPU flash kernels of
nsa/pallas/tpu/_flash.py.

Query t, at key row p (t itself, or kv_lens[b] - T + t at the end of a KV cache's sequence b), sees the key
rows [max(sequence start, p - window_size + 1), p]; signatures and residuals are those of
nsa.reference.window. `interpret` (False: Mosaic, or a pltpu.InterpretParams) and `config` (a _flash.Config;
None: its default_config, or splash where it applies) go to the kernels.

Splash attention (jax.experimental.pallas.ops.tpu.splash_attention, run through nsa/pallas/tpu/_splash.py: its
layout, tiles and backward): without a KV cache the window is a local mask of the [T, T] logits (key j seen by
query t iff t - window_size < j <= t), packed sequences are its segment ids (one per sequence of cu_seqlens: no key
crosses a boundary), and grouped heads its MHA kernel with H KV heads. On a TPU v5e it ran 4.2x faster than the
flash kernels here, forward and backward (2026-12-06, 8k tokens, HQ = 64, H = 4, D = 128, bf16, window 512: 3.9 /
12.2 ms against 17.1 / 50.8; benchmarks/results/tpu-train/), its backward then splash's own gradient of a forward
run again; the backward now takes the forward's o and lse instead (`_splash.backward`; in
benchmarks/tpu.py the same day: 12.51 ms, splash's own under the same mask 11.04 in that run).
`by_splash` takes it for bfloat16 and float32 heads of whole lanes (Dk, Dv multiples of 128), window_size >= 1, a
static batch (folded into the heads), no KV cache and no Config (a Config sets the flash kernels' tiles). T is
padded to a multiple of 128 (the padded keys come after every real query, the padded queries are cut and get a
zero cotangent).

The flash kernels take the rest (KV caches, float16, other heads, explicit tiles). A query sees at most W key
rows (W = min(window_size, TK), TK = k's rows) and a key row is seen by at most W queries: the spans that size
their grids. With a KV cache longer than the L = T + W - 1 rows the T queries' windows span (a decode step, a
short chunk), k and v are first cut to those rows of each batch row (`nsa._plan.window_keys`: the kernels never
see, and XLA never copies or relays out, the rest of the cache); the backward scatters dk and dv back.
"""

import jax.numpy as jnp

from nsa._plan import window_keys, window_uncut
from nsa._varlen import round_up, window_key_range
from nsa.pallas.tpu import _flash, _resident, _splash
from nsa.pallas.tpu._common import lanes


def by_splash(q, v, kv_lens, window_size, config):
    """Whether the window of q [B, T, HQ, Dk] over v [B, TK, H, Dv] runs splash attention (module docstring)."""
    return config is None and kv_lens is None and int(window_size) >= 1 and _splash.takes(q, v)


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale, interpret=False, config=None):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ]); k, v [B, TK, H, D], kv_lens
    None (TK = T) or int32 [B]."""
    plan = resident(q, k, v, kv_lens, window_size, config, backward=False)
    if plan is not None:
        lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens)
        o, lse = _resident.forward(q, k, v, lo, hi, plan[0], scale=scale, interpret=interpret, name="window")
        return o, (q, k, v, cu_seqlens, kv_lens, o, lse)
    if by_splash(q, v, kv_lens, window_size, config):
        o, lse = _splash.forward(_local_mask(window_size), q, k, v, _segments(cu_seqlens, q.shape[1]), scale=scale,
                                 interpret=interpret)
        return o, (q, k, v, cu_seqlens, kv_lens, o, lse)
    k_seen, v_seen, lo, hi, span, _ = window_keys(q, k, v, cu_seqlens, kv_lens, window_size)
    o, lse = _flash.attend(q, k_seen, v_seen, lo, hi, scale=scale, key_span=span, interpret=interpret,
                           config=config, name="window")
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale, interpret=False, config=None):
    """Gradients (dq, dk, dv, None, None)."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    plan = resident(q, k, v, kv_lens, window_size, config, backward=True)
    if plan is not None:
        lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens)
        return (*_resident.backward(q, k, v, lo, hi, o, lse, do, *plan, scale=scale, interpret=interpret,
                                    name="window"), None, None)
    if by_splash(q, v, kv_lens, window_size, config):
        dq, dk, dv = _splash.backward(_local_mask(window_size), q, k, v, _segments(cu_seqlens, q.shape[1]), o, lse,
                                      do, scale=scale, interpret=interpret)
        return dq, dk, dv, None, None
    k_seen, v_seen, lo, hi, span, start = window_keys(q, k, v, cu_seqlens, kv_lens, window_size)
    dq, dk, dv = _flash.attend_backward(q, k_seen, v_seen, lo, hi, o, lse, do, scale=scale, key_span=span,
                                        query_span=span, interpret=interpret, config=config, name="window")
    return (dq, *window_uncut(k, v, dk, dv, start), None, None)


def _local_mask(window_size):
    """The window as splash's mask of a padded shape [TP, TP]: key j seen by query t iff t - window_size < j <= t."""
    return lambda shape: _splash.splash.LocalMask(shape, (int(window_size) - 1, 0), 0)


def _segments(cu_seqlens, T):
    """Packed sequences (cu_seqlens int [N + 1], B = 1) as splash's segment ids of the T queries and keys padded
    to whole lanes: token t's sequence, the padded tokens one after the last; None without cu_seqlens."""
    if cu_seqlens is None:
        return None
    TP = _splash.padded_rows(T)
    ids = jnp.searchsorted(cu_seqlens.astype(jnp.int32), jnp.arange(TP, dtype=jnp.int32), side="right") - 1
    ids = jnp.where(jnp.arange(TP) < T, ids, cu_seqlens.shape[0]).astype(jnp.int32)
    return _splash.splash.SegmentIds(q=ids, kv=ids)


# Resident kernels (training: no KV cache, no Config; nsa/pallas/tpu/_resident.py): a step's TB tokens against the
# contiguous key rows [t0 + TB - SPAN, t0 + TB) (t0 = i * TB, SPAN = W - 1 + TB rounded up to whole lanes: every key
# any of its tokens sees), k and v zero-padded in front by PAD = SPAN - TB rows so that every step's rows are a slice
# [i * TB, i * TB + SPAN) aligned to TB. At the standard shape (G = 16, TB = 16, W = 512) 256 x 640 logits a step,
# 80% of them seen (splash's blocks of 512 against a 512-token window see half of theirs). Each token's range from
# `nsa._varlen.window_key_range` (packed sequences: a sequence's start bounds its window). The backward: one pass to
# 32k tokens at the standard shape on a v5e, two at 64k, none at 128k (splash then runs it, from the same o and lse).

RESIDENT_WINDOW = True  # False: the window runs splash attention where it applies


def resident(q, k, v, kv_lens, window_size, config, backward):
    """(_resident.Layout, passes) of the window of q [B, T, HQ, Dk] over k, v [B, T, H, D] when the resident kernels
    run it (RESIDENT_WINDOW; window_size >= 1; `_resident.takes`), else None; passes by `_resident.plan`: (FORWARD,),
    or the first of selected.BACKWARD_PLANS whose every pass fits within selected.RESIDENT_SHARE of the chip's VMEM
    (at the standard shape on a TPU v5e one pass to 32k tokens, two at 64k)."""
    if not RESIDENT_WINDOW or int(window_size) < 1 or not _resident.takes(q, k, kv_lens, config):
        return None
    tb = _resident.RESIDENT_TOKENS
    span = round_up(min(int(window_size), q.shape[1]) - 1 + tb, lanes())
    lay = _resident.layout(q, k, v, span=span, pad=span - tb, advance=tb)
    passes = _resident.plan(lay, k.dtype, backward)
    return None if passes is None else (lay, passes)


