"""KV caches for serving NSA: dataclasses of arrays with their compression as static metadata (pytrees), and pure
functions that fill them.

A cache holds B sequences made with one set of blocks (static: the cache's pytree structure, not arrays): selection
blocks of l' = `block_size` tokens, compression windows of l = `compress_block_size` tokens every d =
`compress_stride` tokens (defaults as nsa.attention's: l = l', d = gcd(l, l')). Two layouts:

- `KVCache`, contiguous: each sequence its own rows, up to N tokens (its capacity):
  - k [B, N, H, Dk], v [B, N, H, Dv]: token t of sequence b at row t;
  - k_cmp [B, ceil(N / d), H, Dk], v_cmp [B, ceil(N / d), H, Dv]: the compressed keys and values.
- `PagedKVCache`, in pages (vLLM's block tables, jax's ragged paged attention): one pool of P pages of S tokens,
  shared by the sequences through a page table that the caller fills (a scheduler hands out page ids:
  `cache.replace(page_table=...)`); S a multiple of d:
  - k [P, S, H, Dk], v [P, S, H, Dv]: token t of sequence b at row t % S of page page_table[b, t // S];
  - k_cmp [P, S / d, H, Dk], v_cmp [P, S / d, H, Dv]: compressed row i of sequence b (the window
    [i * d, i * d + l)) in the page of its first token, row (i * d % S) / d;
  - page_table int32 [B, MP]: each sequence's pages in order (capacity MP * S tokens; -1 or any id outside the
    pool: no page; pages may repeat across sequences only where they are read, never written).

Both hold lens int32 [B], how many tokens each sequence holds (sequences differ: a ragged batch). Compressed row i
(`nsa.compress`'s window mean, bitwise, or a learned compression's row: `append_to_cache`'s phi) is written once
its window is complete (token i * d + l - 1 has arrived), never before, so a step never compresses the cache
again. Rows past a sequence's length (and compressed rows of
windows not yet complete) hold whatever was there; `nsa.attention` never reads them for a query's result.

A step appends each sequence's new tokens (0 for an idle slot, 1 for decode, a chunk for prefill: `lens=`, the
same count that `nsa.attention` takes as `q_lens=`), then attends with the cache, which brings its keys,
compressed rows, lengths and blocks along (so none can be mismatched or forgotten):

    cache = nsa.append_to_cache(cache, k_new, v_new, lens=n)          # k_new [B, TN, H, Dk], n int [B] <= TN
    o = nsa.attention(q_new, cache=cache, q_lens=n, g_cmp=..., ...)   # q_new [B, TN, HQ, Dk]

Both are pure: under `jax.jit(step, donate_argnums=...)` with the cache donated, XLA writes the new rows in
place (scatters into the donated buffers), and the step compiles once for every length and page table, since
they are data.
"""

from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from nsa import _checks
from nsa import _kvcache
from nsa._kvcache import Cache, KVCache, PagedKVCache, check_cache, flat_rows, readable_lens
from nsa._varlen import cdiv, concrete
from nsa.api import Array, Indices, compress

__all__ = ["KVCache", "PagedKVCache", "append_to_cache", "check_cache", "empty_cache", "empty_paged_cache",
           "prefill_cache", "readable_lens"]

# a learned compression: windows [B, R, l, H, D] -> compressed rows [B, R, H, D] (one for the keys and the values, or
# a pair (phi_k, phi_v)); None: the windows' means
Phi = Union[None, Callable[[Array], Array], tuple[Callable[[Array], Array], Callable[[Array], Array]]]


def _blocks(block_size, compress_block_size, compress_stride):
    """(l', l, d) checked as nsa.attention checks them."""
    block_size = _checks.positive_int("block_size", block_size)
    return (block_size,) + _checks.compression(block_size, compress_block_size, compress_stride)


def _heads(num_kv_heads, head_dim, head_dim_v):
    """(H, Dk, Dv) checked; head_dim_v None is head_dim."""
    Dk = _checks.positive_int("head_dim", head_dim)
    return (_checks.positive_int("num_kv_heads", num_kv_heads), Dk,
            Dk if head_dim_v is None else _checks.positive_int("head_dim_v", head_dim_v))


