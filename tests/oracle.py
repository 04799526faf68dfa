"""Naive NumPy float64 oracle for Native Sparse Attention (NSA).

This module is the *ground truth* that the JAX reference implementation and the
GPU kernels of the ``nsa`` package are tested against.  It is written straight
from the op contract (compatible with fla's NSA), deliberately without any
cleverness: every op loops over batch / sequence / query position / head in
plain Python, builds an explicit dense visibility row (how many times each key
is seen by the query: 0 = masked, 2 = a selected block listed twice, ...) and
hands it to one tiny softmax routine, :func:`_attend`.  Everything is computed
in float64.  It is O(T^2) per head and meant for small test shapes only.  It
does not import JAX or the ``nsa`` package.

Conventions shared by every function
------------------------------------
* ``q``: ``[B, T, HQ, Dk]``; ``k``: ``[B, T, H, Dk]``; ``v``: ``[B, T, H, Dv]``;
  gates: ``[B, T, HQ]``; outputs: ``[B, T, HQ, Dv]``.
* ``G = HQ // H`` (any integer >= 1); query head ``j`` uses KV head ``j // G``.
* ``scale`` defaults to ``Dk ** -0.5``; logits are ``scale * q . k``.
* ``cu_seqlens``: optional int ``[N + 1]``, starting at 0, non-decreasing,
  ending at ``T``; requires ``B == 1``.  Each sequence is independent:
  positions and block ids restart at each sequence start ("in-sequence"), and
  nothing (window, blocks, compression) crosses a sequence boundary.  Empty
  sequences are allowed.
* A query that sees no key at all gets an all-zero output (and ``lse = -inf``
  where an lse is returned).
* Arrays are positional, everything else keyword-only.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "compress",
    "compressed_attention",
    "select_blocks",
    "with_slots",
    "selected_attention",
    "sliding_window_attention",
    "attention",
]


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _num_blocks(length, block_size):
    """ceil(length / block_size) for non-negative ints."""
    return -(-int(length) // int(block_size))


def _check_block_size(block_size):
    if int(block_size) != block_size or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return int(block_size)


def _segments(B, T, cu_seqlens, block_size=None):
    """List the independent sequences.

    Returns a list of ``(b, bos, eos, cbos)``:
      * ``b``: batch row holding the sequence,
      * ``[bos, eos)``: its token positions inside that row,
      * ``cbos``: row of its compressed row 0 in a compressed tensor packed the
        way :func:`compress` packs it (0 without ``cu_seqlens``; ``None`` if
        ``block_size`` is not given).  ``block_size`` here is the compression
        *stride* (the rows of a sequence are ``ceil(len / stride)``).
    Without ``cu_seqlens`` every batch row is one sequence ``[0, T)``.
    """
    if cu_seqlens is None:
        return [(b, 0, T, 0 if block_size is not None else None) for b in range(B)]
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1], got shape {cu.shape}")
    if not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be integer, got {cu.dtype}")
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1, got B={B}")
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu}")
    if np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    out = []
    cbos = 0
    for i in range(cu.shape[0] - 1):
        bos, eos = int(cu[i]), int(cu[i + 1])
        out.append((0, bos, eos, cbos if block_size is not None else None))
        if block_size is not None:
            cbos += _num_blocks(eos - bos, block_size)
    return out


def _group_size(HQ, H):
    if H < 1 or HQ % H != 0:
        raise ValueError(f"HQ={HQ} must be a positive multiple of H={H}")
    return HQ // H


def _default_scale(scale, Dk):
    return float(Dk) ** -0.5 if scale is None else float(scale)


def _attend(q, k, v, counts, scale):
    """Softmax attention of ONE query vector over keys weighted by multiplicity.

    Args:
      q: ``[Dk]`` query.
      k: ``[N, Dk]`` keys.
      v: ``[N, Dv]`` values.
      counts: ``[N]`` non-negative ints; key ``n`` appears ``counts[n]`` times
        in the softmax (0 = invisible).
      scale: logit scale.

    Returns:
      ``(o [Dv], lse scalar)`` where, with ``s_n = scale * q . k_n``,
      ``o = sum_n c_n exp(s_n) v_n / sum_n c_n exp(s_n)`` and
      ``lse = log sum_n c_n exp(s_n)``.  No visible key: ``o = 0, lse = -inf``.
    """
    counts = np.asarray(counts)
    vis = counts > 0
    if not np.any(vis):
        return np.zeros(v.shape[-1], dtype=np.float64), -np.inf
    s = scale * (k[vis] @ q)  # [n]
    c = counts[vis].astype(np.float64)  # [n]
    m = np.max(s)
    w = c * np.exp(s - m)  # unnormalised weights
    denom = np.sum(w)
    o = (w @ v[vis]) / denom
    lse = m + np.log(denom)
    return o, lse


# --------------------------------------------------------------------------- #
# compression
# --------------------------------------------------------------------------- #
def _check_stride(stride, block_size):
    """The compression stride (None: block_size); it must divide block_size."""
    d = block_size if stride is None else _check_block_size(stride)
    if block_size % d:
        raise ValueError(f"stride {d} must divide block_size {block_size}")
    return d


def compress(x, *, block_size, stride=None, cu_seqlens=None):
    """Mean-pool windows of ``block_size`` (l) tokens every ``stride`` (d) tokens.

    Args:
      x: ``[B, T, H, D]``.
      block_size: tokens per window, l.
      stride: tokens between window starts, d (default l: blocks that do not
        overlap); must divide l.
      cu_seqlens: optional ``[N + 1]`` (then ``B == 1``).

    Returns:
      float64 ``[B, ceil(T / d), H, D]`` without ``cu_seqlens``;
      ``[1, sum_i ceil(len_i / d), H, D]`` with it (sequence 0's rows
      first, then sequence 1's, ...).  Row ``i`` of a sequence is the mean of
      its in-sequence tokens ``[i * d, min(i * d + l, len))``; the last rows
      are averaged over their true length.
    """
    x = _f64(x)
    bs = _check_block_size(block_size)
    d = _check_stride(stride, bs)
    B, T, H, D = x.shape
    segs = _segments(B, T, cu_seqlens, d)
    if cu_seqlens is None:
        NC = _num_blocks(T, d)
    else:
        NC = sum(_num_blocks(eos - bos, d) for _, bos, eos, _ in segs)
    out = np.zeros((B, NC, H, D), dtype=np.float64)
    for b, bos, eos, cbos in segs:
        for c in range(_num_blocks(eos - bos, d)):
            start = bos + c * d
            stop = min(start + bs, eos)
            out[b, cbos + c] = x[b, start:stop].sum(axis=0) / (stop - start)
    return out


# --------------------------------------------------------------------------- #
# compressed branch
# --------------------------------------------------------------------------- #
def _visible_cmp_blocks(tt, seq_len, bs, d=None):
    """In-sequence compressed row ids visible to in-sequence position tt: row
    c (the window [c * d, c * d + bs)) is visible iff the whole window is in
    the past, c * d + bs - 1 <= tt (d = bs: (c + 1) * bs - 1 <= tt)."""
    d = bs if d is None else d
    return [c for c in range(_num_blocks(seq_len, d)) if c * d + bs - 1 <= tt]


def compressed_attention(q, k_cmp, v_cmp, *, block_size, stride=None, scale=None, cu_seqlens=None):
    """Attention of every token over the compressed (block-mean) keys/values.

    Args:
      q: ``[B, T, HQ, Dk]``.
      k_cmp: ``[B, NC, H, Dk]`` compressed keys, laid out as :func:`compress`
        lays them out (packed per sequence with ``cu_seqlens``).  Trailing extra
        rows are allowed and never read.
      v_cmp: ``[B, NC, H, Dv]`` compressed values.
      block_size: compression window l.
      stride: compression stride d (default l).
      scale: logit scale, default ``Dk ** -0.5``.
      cu_seqlens: optional ``[N + 1]`` (then ``B == 1``).

    Returns:
      ``o`` float64 ``[B, T, HQ, Dv]`` and ``lse`` float64 ``[B, T, HQ]``.  The
      query at in-sequence position ``t`` sees in-sequence row ``c`` iff
      ``c * d + l - 1 <= t``; ``lse`` is the natural-log
      log-sum-exp of the scaled logits over the visible blocks.  Queries that
      see no block get ``o = 0`` and ``lse = -inf``.
    """
    q, k_cmp, v_cmp = _f64(q), _f64(k_cmp), _f64(v_cmp)
    bs = _check_block_size(block_size)
    d = _check_stride(stride, bs)
    B, T, HQ, Dk = q.shape
    _, NC, H, _ = k_cmp.shape
    Dv = v_cmp.shape[-1]
    G = _group_size(HQ, H)
    scale = _default_scale(scale, Dk)
    o = np.zeros((B, T, HQ, Dv), dtype=np.float64)
    lse = np.full((B, T, HQ), -np.inf, dtype=np.float64)
    for b, bos, eos, cbos in _segments(B, T, cu_seqlens, d):
        for t in range(bos, eos):
            tt = t - bos
            counts = np.zeros(NC, dtype=np.int64)  # dense visibility row
            for c in _visible_cmp_blocks(tt, eos - bos, bs, d):
                if cbos + c >= NC:
                    raise ValueError(
                        f"k_cmp has {NC} rows but row {cbos + c} is needed")
                counts[cbos + c] = 1
            for j in range(HQ):
                h = j // G
                o[b, t, j], lse[b, t, j] = _attend(
                    q[b, t, j], k_cmp[b, :, h], v_cmp[b, :, h], counts, scale)
    return o, lse


# --------------------------------------------------------------------------- #
# block selection
# --------------------------------------------------------------------------- #
def _forced_blocks(cur):
    """Always-selected blocks in rank order: cur, cur - 1, 0 (those >= 0,
    without duplicates)."""
    forced = []
    for c in (cur, cur - 1, 0):
        if c >= 0 and c not in forced:
            forced.append(c)
    return forced


def with_slots(block_indices, slots):
    """A selection ``[..., S]`` widened to ``slots >= S`` slots with unused
    ones (-1): the same selection, as ``select_blocks`` gives it where more
    blocks cap the slots later (a sequence packed beside longer ones)."""
    pad = [(0, 0)] * (block_indices.ndim - 1) + [(0, slots - block_indices.shape[-1])]
    return np.pad(block_indices, pad, constant_values=-1)


def select_blocks(q, k_cmp, *, block_counts, block_size, compress_block_size=None,
                  compress_stride=None, scale=None, cu_seqlens=None):
    """Top-k block selection from compressed attention scores.

    k_cmp holds windows of ``l = compress_block_size`` tokens (default
    ``block_size``) every ``d = compress_stride`` tokens (default
    ``gcd(l, block_size)``); selection blocks have ``l' = block_size`` tokens.  For query position ``t``
    (in-sequence) and KV head ``h``:

    * For every query head ``j`` of the group (``j // G == h``),
      ``p_j(c) = softmax_c(scale * q[t, j] . k_cmp[c, h])`` over the visible
      compressed rows (``c * d + l - 1 <= t``, as in
      :func:`compressed_attention`); ``p_j(c) = 0`` for any other ``c``
      (negative ones included).
    * Eq. 9: ``score_j(blk) = sum_{m < l'/d} sum_{n < l/d} p_j((l'/d) * blk + m - n)``.
    * ``score(blk) = mean_j score_j(blk)`` (sum over the G heads, divided by G).
    * With ``cur = t // block_size``: blocks ``cur``, ``cur - 1`` and ``0``
      (those >= 0) are always selected, ranked first in exactly that order;
      blocks after ``cur`` are never selected.  All remaining candidates
      (blocks ``1 .. cur - 2``, which are all visible) follow by descending
      score, equal scores ordered by lower block id.
    * The first ``block_counts`` of this ranking are kept; unused slots are -1.
      There are ``S = min(block_counts, ceil(T / block_size))`` slots: no
      query has more blocks.

    Args:
      q: ``[B, T, HQ, Dk]``.
      k_cmp: ``[B, NC, H, Dk]`` compressed keys (packed as :func:`compress`
        packs them with ``cu_seqlens``; extra trailing rows are never read).
      block_counts: int, the blocks to keep.
      block_size: block size.
      scale: logit scale, default ``Dk ** -0.5``.
      cu_seqlens: optional ``[N + 1]`` (then ``B == 1``).

    Returns:
      int32 ``[B, T, H, S]``: each row in rank order, then -1s.
      Block ids are in-sequence ids.
    """
    q, k_cmp = _f64(q), _f64(k_cmp)
    bs = _check_block_size(block_size)
    l = bs if compress_block_size is None else _check_block_size(compress_block_size)
    d = _check_stride(math.gcd(l, bs) if compress_stride is None else compress_stride, l)
    if bs % d:
        raise ValueError(f"compress_stride {d} must divide block_size {bs}")
    if np.ndim(block_counts) != 0 or int(block_counts) != block_counts or block_counts < 0:
        raise ValueError(f"block_counts must be a non-negative int, got {block_counts!r}")
    B, T, HQ, Dk = q.shape
    S = min(int(block_counts), _num_blocks(T, bs))
    _, NC, H, _ = k_cmp.shape
    G = _group_size(HQ, H)
    scale = _default_scale(scale, Dk)
    out = np.full((B, T, H, S), -1, dtype=np.int32)
    for b, bos, eos, cbos in _segments(B, T, cu_seqlens, d):
        for t in range(bos, eos):
            tt = t - bos
            cur = tt // bs
            visible = _visible_cmp_blocks(tt, eos - bos, l, d)
            for c in visible:
                if cbos + c >= NC:
                    raise ValueError(
                        f"k_cmp has {NC} rows but row {cbos + c} is needed")
            forced = _forced_blocks(cur)
            for h in range(H):
                # p[c]: the mean over the group's query heads of p_j(c)
                p_row = {c: 0.0 for c in visible}
                for j in range(h * G, (h + 1) * G):
                    logits = np.array(
                        [scale * np.dot(q[b, t, j], k_cmp[b, cbos + c, h]) for c in visible],
                        dtype=np.float64)
                    if len(visible) > 0:
                        e = np.exp(logits - np.max(logits))
                        p = e / np.sum(e)
                        for c, pc in zip(visible, p):
                            p_row[c] += pc / G
                # Eq. 9, literally: score[blk] = sum_m sum_n p[(l'/d) blk + m - n]
                score = {blk: sum(p_row.get((bs // d) * blk + m - n, 0.0)
                                  for m in range(bs // d) for n in range(l // d))
                         for blk in range(cur + 1)}
                rest = [c for c in range(cur + 1) if c not in forced]
                rest.sort(key=lambda c: (-score[c], c))
                ranking = forced + rest
                for slot, c in enumerate(ranking[:S]):
                    out[b, t, h, slot] = c
    return out


# --------------------------------------------------------------------------- #
# selected branch
# --------------------------------------------------------------------------- #
def _per_row_counts(block_counts, B, T, H, S):
    """Number of leading slots of block_indices to use per (b, t, h), clamped to
    [0, S].  None -> S; int -> that int for every row; array -> per row."""
    if block_counts is None:
        n = np.full((B, T, H), S, dtype=np.int64)
    elif np.ndim(block_counts) == 0:
        n = np.full((B, T, H), int(block_counts), dtype=np.int64)
    else:
        n = np.asarray(block_counts).astype(np.int64)
        if n.shape != (B, T, H):
            raise ValueError(f"block_counts array must be [B, T, H]={(B, T, H)}, got {n.shape}")
    return np.clip(n, 0, S)


def selected_attention(q, k, v, block_indices, *, block_counts=None, block_size=64,
                       scale=None, cu_seqlens=None):
    """Attention over the tokens of selected blocks.

    Query position ``t`` (in-sequence) of KV head ``h`` -- i.e. all G query heads
    ``j`` with ``j // G == h`` -- attends to the in-sequence positions ``<= t``
    of each block listed in ``block_indices[b, t, h, :count]``; block ``c``
    covers in-sequence positions ``[c * block_size, (c + 1) * block_size)``.
    Entries ``< 0`` or ``> t // block_size`` are ignored; a block listed twice
    contributes its keys twice to the softmax.  A row that sees nothing gives 0.

    Args:
      q: ``[B, T, HQ, Dk]``.
      k: ``[B, T, H, Dk]``.
      v: ``[B, T, H, Dv]``.
      block_indices: int ``[B, T, H, S]`` in-sequence block ids.
      block_counts: ``None`` (use all ``S`` slots), an int, or an int array
        ``[B, T, H]``: how many leading slots of each row are used (clamped to
        ``[0, S]``).
      block_size: block size.
      scale: logit scale, default ``Dk ** -0.5``.
      cu_seqlens: optional ``[N + 1]`` (then ``B == 1``).

    Returns:
      float64 ``[B, T, HQ, Dv]``.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    bs = _check_block_size(block_size)
    block_indices = np.asarray(block_indices)
    B, T, HQ, Dk = q.shape
    H = k.shape[2]
    Dv = v.shape[-1]
    G = _group_size(HQ, H)
    if block_indices.ndim != 4 or block_indices.shape[:3] != (B, T, H):
        raise ValueError(f"block_indices must be [B, T, H, S], got {block_indices.shape}")
    S = block_indices.shape[-1]
    n_used = _per_row_counts(block_counts, B, T, H, S)
    scale = _default_scale(scale, Dk)
    o = np.zeros((B, T, HQ, Dv), dtype=np.float64)
    for b, bos, eos, _ in _segments(B, T, cu_seqlens):
        for t in range(bos, eos):
            tt = t - bos
            cur = tt // bs
            for h in range(H):
                counts = np.zeros(T, dtype=np.int64)  # dense multiplicity row
                for idx in block_indices[b, t, h, : n_used[b, t, h]]:
                    idx = int(idx)
                    if idx < 0 or idx > cur:
                        continue
                    for pos in range(idx * bs, min((idx + 1) * bs, tt + 1)):
                        counts[bos + pos] += 1
                for j in range(h * G, (h + 1) * G):
                    o[b, t, j], _ = _attend(q[b, t, j], k[b, :, h], v[b, :, h], counts, scale)
    return o


# --------------------------------------------------------------------------- #
# sliding-window branch
# --------------------------------------------------------------------------- #
def sliding_window_attention(q, k, v, *, window_size, scale=None, cu_seqlens=None):
    """Causal sliding-window attention.

    Key at in-sequence position ``s`` is visible to the query at in-sequence
    position ``t`` of the same sequence iff ``t - window_size < s <= t``
    (so ``window_size <= 0`` sees nothing and gives 0 everywhere).

    Args:
      q: ``[B, T, HQ, Dk]``; k: ``[B, T, H, Dk]``; v: ``[B, T, H, Dv]``.
      window_size: window length (the query itself included).
      scale: logit scale, default ``Dk ** -0.5``.
      cu_seqlens: optional ``[N + 1]`` (then ``B == 1``).

    Returns:
      float64 ``[B, T, HQ, Dv]``.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    W = int(window_size)
    B, T, HQ, Dk = q.shape
    H = k.shape[2]
    Dv = v.shape[-1]
    G = _group_size(HQ, H)
    scale = _default_scale(scale, Dk)
    o = np.zeros((B, T, HQ, Dv), dtype=np.float64)
    for b, bos, eos, _ in _segments(B, T, cu_seqlens):
        for t in range(bos, eos):
            tt = t - bos
            counts = np.zeros(T, dtype=np.int64)  # dense visibility row
            s = np.arange(eos - bos)  # in-sequence key positions of this sequence
            counts[bos:eos] = ((tt - W < s) & (s <= tt)).astype(np.int64)
            for j in range(HQ):
                h = j // G
                o[b, t, j], _ = _attend(q[b, t, j], k[b, :, h], v[b, :, h], counts, scale)
    return o


# --------------------------------------------------------------------------- #
# full NSA
# --------------------------------------------------------------------------- #
def attention(q, k, v, *, g_cmp=None, g_slc=None, g_swa=None, block_indices=None,
              block_counts=16, block_size=64, compress_block_size=None,
              compress_stride=None, window_size=0, scale=None, cu_seqlens=None):
    """Native Sparse Attention: gated sum of the three branches.

    ``o = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa`` (gates ``[B, T, HQ]``
    broadcast over the last dim), where

    * the compressed branch is on iff ``g_cmp`` is given:
      ``o_cmp = compressed_attention(q, compress(k), compress(v))``;
    * the selected branch is always on:
      ``o_slc = selected_attention(q, k, v, block_indices, block_counts=...)``;
      a missing ``g_slc`` means weight 1;
    * the sliding-window branch is on iff ``window_size > 0``; a missing
      ``g_swa`` means weight 1 (``g_swa`` is ignored when the branch is off).

    With ``block_indices=None`` the selection is
    ``select_blocks(q, compress(k), block_counts=block_counts, ...)``, whether
    or not ``g_cmp`` is given.  If ``block_counts`` is then a per-row array
    ``[B, T, H]``, ``max(block_counts)`` slots are selected and each row uses
    its own leading ``block_counts[b, t, h]`` of them (= its own top-k, since
    rows are in rank order).

    Args:
      q: ``[B, T, HQ, Dk]``; k: ``[B, T, H, Dk]``; v: ``[B, T, H, Dv]``.
      g_cmp, g_slc, g_swa: optional gates ``[B, T, HQ]``.
      block_indices: optional int ``[B, T, H, S]`` (in-sequence block ids).
      block_counts: int or int array ``[B, T, H]``.
      block_size: selection block size l'.
      compress_block_size, compress_stride: compression windows of l tokens
        (default ``block_size``) every d tokens (default ``gcd(l, block_size)``).
      window_size: sliding window size (0 = branch off).
      scale: logit scale, default ``Dk ** -0.5``.
      cu_seqlens: optional ``[N + 1]`` (then ``B == 1``).

    Returns:
      float64 ``[B, T, HQ, Dv]``.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    bs = _check_block_size(block_size)
    B, T, HQ, Dk = q.shape
    H = k.shape[2]

    l = bs if compress_block_size is None else compress_block_size
    d = math.gcd(l, bs) if compress_stride is None else compress_stride
    if block_indices is None:
        k_cmp = compress(k, block_size=l, stride=d, cu_seqlens=cu_seqlens)
        if np.ndim(block_counts) == 0:
            n_slots = int(block_counts)
        else:
            bc = np.asarray(block_counts)
            n_slots = int(bc.max()) if bc.size else 0
        block_indices = select_blocks(q, k_cmp, block_counts=n_slots, block_size=bs,
                                      compress_block_size=l, compress_stride=d,
                                      scale=scale, cu_seqlens=cu_seqlens)

    o_slc = selected_attention(q, k, v, block_indices, block_counts=block_counts,
                               block_size=bs, scale=scale, cu_seqlens=cu_seqlens)
    w_slc = np.ones((B, T, HQ)) if g_slc is None else _f64(g_slc)
    o = w_slc[..., None] * o_slc

    if g_cmp is not None:
        k_cmp = compress(k, block_size=l, stride=d, cu_seqlens=cu_seqlens)
        v_cmp = compress(v, block_size=l, stride=d, cu_seqlens=cu_seqlens)
        o_cmp, _ = compressed_attention(q, k_cmp, v_cmp, block_size=l, stride=d, scale=scale,
                                        cu_seqlens=cu_seqlens)
        o = o + _f64(g_cmp)[..., None] * o_cmp

    if window_size > 0:
        o_swa = sliding_window_attention(q, k, v, window_size=window_size, scale=scale,
                                         cu_seqlens=cu_seqlens)
        w_swa = np.ones((B, T, HQ)) if g_swa is None else _f64(g_swa)
        o = o + w_swa[..., None] * o_swa

    return o
