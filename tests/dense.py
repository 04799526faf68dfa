"""A dense, differentiable JAX formulation of every branch, for gradient checks.

Independent of nsa.reference: each branch is one softmax over all T (or NC) keys with a dense
multiplicity matrix counts [B, T, H, K] built in NumPy from the contract (how many times query t of
KV head h attends key j; 0 = hidden). p = counts * exp(s) / sum(counts * exp(s)). jax.grad of these
functions in float64 is the gradient every implementation is checked against.
"""

import jax.numpy as jnp
import numpy as np


def segments(B, T, cu_seqlens):
    """(in-sequence position [B or 1, T], global index of the sequence start [B or 1, T])."""
    if cu_seqlens is None:
        return np.broadcast_to(np.arange(T), (B, T)), np.zeros((B, T), int)
    cu = np.asarray(cu_seqlens)
    pos, start = np.zeros(T, int), np.zeros(T, int)
    for a, b in zip(cu[:-1], cu[1:]):
        pos[a:b], start[a:b] = np.arange(b - a), a
    return pos[None], start[None]


def _first_rows(cu_seqlens, T, block_size):
    """Row of each token's sequence's compressed block 0 in compress's packing, [1, T]."""
    rows = np.zeros(T, int)
    if cu_seqlens is None:
        return rows[None]
    cu, row = np.asarray(cu_seqlens), 0
    for a, b in zip(cu[:-1], cu[1:]):
        rows[a:b] = row
        row += -(-(b - a) // block_size)
    return rows[None]


def window_counts(B, T, H, window_size, cu_seqlens=None):
    pos, start = segments(B, T, cu_seqlens)
    t = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    seen = (j <= t) & (j > t - window_size) & (j >= start[:, :, None])
    return np.broadcast_to(seen[:, :, None, :], (B, T, H, T)).astype(float)


def compressed_counts(B, T, H, NC, block_size, cu_seqlens=None, stride=None):
    """Row i (its window [i * d, i * d + l) in its sequence, d = stride, default l = block_size) is seen by the
    query at in-sequence position p iff i * d + l <= p + 1."""
    d = block_size if stride is None else stride
    pos, _ = segments(B, T, cu_seqlens)
    first = _first_rows(cu_seqlens, T, d)
    i = np.arange(NC) - first[..., None]  # in-sequence row
    seen = (i >= 0) & (i * d + block_size <= pos[..., None] + 1)
    return np.broadcast_to(np.broadcast_to(seen, (B, T, NC))[:, :, None, :], (B, T, H, NC)).astype(float)


def selected_counts(block_indices, block_counts, block_size, cu_seqlens=None):
    idx = np.asarray(block_indices)
    B, T, H, S = idx.shape
    counts = np.broadcast_to(np.asarray(S if block_counts is None else block_counts), (B, T, H))
    pos, start = segments(B, T, cu_seqlens)
    pos, start = np.broadcast_to(pos, (B, T)), np.broadcast_to(start, (B, T))
    out = np.zeros((B, T, H, T))
    for b, t, h in np.ndindex(B, T, H):
        for c in idx[b, t, h, :max(0, counts[b, t, h])]:
            if 0 <= c <= pos[b, t] // block_size:
                lo = start[b, t] + c * block_size
                out[b, t, h, lo:start[b, t] + min((c + 1) * block_size, pos[b, t] + 1)] += 1
    return out


def attend(q, k, v, counts, scale):
    """q [B, T, HQ, Dk], k [B, K, H, Dk], v [B, K, H, Dv], counts [B, T, H, K] -> (o, lse)."""
    B, T, HQ, _ = q.shape
    H = k.shape[2]
    c = jnp.repeat(jnp.asarray(counts), HQ // H, axis=2)  # [B, T, HQ, K]
    kk = jnp.repeat(k, HQ // H, axis=2)
    vv = jnp.repeat(v, HQ // H, axis=2)
    s = scale * jnp.einsum("bthd,bkhd->bthk", q, kk)
    seen = c > 0
    m = jnp.max(jnp.where(seen, s, -jnp.inf), axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(seen, c * jnp.exp(jnp.where(seen, s - m, 0.0)), 0.0)
    total = jnp.sum(w, axis=-1)
    o = jnp.einsum("bthk,bkhd->bthd", w / jnp.where(total > 0, total, 1.0)[..., None], vv)
    lse = jnp.where(total > 0, m[..., 0] + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    return o, lse


def _rows_of_sequences(cu_seqlens, T, stride):
    """[1, T]: how many compressed rows each token's sequence has, ceil(len / stride)."""
    if cu_seqlens is None:
        return np.full((1, T), -(-T // stride))
    cu, rows = np.asarray(cu_seqlens), np.zeros(T, int)
    for a, b in zip(cu[:-1], cu[1:]):
        rows[a:b] = -(-(b - a) // stride)
    return rows[None]


def compress(x, block_size, cu_seqlens=None, stride=None):
    """Window means (windows of block_size tokens every `stride`, default block_size) as a dense averaging matrix:
    [B, T, H, D] -> [B, NC, H, D]; token p of a sequence is in its rows i with i * d <= p < i * d + l."""
    d = block_size if stride is None else stride
    B, T = x.shape[:2]
    pos, _ = segments(B, T, cu_seqlens)
    first = _first_rows(cu_seqlens, T, d)[0]
    NC = int((first + _rows_of_sequences(cu_seqlens, T, d)[0]).max(initial=0))
    avg = np.zeros((NC, T))
    for t in range(T):
        p = pos[0, t]
        for i in range(p // d + 1):
            if p < i * d + block_size:
                avg[first[t] + i, t] = 1
    avg /= np.maximum(avg.sum(1, keepdims=True), 1)
    return jnp.einsum("ct,bthd->bchd", avg, x)