def empty_cache(batch_size: int, capacity: int, num_kv_heads: int, head_dim: int, *, block_size: int,
                compress_block_size: Optional[int] = None, compress_stride: Optional[int] = None,
                head_dim_v: Optional[int] = None, dtype: jnp.dtype = jnp.bfloat16) -> KVCache:
    """A cache of `batch_size` empty sequences of up to `capacity` tokens (zeros, lens 0), with selection blocks
    of `block_size` tokens and compression windows of `compress_block_size` tokens every `compress_stride` (both
    default block_size)."""
    B = _checks.non_negative_int("batch_size", batch_size)
    N = _checks.non_negative_int("capacity", capacity)
    H, Dk, Dv = _heads(num_kv_heads, head_dim, head_dim_v)
    dtype = _checks.float_dtype("dtype", dtype)
    blocks = _blocks(block_size, compress_block_size, compress_stride)
    NC = cdiv(N, blocks[2])
    zeros = lambda rows, d: jnp.zeros((B, rows, H, d), dtype)
    return KVCache(zeros(N, Dk), zeros(N, Dv), zeros(NC, Dk), zeros(NC, Dv), jnp.zeros((B,), jnp.int32), *blocks)


def empty_paged_cache(num_pages: int, page_size: int, batch_size: int, max_pages: int, num_kv_heads: int,
                      head_dim: int, *, block_size: int, compress_block_size: Optional[int] = None,
                      compress_stride: Optional[int] = None, head_dim_v: Optional[int] = None,
                      dtype: jnp.dtype = jnp.bfloat16) -> PagedKVCache:
    """A paged cache: a pool of `num_pages` pages of `page_size` tokens (zeros) for `batch_size` sequences of up to
    `max_pages` pages each, every page_table entry -1 (no page: the caller assigns pages before writing to them)
    and lens 0. Blocks as `empty_cache`'s; page_size must be a multiple of compress_stride."""
    P = _checks.non_negative_int("num_pages", num_pages)
    S = _checks.positive_int("page_size", page_size)
    B = _checks.non_negative_int("batch_size", batch_size)
    MP = _checks.non_negative_int("max_pages", max_pages)
    H, Dk, Dv = _heads(num_kv_heads, head_dim, head_dim_v)
    dtype = _checks.float_dtype("dtype", dtype)
    blocks = _blocks(block_size, compress_block_size, compress_stride)
    if S % blocks[2]:
        raise ValueError(f"page_size must be a multiple of compress_stride = {blocks[2]} (each page holds the "
                         f"compressed rows of its strides), got page_size = {S}")
    zeros = lambda rows, d: jnp.zeros((P, rows, H, d), dtype)
    rows = S // blocks[2]
    return PagedKVCache(zeros(S, Dk), zeros(S, Dv), zeros(rows, Dk), zeros(rows, Dv),
                        jnp.full((B, MP), -1, jnp.int32), jnp.zeros((B,), jnp.int32), *blocks)


def _new_tokens(cache, k, v):
    """Checks the new tokens k [B, TN, H, Dk], v [B, TN, H, Dv] against the cache."""
    B, H = cache.lens.shape[0], cache.k.shape[2]
    for name, x, y in (("k", k, cache.k), ("v", v, cache.v)):
        _checks.array(name, x, 4, dtypes=None)
        if x.dtype != y.dtype:
            raise TypeError(f"{name}.dtype must equal the cache's ({y.dtype.name}), got {x.dtype.name}")
        _checks.shape(name, x, (B, k.shape[1], H, y.shape[3]), f"[B, TN, H, D] (B, H, D from cache.{name})")


