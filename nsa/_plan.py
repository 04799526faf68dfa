"""The XLA-side index planning of nsa's kernels: what a kernel family builds around its kernels, in plain jnp.

Nothing here is a kernel or names a platform: each function builds, from the op's arguments, index arrays that
some family's kernels read (Pallas's Mosaic TPU and Mosaic GPU kernels, and nsa/triton for the backward's
pre-pass), traced with the op and compiled by XLA. Splash attention keeps this kind of work in a module of its
own too (jax's splash_attention_mask_info.py). Shapes are named [B, T, H, S]-style: B batch rows, T queries, TK
key rows, HQ query heads, H KV heads, G = HQ / H, S slots per query, NR block rows per (batch row, KV head).

- zero padding: `padded`;
- the backward's pre-pass: `rounded`, `kernel_delta`;
- query ranges [lo, hi] and their bands of tiles: `padded_ranges`, `bands` (per tile of one side, the first and
  last tile of the other side any of its rows sees) and `band` (reading one, also inside a kernel);
- packed heads (a KV cache's G query heads of a KV head as G rows of one head): `packs`, `packed`, `unpacked`,
  `packed_attend`, `packed_attend_backward`;
- the sliding window over a long KV cache, cut to the rows its queries' windows span: `window_keys`,
  `window_uncut`;
- block selection: `num_candidates`;
- selected attention: the kernels' inputs checked (`check_selected`), the sizes of the tables (`Tiling`), each
  slot named by its block's first key row (`block_names`), the names per tile of TB query tokens (`tile_names`,
  `tile_unions`, `tile_starts`, `row_offsets`; `union_share`: how much a tile's tokens share), the selections
  inverted into one list per block (`key_blocks`; `tile_lists`, entries per tile, and `token_lists`, entries per
  token; Triton's `block_rows` and `query_lists`, entries per slot), the lists cut into segments (`segments`), and
  the lists' sums gathered back per key row (`per_key_row`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nsa._varlen import cdiv, num_compressed_blocks, tokens, window_key_range

NONE = -1  # the name of a skipped slot (`block_names`)
PAST = np.iinfo(np.int32).max  # sorts after every name: the empty places of a union


def padded(x, axis, size):
    """x zero-padded along `axis` to `size` (x itself when it already has that size)."""
    missing = size - x.shape[axis]
    return x if missing == 0 else jnp.pad(x, [(0, missing if a == axis else 0) for a in range(x.ndim)])


# ------------------------------------------------------------------------------------------ the backward's pre-pass


def rounded(x, dtype):
    """x as float32, rounded to the precision of `dtype` (no-op for 32-bit and wider dtypes) even where XLA may
    keep more: with xla_allow_excess_precision (on by default on GPUs) a bfloat16 value that XLA computes and then
    reads back in float32 may skip its rounding, while a kernel always reads it rounded."""
    info = jnp.finfo(dtype)
    x = x.astype(jnp.float32)
    return x if info.bits >= 32 else lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def kernel_delta(o, do, dtype, lse=None, dlse=None):
    """The pre-pass of a kernel's backward: sum(o * do) [B, T, HQ] float32 over o and do [B, T, HQ, Dv] as the
    kernel reads them (in `dtype`), so that it cancels the kernel's do . v where it should (a query that sees one
    key has ds = p * (do . v - delta) = 0 only if delta uses the same rounded do); with lse's cotangent dlse
    [B, T, HQ], the lse path folded in: minus dlse where lse is finite (ds = p * (dp - delta + dlse))."""
    delta = jnp.sum(rounded(o, dtype) * rounded(do, dtype), axis=-1)
    if dlse is not None:
        delta = delta - jnp.where(jnp.isfinite(lse), dlse.astype(jnp.float32), 0.0)
    return delta


# ------------------------------------------------------------------------------------------ ranges and bands


def padded_ranges(lo, hi, size):
    """lo, hi int32 [R, T] (query t sees the key rows [lo, hi]) padded to `size` queries, the padded ones seeing
    nothing (lo 1, hi 0): (lo, hi) [R, size]."""
    padding = jnp.arange(size) >= lo.shape[1]
    return jnp.where(padding, 1, padded(lo, 1, size)), jnp.where(padding, 0, padded(hi, 1, size))


def bands(first, last, num_tiles, tile):
    """int32 [R * 2 * num_tiles], flat (SMEM pads a 2-D array's minor dim to 128 words): for each row r of
    first, last [R, N] (per row of one side, the first and last row of the other side it sees), the first
    tile of `tile` rows of the other side that any row of each of its num_tiles tiles sees, then the last
    (`band` reads them); 0 and -1 for a tile whose rows see nothing."""
    seen = (first <= last).reshape(first.shape[0], num_tiles, -1)
    lo = jnp.min(jnp.where(seen, first.reshape(seen.shape), jnp.iinfo(jnp.int32).max), axis=2)
    hi = jnp.max(jnp.where(seen, last.reshape(seen.shape), -1), axis=2)
    any_seen = jnp.any(seen, axis=2)
    table = jnp.concatenate([jnp.where(any_seen, lo // tile, 0), jnp.where(any_seen, hi // tile, -1)], axis=1)
    return table.astype(jnp.int32).reshape(-1)


def band(table, row, tile, num_tiles):
    """(first, last): the ends of the band of tile `tile` (of num_tiles) in row `row` of the flat `bands` table
    (an array, or a kernel's ref of it)."""
    base = row * 2 * num_tiles
    return table[base + tile], table[base + num_tiles + tile]


# ------------------------------------------------------------------------------------------ packed heads


def packed(x, G):
    """[B, T, H * G, ...] -> [B, T * G, H, ...]: the G query heads of each KV head as G consecutive rows of
    one head (row t * G + g is token t, head h * G + g)."""
    B, T, HQ = x.shape[:3]
    x = x.reshape((B, T, HQ // G, G) + x.shape[3:])
    return jnp.swapaxes(x, 2, 3).reshape((B, T * G, HQ // G) + x.shape[4:])


def unpacked(x, G):
    """`packed`'s inverse: [B, T * G, H, ...] -> [B, T, H * G, ...]."""
    B, TG, H = x.shape[:3]
    x = x.reshape((B, TG // G, G, H) + x.shape[3:])
    return jnp.swapaxes(x, 2, 3).reshape((B, TG // G, H * G) + x.shape[4:])


def packs(q, k, lo):
    """G when the query heads of q [B, T, HQ, D] over k [B, NK, H, D] are packed as rows (`packed`): with
    per-row ranges lo [B, T] (a KV cache: few queries per sequence, where one query tile per head would hold a
    row or two and each of the G heads would read its KV head's keys again), else 1."""
    G = q.shape[2] // k.shape[2]
    return G if lo.ndim == 2 and G > 1 else 1


def packed_attend(attend_fn, q, k, v, lo, hi):
    """attend_fn(q, k, v, lo, hi) -> (o [B, T, HQ, Dv], lse [B, T, HQ]), run on the packed heads when `packs`
    (then unpacked)."""
    G = packs(q, k, lo)
    if G == 1:
        return attend_fn(q, k, v, lo, hi)
    rows = lambda x: jnp.repeat(x, G, axis=-1)
    o, lse = attend_fn(packed(q, G), k, v, rows(lo), rows(hi))
    return unpacked(o, G), unpacked(lse, G)


def packed_attend_backward(backward_fn, q, k, v, lo, hi, o, lse, do, dlse, query_span):
    """backward_fn(q, k, v, lo, hi, o, lse, do, dlse, query_span=...) -> (dq, dk, dv), run on the packed heads
    when `packs` (then G times as many rows see one key row: query_span is scaled by G)."""
    G = packs(q, k, lo)
    if G == 1:
        return backward_fn(q, k, v, lo, hi, o, lse, do, dlse, query_span=query_span)
    rows = lambda x: jnp.repeat(x, G, axis=-1)
    dq, dk, dv = backward_fn(packed(q, G), k, v, rows(lo), rows(hi), packed(o, G), packed(lse, G),
                             packed(do, G), None if dlse is None else packed(dlse, G), query_span=query_span * G)
    return unpacked(dq, G), dk, dv


# ------------------------------------------------------------------------------------------ the sliding window


def window_start(T, TK, window_size, kv_lens):
    """With a KV cache longer than the L = T + W - 1 key rows its T queries' windows span (a decode step):
    int32 [B], the first of them in each batch row (kv_lens[b] - L, or 0 for a shorter sequence); else None."""
    if kv_lens is None or window_size < 1 or T + window_size - 1 >= TK:
        return None
    return jnp.maximum(kv_lens.astype(jnp.int32) - (T + int(window_size) - 1), 0)


def _cut(x, start, rows):
    """x [B, TK, H, D] -> [B, rows, H, D]: the rows from start[b] on of each batch row (a gather)."""
    return jax.vmap(lambda x, s: lax.dynamic_slice_in_dim(x, s, rows, axis=0))(x, start)


def row_slices(x, first, start, head, size):
    """x [N, R, H, D] -> [..., size, D]: the `size` consecutive rows x[first, start + i, head] for each entry of
    first, start and head (int, one shape [...]), read as one slice of all H heads a block, [1, size, H, D]
    (whole tiles of the cache's TPU layout, whose minor dims are H and D: a slice of one head made XLA relay out
    the whole cache first), then each entry's own head. One gather index a block, not one a row (on a TPU v5e a
    decode step's row-by-row gather of its selected blocks took a third of the step). Each slice must lie within
    the R rows: XLA moves one that would run past them back to end at R."""
    one = lambda f, s: lax.dynamic_slice(x, (f, s, 0, 0), (1, size) + x.shape[2:])[0]
    for _ in range(first.ndim):
        one = jax.vmap(one)
    blocks = one(first.astype(jnp.int32), start.astype(jnp.int32))  # [..., size, H, D]
    own = jnp.arange(x.shape[2], dtype=jnp.int32) == head.astype(jnp.int32)[..., None, None]  # [..., 1, H]
    return jnp.where(own[..., None], blocks, 0).sum(axis=-2, dtype=x.dtype)


def window_keys(q, k, v, cu_seqlens, kv_lens, window_size):
    """What a flash kernel takes for the sliding window of q [B, T, HQ, Dk] over k [B, TK, H, Dk], v [B, TK, H, Dv]
    (kv_lens None, TK = T, or int32 [B]): (k, v, lo, hi, span, start). With a KV cache longer than the
    L = T + W - 1 rows the T queries' windows span (a decode step, a short chunk), k and v cut to those rows of
    each batch row, [B, L, H, D] (a gather of L rows per KV head: the kernels never see, and XLA never copies or
    relays out, the rest of the cache), and start int32 [B] the first of them; else k and v themselves and start
    None. lo, hi `nsa._varlen.window_key_range` of those rows; span = W = min(window_size, rows) (at least 1):
    both the most key rows one query sees and the most queries one key row is seen by."""
    start = window_start(q.shape[1], k.shape[1], window_size, kv_lens)
    if start is not None:
        rows = q.shape[1] + int(window_size) - 1
        k, v, kv_lens = _cut(k, start, rows), _cut(v, start, rows), kv_lens - start
    lo, hi = window_key_range(q.shape[1], window_size, cu_seqlens, kv_lens)
    return k, v, lo, hi, max(1, min(int(window_size), k.shape[1])), start


def window_uncut(k, v, dk, dv, start):
    """The gradients dk, dv of `window_keys`' cut rows scattered back to k's and v's [B, TK, H, D] (the cut's
    transpose); dk, dv themselves where start is None (nothing was cut)."""
    if start is None:
        return dk, dv
    uncut = lambda x, dx: jax.vjp(functools.partial(_cut, start=start, rows=dx.shape[1]), x)[1](dx)[0]
    return uncut(k, dk), uncut(v, dv)


# ------------------------------------------------------------------------------------------ block selection


def num_candidates(T, NC, block_size, kv_lens, compress_stride=None):
    """NB, the in-sequence selection blocks one of T queries may have as candidates (as the reference):
    cdiv(T, block_size), or with kv_lens (the queries end longer sequences, which k_cmp [B, NC, H, Dk] covers: NC
    rows every compress_stride tokens, None: block_size) the blocks of those NC * compress_stride tokens if more."""
    covered = NC * (block_size if compress_stride is None else compress_stride)
    return cdiv(T, block_size) if kv_lens is None else max(cdiv(T, block_size), cdiv(covered, block_size))


# ------------------------------------------------------------------------------------------ selected attention


def check_selected(q, k, block_indices, block_size):
    """ValueError naming the argument unless q [B, T, HQ, Dk], k [B, TK, H, Dk] and block_indices [B, T, H, S] fit
    together (H dividing HQ) and block_size is positive: what selected attention's kernels need of their inputs."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q: expected a multiple of k's {k.shape[2]} KV heads, got {q.shape[2]} heads")
    if block_indices.shape[:3] != (q.shape[0], q.shape[1], k.shape[2]):
        raise ValueError(f"block_indices: expected shape [B, T, H, S] = {q.shape[:2] + k.shape[2:3]} + [S], "
                         f"got {block_indices.shape}")
    if int(block_size) < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size}")


class Tiling:
    """The sizes of selected attention's tables for q [B, T, HQ, Dk] against k [B, TK, H, Dk] (G = HQ / H) and
    block_indices [B, T, H, S], its T queries in NT tiles of TB = `tile` tokens: NR = num_rows block rows per
    (batch row, KV head) of the TK key rows (a static bound on the distinct blocks), U = union the most distinct
    blocks one tile may list (min(tokens of a tile * S, NR)). A family's layout extends it with its own sizes."""

    def __init__(self, q, k, block_indices, block_size, cu_seqlens, tile):
        self.B, self.T, HQ = q.shape[:3]
        self.TK, self.H, self.S = k.shape[1], k.shape[2], block_indices.shape[3]
        self.G = HQ // self.H
        self.tb, self.nt = tile, cdiv(self.T, tile)
        self.num_rows = num_compressed_blocks(self.TK, block_size, cu_seqlens)
        self.union = min(min(self.T, tile) * self.S, self.num_rows)


def row_offsets(kv_lens, T):
    """int32 [1 or B]: the key row of each batch row's query 0 (query t is key row t + offset): kv_lens[b] - T
    with a KV cache (kv_lens int [B]), else 0."""
    return jnp.zeros((1,), jnp.int32) if kv_lens is None else kv_lens.astype(jnp.int32) - T


def block_names(block_indices, block_counts, cu_seqlens, kv_lens, *, block_size):
    """int32 [B, T, H, S]: each slot of block_indices [B, T, H, S] naming its block by the block's first global
    key row (sequence start + block * block_size), NONE where skipped (past block_counts [B, T, H] or a scalar,
    negative, or after the query's own block)."""
    T, S = block_indices.shape[1], block_indices.shape[3]
    tok = tokens(T, block_size, cu_seqlens, kv_lens)
    pos, start = tok.pos[:, :, None, None], tok.start[:, :, None, None]
    blk = block_indices.astype(jnp.int32)
    counts = jnp.broadcast_to(jnp.asarray(block_counts, jnp.int32), block_indices.shape[:3])
    valid = (jnp.arange(S) < counts[..., None]) & (blk >= 0) & (blk <= pos // block_size)
    return jnp.where(valid, start + jnp.where(valid, blk, 0) * block_size, NONE)


def tile_names(names, tile):
    """`block_names` [B, T, H, S] -> [B, H, NT, TB, S] per tile of TB = `tile` tokens (NT = cdiv(T, TB)), the
    padded tokens listing nothing."""
    B, T, H, S = names.shape
    num_tiles = cdiv(T, tile)
    names = jnp.pad(names, [(0, 0), (0, num_tiles * tile - T), (0, 0), (0, 0)], constant_values=NONE)
    return jnp.transpose(names.reshape(B, num_tiles, tile, H, S), (0, 3, 1, 2, 4))


def tile_unions(names, offsets, size):
    """The union of each tile, from its `tile_names` [B, H, NT, TB, S] and the `row_offsets`: (union
    [B, H, NT, U] int32: the distinct names its tokens list, increasing, then PAST; last [B, H, NT, U]: the key
    row of the last token of the tile that lists each; count [B, H, NT]: how many), U = `size` (at least the
    most distinct names a tile may list)."""
    B, H, num_tiles, tile, S = names.shape
    shape = (B, H, num_tiles, tile * S)
    flat = names.reshape(shape)
    t = lax.broadcasted_iota(jnp.int32, shape, 2) * tile + lax.broadcasted_iota(jnp.int32, shape, 3) // S
    token = offsets[:, None, None, None] + t
    name, token = lax.sort((jnp.where(flat == NONE, PAST, flat), token), num_keys=2)
    run_end = jnp.concatenate([name[..., 1:] != name[..., :-1], jnp.ones_like(name[..., :1], bool)], -1)
    union, last = lax.sort((jnp.where(run_end, name, PAST), token), num_keys=1)
    return union[..., :size], last[..., :size], jnp.sum(union[..., :size] != PAST, axis=-1).astype(jnp.int32)


def union_share(names):
    """float32: the distinct names of each tile of `tile_names` [B, H, NT, TB, S] (NONE not counted), summed over
    the tiles, over the names its tokens list (0 where none list any): the blocks a kernel that loads each tile's
    union once for all its tokens loads, per block a kernel per token loads (1: the tokens share no block)."""
    B, H, num_tiles, tile, S = names.shape
    listed = jnp.where(names == NONE, PAST, names).reshape(B, H, num_tiles, tile * S)
    name = jnp.sort(listed, axis=-1)
    first = jnp.concatenate([jnp.ones_like(name[..., :1], bool), name[..., 1:] != name[..., :-1]], -1)
    distinct = jnp.sum(first & (name != PAST), dtype=jnp.float32)
    return distinct / jnp.maximum(jnp.sum(listed != PAST, dtype=jnp.float32), 1.0)


def tile_starts(offsets, shape, tile):
    """int32 `shape` = [B, H, NT]: t0, the key row of each tile's first token (tiles of `tile` tokens, the
    `row_offsets`)."""
    t0 = offsets[:, None, None] + jnp.arange(shape[2], dtype=jnp.int32) * tile
    return jnp.broadcast_to(t0, shape)


def key_blocks(keys, block_size, rows=None):
    """int32 [...]: the block row (among the NR of its batch row and KV head) of each key row of `rows` (int
    [...], a block's first row is its name), or [TK] of every key row without; keys = tokens(TK, block_size,
    cu_seqlens), the `nsa._varlen.Tokens` of the TK key rows."""
    if rows is None:
        return keys.cmp_start[0] + keys.pos[0] // block_size
    return keys.cmp_start[0][rows] + keys.pos[0][rows] // block_size


def _list_offsets(key, num_lists):
    """int32 [num_lists + 1]: where each list starts in the sorted keys (list i is key i's entries)."""
    return jnp.searchsorted(key, jnp.arange(num_lists + 1, dtype=jnp.int32), side="left").astype(jnp.int32)


def tile_lists(union, last, cu_seqlens, *, num_keys, block_size):
    """The selections inverted per tile: every (tile, union block) entry of `tile_unions`' union and last
    [B, H, NT, U] keyed by its list (b * H + h) * NR + block row (NR block rows of the num_keys key rows), stably
    sorted. Returns (offsets [NL + 1]: list i is the entries offsets[i] : offsets[i + 1]; tile [E]: each entry's
    query tile, increasing within a list; name [E]: its block's name; last [E]: the key row of the last token of
    the tile that lists it), E = B * H * NT * U."""
    B, H, num_tiles, _ = union.shape
    num_rows = num_compressed_blocks(num_keys, block_size, cu_seqlens)
    keys = tokens(num_keys, block_size, cu_seqlens)  # of the key rows: x itself is a block's first row
    valid = union != PAST
    x = jnp.where(valid, union, 0)
    row = key_blocks(keys, block_size, x)
    bh = (jnp.arange(B)[:, None] * H + jnp.arange(H)[None, :])[:, :, None, None]
    num_lists = B * H * num_rows
    key = jnp.where(valid, bh * num_rows + row, num_lists).reshape(-1)
    tile = jnp.broadcast_to(jnp.arange(num_tiles, dtype=jnp.int32)[:, None], union.shape).reshape(-1)
    key, tile, name, last = lax.sort((key, tile, x.reshape(-1), last.reshape(-1)), num_keys=1, is_stable=True)
    return _list_offsets(key, num_lists), tile, name, last


def token_lists(names, cu_seqlens, *, num_keys, block_size):
    """The selections inverted per token: each slot of `block_names` [B, T, H, S] keyed by its list
    (b * H + h) * NR + block row, the slots of one token naming one block merged into one entry (`times`: how
    many), and all B * T * H * S slots stably sorted by list, so that a list's tokens increase. Returns (offsets
    [NL + 1]: list i is the entries offsets[i] : offsets[i + 1]; per entry [E = B * T * H * min(S, NR)], those
    past offsets[NL] unused: bh = b * H + h (clamped below B * H), token (< T, every one), times, name)."""
    B, T, H, S = names.shape
    num_rows = num_compressed_blocks(num_keys, block_size, cu_seqlens)
    name = jnp.sort(jnp.where(names == NONE, PAST, names), axis=3)
    s = lax.broadcasted_iota(jnp.int32, name.shape, 3)
    differs = name[..., 1:] != name[..., :-1]
    edge = jnp.ones_like(name[..., :1], bool)
    run_start = lax.cummax(jnp.where(jnp.concatenate([edge, differs], -1), s, 0), axis=3)
    valid = jnp.concatenate([differs, edge], -1) & (name != PAST)  # a run's last slot: one per (token, block)
    keys = tokens(num_keys, block_size, cu_seqlens)  # of the key rows: x itself is a block's first row
    x = jnp.where(valid, name, 0)
    row = key_blocks(keys, block_size, x)
    bh = jnp.arange(B, dtype=jnp.int32)[:, None, None, None] * H + jnp.arange(H, dtype=jnp.int32)[:, None]
    num_lists = B * H * num_rows
    key = jnp.where(valid, bh * num_rows + row, num_lists)
    # one (key, slot) pair sort (a stable radix sort on a GPU), the rest gathered; a token lists at most NR distinct
    # blocks: the entries (sorted first) fit E = B * T * H * min(S, NR)
    key, slot = lax.sort((key.reshape(-1).astype(jnp.int32), jnp.arange(key.size, dtype=jnp.int32)), num_keys=1,
                         is_stable=True)
    E = B * T * H * min(S, num_rows)
    key, slot = key[:E], slot[:E]
    token = slot // (H * S) % T
    times, x = ((s + 1 - run_start).reshape(-1)[slot], x.reshape(-1)[slot])
    return _list_offsets(key, num_lists), jnp.minimum(key // num_rows, B * H - 1), token, times.astype(jnp.int32), x


def block_rows(T, block_size, cu_seqlens):
    """(NR, row_start [NR], row_end [NR]): the key block rows of T keys and the key rows [start, end) of each.

    Without cu_seqlens block row r is [r * bs, T) (T = TK, the rows of a KV cache, with kv_lens); packed, the
    rows of sequence i are numbered from tokens(...).cmp_start of its tokens, so a (sequence, in-sequence
    block) pair has one row.
    Rows past the real ones (a traced cu_seqlens pads to a static bound) get an empty range. (nsa/triton's
    selected attention.)
    """
    NR = num_compressed_blocks(T, block_size, cu_seqlens)
    r = jnp.arange(NR, dtype=jnp.int32)
    if cu_seqlens is None:
        return NR, r * block_size, jnp.full((NR,), T, jnp.int32)
    cu = cu_seqlens.astype(jnp.int32)
    blocks = cdiv(cu[1:] - cu[:-1], block_size)
    ends = jnp.cumsum(blocks)  # one past the last row of each sequence
    seq = jnp.searchsorted(ends, r, side="right")  # skips empty sequences
    real = seq < blocks.shape[0]
    seq = jnp.minimum(seq, blocks.shape[0] - 1)
    row_start = cu[seq] + (r - (ends[seq] - blocks[seq])) * block_size
    return NR, jnp.where(real, row_start, 0), jnp.where(real, cu[seq + 1], 0)


def query_lists(block_indices, block_counts, tok, B, T, H, NR, block_size):
    """The selections inverted: (offsets [B * H * NR + 1], query_tok [B * T * H * S]), both int32.

    Each valid entry (b, t, h, slot) is keyed by (b * H + h) * NR + cmp_start[b, t] + block; a stable
    sort groups the entries of each (batch, KV head, block row) in token order, and the queries of
    list i are query_tok[offsets[i] : offsets[i + 1]]. Invalid entries sort past every list. (nsa/triton's
    selected attention, whose entries are (token, slot) pairs, where `token_lists` merges a token's slots.)
    """
    S = block_indices.shape[-1]
    blk = block_indices.astype(jnp.int32)
    pos, cmp_start = tok.pos[:, :, None, None], tok.cmp_start[:, :, None, None]
    valid = ((jnp.arange(S) < block_counts[..., None]) & (block_indices >= 0)
             & (block_indices <= (pos // block_size)))
    bh = jnp.arange(B)[:, None, None, None] * H + jnp.arange(H)[None, None, :, None]
    num_lists = B * H * NR
    key = jnp.where(valid, bh * NR + cmp_start + jnp.where(valid, blk, 0), num_lists).reshape(-1)
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :, None, None], block_indices.shape).reshape(-1)
    key, query_tok = lax.sort((key, t), num_keys=1, is_stable=True)
    return _list_offsets(key, num_lists), query_tok


def segments(offsets, num_entries, seg_len):
    """The lists (list i: entries offsets[i] : offsets[i + 1], offsets int32 [NL + 1]) cut into segments of at
    most seg_len entries, all int32: (seg_offsets [NL + 1]: list i owns segments seg_offsets[i] :
    seg_offsets[i + 1], in entry order; seg_list, seg_lo, seg_hi [NSEG]: the list and the entries of each
    segment). NSEG = NL + ceil(num_entries / seg_len) bounds sum_i ceil(len_i / seg_len) statically; the
    segments past the real ones are empty."""
    NL = offsets.shape[0] - 1
    counts = cdiv(offsets[1:] - offsets[:-1], seg_len)
    seg_offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
    s = jnp.arange(NL + cdiv(num_entries, seg_len), dtype=jnp.int32)
    seg_list = jnp.searchsorted(seg_offsets[1:], s, side="right").astype(jnp.int32)
    real = seg_list < NL
    seg_list = jnp.where(real, seg_list, 0)
    lo = jnp.where(real, offsets[seg_list] + (s - seg_offsets[seg_list]) * seg_len, 0)
    hi = jnp.where(real, jnp.minimum(lo + seg_len, offsets[seg_list + 1]), 0)
    return seg_offsets, seg_list, lo, hi


def per_key_row(sums, shape, cu_seqlens, *, block_size):
    """sums [NL, BR, Dp] per (list, row in the block) -> `shape` = [B, TK, H, D] (D <= Dp): key row r of (b, h)
    is row pos[r] % block_size of list (b * H + h) * NR + its block row (`key_blocks`)."""
    B, TK, H, D = shape
    keys = tokens(TK, block_size, cu_seqlens)
    row = key_blocks(keys, block_size)  # [TK]
    lst = (jnp.arange(B)[:, None, None] * H + jnp.arange(H)[None, None, :]) * (sums.shape[0] // (B * H)) \
        + row[None, :, None]  # [B, TK, H]
    return sums[lst, (keys.pos[0] % block_size)[None, :, None], :D]


def blocks_of(block_size, compress_block_size=None, compress_stride=None):
    """(l', l, d) as a select kernel takes them: compress_block_size and compress_stride None mean block_size."""
    return (block_size,) + tuple(block_size if x is None else x for x in (compress_block_size, compress_stride))


def one_row_per_block(block_size, compress_block_size, compress_stride):
    """Whether selection block j scores compressed row j alone (l = d = l': fla's form), as the kernels that have
    no Eq. 9 sum take it."""
    return compress_block_size == compress_stride == block_size