def _write(cache, k, v, start, count, window, stride, phis=(None, None)):
    """(the cache, written int32 [B]): the first written[b] <= count[b] rows of k, v [B, TN, ...] written at the
    rows start[b], start[b] + 1, ... of sequence b, where written[b] counts the rows up to the first that does not
    exist (`_kvcache.exists`: past the capacity, or on no page of the pool): those and every row after them are
    dropped, so that lens = start + written counts only rows that were written, and the compressed row of every
    window (of `window` tokens every `stride`) that this completes: its mean, or phi's row of it with phis =
    (phi_k, phi_v) (`_phis`)."""
    B, TN = k.shape[:2]
    N = _kvcache.capacity(cache)
    NC = cdiv(N, stride)
    i = jnp.arange(TN)
    start = jnp.clip(start, 0, N)
    fits = (i < count[:, None]) & _kvcache.exists(cache, start[:, None] + i)
    written = jnp.sum(jnp.cumprod(fits, axis=1, dtype=jnp.int32), axis=1, dtype=jnp.int32)
    rows = jnp.where(i < written[:, None], start[:, None] + i, -1)  # -1: not written
    k_all, v_all = _put(cache, cache.k, rows, k, 1), _put(cache, cache.v, rows, v, 1)
    lens = start + written
    # the windows whose last token (row * stride + window - 1) is one of start ... start + TN - 1: at most R
    R = cdiv(TN, stride)
    rows = -((window - 1 - start[:, None]) // stride) + jnp.arange(R)  # [B, R], the first: cdiv(start - window + 1, d)
    complete = (rows >= 0) & (rows < NC) & (rows * stride + window <= lens[:, None])
    first = jnp.maximum(rows, 0)[:, :, None] * stride
    tokens = jnp.minimum(first + jnp.arange(window), max(N - 1, 0)).reshape(B, -1)
    target = jnp.where(complete, rows, -1)

    def compressed(x_all, x_cmp, phi, name):
        flat = x_all.reshape(-1, *x_all.shape[2:])
        windows = flat.at[flat_rows(cache, tokens, 1)].get(mode="clip")  # [B, R * window, H, D]
        if phi is None:
            rows = compress(windows, block_size=window)  # the window means
        else:
            rows = _learned(phi, windows.reshape(B, R, window, *windows.shape[2:]), name)
        return _put(cache, x_cmp, target, rows, stride)

    phi_k, phi_v = phis
    cache = cache.replace(k=k_all, v=v_all, k_cmp=compressed(k_all, cache.k_cmp, phi_k, "keys"),
                          v_cmp=compressed(v_all, cache.v_cmp, phi_v, "values"), lens=lens)
    return cache, written


def _phis(phi):
    """(phi_k, phi_v) of append_to_cache's `phi`: None (the window means), one callable for the keys and the values,
    or a pair of them."""
    if phi is None or callable(phi):
        return phi, phi
    if isinstance(phi, (tuple, list)) and len(phi) == 2 and all(map(callable, phi)):
        return tuple(phi)
    raise TypeError(f"phi must be None (the window means), a callable windows [B, R, l, H, D] -> rows [B, R, H, D] "
                    f"for the keys and the values, or a pair (phi_k, phi_v) of them, got {phi!r}")


def _learned(phi, windows, name):
    """phi(windows [B, R, l, H, D]): the compressed rows [B, R, H, D] of the windows of the keys or values (`name`),
    checked: that shape, and the cache's dtype (the rows are stored as phi makes them, never cast)."""
    rows = phi(windows)
    B, R, l, H, D = windows.shape
    what = f"phi (for the {name})"
    if not _checks.is_array(rows):
        raise TypeError(f"{what} must return an array, the compressed rows [B, R, H, D], got {type(rows).__name__}")
    if rows.dtype != windows.dtype:
        raise TypeError(f"{what} must return the cache's dtype {windows.dtype.name} (its rows are stored as phi makes "
                        f"them, never cast), got {rows.dtype.name}")
    _checks.shape(f"{what}'s rows", rows, (B, R, H, D), f"[B, R, H, D] (windows [B, R, l, H, D] = {(B, R, l, H, D)})")
    return rows


def _put(cache, x, rows, values, unit):
    """x (one of the cache's arrays, rows of `unit` tokens) with values [B, R, ...] written at rows [B, R] of each
    sequence (`flat_rows`: those outside it dropped)."""
    flat = x.reshape(-1, *x.shape[2:])
    return flat.at[flat_rows(cache, rows, unit)].set(values, mode="drop").reshape(x.shape)


def append_to_cache(cache: Cache, k: Array, v: Array, *, lens: Optional[Indices] = None,
                    block_size: Optional[int] = None, compress_block_size: Optional[int] = None,
                    compress_stride: Optional[int] = None, phi: Phi = None,
                    return_written: bool = False) -> Union[Cache, tuple[Cache, jax.Array]]:
    """The cache (an nsa.KVCache or nsa.PagedKVCache) with new tokens appended: sequence b appends the first
    lens[b] rows of k [B, TN, H, Dk], v [B, TN, H, Dv] (lens int [B] in [0, TN], default TN: a ragged step appends
    0 tokens to an idle slot, 1 to a decoding sequence, a chunk to one in prefill) at its rows cache.lens[b] ...,
    cache.lens grows by lens, and each compression window this completes gets its compressed row: `nsa.compress`'s
    mean of its tokens (bitwise), or with `phi` the row a learned compression makes of them (below). Rows past
    lens[b] are not written. A pure function: jit it with the cache donated and the writes happen in place. The
    block arguments may be left out: the cache carries its own (given, each must equal the cache's).
    return_written=True returns (cache, written): written int32 [B], the tokens of each sequence that were written
    (lens[b] unless some were dropped, below).

    A token is written only where its row exists: inside the capacity (N, or a paged cache's MP * S) and (paged) on
    a page of the pool (0 <= page_table entry < P). With concrete cache.lens, lens and page table, a token without
    a row raises ValueError, and so does a page that this append writes (a token's row, or the compressed row of a
    window it completes, which lives in the page of the window's first token) while another sequence holds it
    (its page table maps that page at rows below its length: shared prefix pages may be read by several sequences,
    never written). Under jit nothing can raise: sequence b's tokens from the first one without a row on are
    dropped (nothing is written out of bounds or through an invalid page id), cache.lens counts only the tokens
    written (so cache.lens - the old lens is `written`), and `nsa.attention` never reads a row that was not
    written to the sequence (`nsa.cache.readable_lens`).

    A learned compression (the paper's phi, Eq. 7, as a model trained with `nsa.compression_windows` and
    attention's k_cmp, v_cmp applies it): phi is a callable windows [B, R, l, H, D] -> compressed rows
    [B, R, H, D] in the cache's dtype, applied to the key windows and to the value windows, or a pair
    (phi_k, phi_v) (Dk != Dv, or separate weights). The windows are those this append may complete (R =
    ceil(TN / d)), slot j of a window its token i * d + j, laid out as `compression_windows` lays them out; only
    the rows of complete windows (all l tokens present) are written, so phi sees what it saw in training (the
    others' windows hold whatever the cache holds there and their rows are dropped: phi must treat each window on
    its own). Then `nsa.attention(q, cache=cache)` attends over phi's rows and selects blocks by them. The cache
    does not record phi: pass the same one to `prefill_cache` and to every append (a cache filled with means and
    then appended with phi, or the reverse, mixes the two).
    """
    _, window, stride = check_cache(cache, block_size, compress_block_size, compress_stride)
    _new_tokens(cache, k, v)
    B, TN = k.shape[:2]
    count = _prompt_lens(lens, B, TN)
    phis = _phis(phi)
    start = cache.lens.astype(jnp.int32)
    _check_room(cache, concrete(start), concrete(count), window, stride)
    cache, written = _write(cache, k, v, start, count, window, stride, phis)
    return (cache, written) if return_written else cache


def _check_room(cache, start, count, window, stride):
    """Raises ValueError where concrete lengths `start` + `count` pass the capacity or (paged, with a concrete page
    table) write a row on no page of the pool, or a page another sequence holds (`_check_owners`)."""
    if start is None or count is None or not start.size:
        return
    N, end = _kvcache.capacity(cache), start + count
    if np.any(end > N):
        b = int(np.argmax(end > N))
        raise ValueError(f"appending {count[b]} tokens past the cache's capacity N = {N}: cache.lens[{b}] = {start[b]}")
    table = concrete(cache.page_table) if isinstance(cache, PagedKVCache) else None
    if table is None:
        return
    S, P = cache.k.shape[1], cache.k.shape[0]
    for b in np.flatnonzero(count):
        pages = table[b, start[b] // S:(end[b] - 1) // S + 1]
        if np.any((pages < 0) | (pages >= P)):
            raise ValueError(f"sequence {b} writes its rows {start[b]} ... {end[b] - 1} (pages {start[b] // S} ... "
                             f"{(end[b] - 1) // S} of its page_table row), but cache.page_table[{b}] holds "
                             f"{pages.tolist()} there: every page a write reaches must be a page of the pool, "
                             f"0 <= id < P = {P}")
    _check_owners(table, S, start, end, window, stride)


def _check_owners(table, S, start, end, window, stride):
    """Raises ValueError where sequence b writes (rows start[b] ... end[b] - 1, and the compressed rows of the
    windows they complete, each in the page of its window's first token) a page that another sequence c holds: that
    page_table[c] maps at one of its rows below end[c] (its length after the append)."""
    held = {}  # page -> the sequences holding it
    for c in range(table.shape[0]):
        for page in table[c, :-(-end[c] // S)]:
            held.setdefault(int(page), set()).add(c)
    for b in np.flatnonzero(end > start):
        windows = np.arange(max(-(-(start[b] - window + 1) // stride), 0), (end[b] - window) // stride + 1)
        rows = np.concatenate([np.arange(start[b], end[b]), windows * stride])  # written tokens, windows' first
        for page in np.unique(table[b, rows // S]):
            others = sorted(held[int(page)] - {int(b)})
            if others:
                raise ValueError(f"sequence {b} writes page {page} (a token's row, or the compressed row of a window "
                                 f"whose first token lies there), which sequence {others[0]} holds too (its "
                                 f"page_table row maps page {page} below its length {end[others[0]]}): a page that "
                                 f"an append writes must be its sequence's alone (shared pages can only be read)")


def prefill_cache(k: Array, v: Array, *, block_size: int, capacity: int, lens: Optional[Indices] = None,
                  compress_block_size: Optional[int] = None, compress_stride: Optional[int] = None,
                  phi: Phi = None) -> KVCache:
    """A cache of capacity N = `capacity` filled from prompts k [B, TP, H, Dk], v [B, TP, H, Dv]: sequence b
    holds the first lens[b] tokens (int [B], default TP: right-padded prompts of several lengths), with the
    compressed rows of its complete windows (their means, or phi's rows: `append_to_cache`'s phi). Blocks: as
    `empty_cache`'s."""
    _checks.array("k", k, 4)
    B, TP, H, Dk = k.shape
    blocks = _blocks(block_size, compress_block_size, compress_stride)
    N = _checks.non_negative_int("capacity", capacity)
    if TP > N:
        raise ValueError(f"the prompts (k.shape[1] = {TP} tokens) must fit the cache's capacity, got capacity = {N}")
    cache = empty_cache(B, N, H, Dk, block_size=blocks[0], compress_block_size=blocks[1], compress_stride=blocks[2],
                        head_dim_v=v.shape[-1], dtype=k.dtype)
    _new_tokens(cache, k, v)
    return _write(cache, k, v, jnp.zeros((B,), jnp.int32), _prompt_lens(lens, B, TP), *blocks[1:], _phis(phi))[0]


def _prompt_lens(lens, B, TP):
    """lens as int32 [B] (None: TP, the rows of k): a concrete one must lie in [0, TP], a traced one is clipped
    there."""
    if lens is None:
        return jnp.full((B,), TP, jnp.int32)
    return _checks.lengths("lens", lens, B, 0, TP, "[0, k.shape[1]]")
