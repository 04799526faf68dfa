"""The KV caches' types (nsa.KVCache, contiguous, and nsa.PagedKVCache, in pages: pytree dataclasses), their checks,
and where each sequence's rows live in their arrays: below nsa.api, which attends over a cache, and nsa.cache, which
fills one (its docstring says what each holds)."""

import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from nsa import _checks
from nsa._plan import window_start
from nsa._varlen import cdiv, concrete


@dataclasses.dataclass(frozen=True)
class KVCache:
    """A KV cache: its arrays (a pytree's leaves) and the blocks it was made with (static metadata, part of the
    pytree's structure: jit compiles once per set of blocks, and a step never mistakes them). See nsa.cache's
    docstring; `cache.replace(lens=...)` is a copy with some fields changed. compress_block_size and
    compress_stride None mean the ops' defaults (l = block_size, d = gcd(l, block_size)); nsa.cache's functions store
    them resolved."""

    k: jax.Array  # [B, N, H, Dk]
    v: jax.Array  # [B, N, H, Dv]
    k_cmp: jax.Array  # [B, ceil(N / d), H, Dk]
    v_cmp: jax.Array  # [B, ceil(N / d), H, Dv]
    lens: jax.Array  # int32 [B]
    block_size: int  # l', the selection block
    compress_block_size: Optional[int] = None  # l: k_cmp's row i is the mean of tokens [i * d, i * d + l)
    compress_stride: Optional[int] = None  # d

    def replace(self, **changes) -> "KVCache":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A KV cache in pages: one pool of P pages of S tokens that B sequences share through a page table (the layout
    of vLLM's block tables and jax's ragged paged attention). See nsa.cache's docstring; the blocks are static
    metadata, as KVCache's."""

    k: jax.Array  # [P, S, H, Dk]: token t of sequence b is row t % S of page page_table[b, t // S]
    v: jax.Array  # [P, S, H, Dv]
    k_cmp: jax.Array  # [P, S / d, H, Dk]: compressed row i of sequence b (window [i * d, i * d + l)) is row
    v_cmp: jax.Array  # [P, S / d, H, Dv]     (i * d % S) / d of page page_table[b, i * d // S]: that of its first token
    page_table: jax.Array  # int32 [B, MP]: each sequence's pages in order; capacity MP * S tokens
    lens: jax.Array  # int32 [B]
    block_size: int
    compress_block_size: Optional[int] = None
    compress_stride: Optional[int] = None

    def replace(self, **changes) -> "PagedKVCache":
        return dataclasses.replace(self, **changes)


Cache = Union[KVCache, PagedKVCache]
ARRAYS = ("k", "v", "k_cmp", "v_cmp", "lens")
BLOCKS = ("block_size", "compress_block_size", "compress_stride")
jax.tree_util.register_dataclass(KVCache, data_fields=list(ARRAYS), meta_fields=list(BLOCKS))
jax.tree_util.register_dataclass(PagedKVCache, data_fields=list(ARRAYS) + ["page_table"], meta_fields=list(BLOCKS))
CACHES = (KVCache, PagedKVCache)


def capacity(cache) -> int:
    """The most tokens a sequence of `cache` can hold: N, or a paged cache's MP * S."""
    if isinstance(cache, PagedKVCache):
        return cache.page_table.shape[1] * cache.k.shape[1]
    return cache.k.shape[1]


def flat_rows(cache, i, unit):
    """Where rows i int [B, R] of each sequence of `cache` live in its arrays seen as one axis of rows
    (x.reshape(-1, H, D)): rows of `unit` tokens (1: k and v; compress_stride: k_cmp and v_cmp). Sequence b's row i
    is row b * R_seq + i of a KVCache (R_seq rows a sequence), row (i % Sp) of page page_table[b, i // Sp] of a
    PagedKVCache (Sp = S / unit rows a page). A row that does not exist (`exists`: past the capacity, before 0, or
    on a page id outside the pool) gives the number of rows (one past the last): a write there drops
    (mode="drop")."""
    flat, inside = _located(cache, i, unit)
    return jnp.where(inside, flat, _rows(cache, unit))


def exists(cache, i, unit=1):
    """bool [B, R]: whether rows i int [B, R] of each sequence of `cache` (of `unit` tokens) exist: inside the
    capacity and, in a PagedKVCache, on a page of the pool (0 <= page_table entry < P). A row that does not exist is
    never written (`flat_rows`) nor part of a sequence (`readable_lens`)."""
    return _located(cache, i, unit)[1]


def _rows(cache, unit):
    """The rows of `unit` tokens in each of the cache's arrays, flat: B * ceil(N / unit), or P * S / unit."""
    lead, N = cache.k.shape[:2]
    return lead * -(-N // unit)


def _located(cache, i, unit):
    """(flat row int32 [B, R], exists bool [B, R]) of rows i of each sequence: `flat_rows` before it drops those
    that do not exist."""
    B = i.shape[0]
    if isinstance(cache, PagedKVCache):
        P, Sp = cache.k.shape[0], cache.k.shape[1] // unit
        pages = cache.page_table.shape[1]
        page = jnp.take_along_axis(cache.page_table.astype(jnp.int32), jnp.clip(i // Sp, 0, pages - 1), axis=1)
        return page * Sp + i % Sp, (i >= 0) & (i < pages * Sp) & (page >= 0) & (page < P)
    rows = -(-cache.k.shape[1] // unit)
    return jnp.arange(B, dtype=jnp.int32)[:, None] * rows + i, (i >= 0) & (i < rows)


def readable_lens(cache):
    """int32 [B]: the tokens of each sequence that attention reads: cache.lens clipped to [0, capacity] and, in a
    PagedKVCache, cut at the first page-table entry that is no page of the pool. Whatever the page table holds,
    every row below these lengths lies on a page of the pool: no read for a query's result goes through a page id
    outside it (which the kernels would clip into some other sequence's page). `nsa.append_to_cache` never counts
    a row it could not write, so this is cache.lens for any cache it filled, unless the page table changed since;
    `check_cache` refuses concrete lengths it would cut."""
    lens = jnp.clip(cache.lens.astype(jnp.int32), 0, capacity(cache))
    if isinstance(cache, KVCache):
        return lens
    return jnp.minimum(lens, _paged_prefix(cache.page_table, cache.k.shape[0]) * cache.k.shape[1])


def _paged_prefix(page_table, P):
    """int32 [B]: how many of each sequence's first page-table entries are pages of the pool (0 <= id < P)."""
    table = page_table.astype(jnp.int32)
    return jnp.sum(jnp.cumprod((table >= 0) & (table < P), axis=1, dtype=jnp.int32), axis=1, dtype=jnp.int32)


def sequences(cache):
    """(k [B, N, H, Dk], v [B, N, H, Dv], k_cmp [B, N / d, H, Dk], v_cmp [B, N / d, H, Dv]): each sequence's rows
    in order: a KVCache's own arrays; a PagedKVCache's pages gathered through its page table (`gathered`)."""
    if isinstance(cache, KVCache):
        return cache.k, cache.v, cache.k_cmp, cache.v_cmp
    return gathered(cache.page_table, cache.k, cache.v, cache.k_cmp, cache.v_cmp)


def gathered(page_table, *pools):
    """Each pool of pages [P, S, H, D] gathered through page_table int [B, MP] into [B, MP * S, H, D]: each
    sequence's rows in order (an O(cache) copy). A page id outside the pool reads zeros: no row of another
    sequence's page (the kernels that read pages through the table, nsa.triton._common.cache_rows, read no row past
    a sequence's `readable_lens`, which never reaches such a page)."""
    B, MP = page_table.shape
    return tuple(_on_pages(x, page_table, lambda pages: x[pages].reshape(B, MP * x.shape[1], *x.shape[2:]),
                           lambda valid: valid[:, :, None].repeat(x.shape[1], 1).reshape(B, -1))
                 for x in pools)


def read_rows(pool, page_table, rows):
    """The rows at positions rows int [B, N] of each sequence of a pool of pages [P, S, H, D] (page_table int
    [B, MP]): [B, N, H, D], or at per-head positions rows int [B, N, H]: [B, N, H, D] (KV head h's row of its own
    position). What `gathered(page_table, pool)[b, rows]` holds (positions clipped into the capacity, rows on a
    page id outside the pool zeros), read without gathering the rest."""
    B, N = rows.shape[:2]
    S = pool.shape[1]
    rows = jnp.clip(rows.astype(jnp.int32), 0, page_table.shape[1] * S - 1)
    table = page_table.astype(jnp.int32)
    page = jnp.take_along_axis(table, (rows // S).reshape(B, -1), axis=1).reshape(rows.shape)
    if rows.ndim == 2:
        read = lambda pages: pool[pages, rows % S]
    else:
        read = lambda pages: pool[pages, rows % S, jnp.arange(pool.shape[2])]
    return _on_pages(pool, page, read, lambda valid: valid)


def _on_pages(pool, pages, read, valid_rows):
    """read(pages) with page ids outside the pool [P, ...] read as page 0 and then zeroed: `valid_rows(valid)` maps
    the ids' validity (pages' shape) onto the read's leading dimensions."""
    pages = pages.astype(jnp.int32)
    valid = (pages >= 0) & (pages < pool.shape[0])
    x = read(jnp.where(valid, pages, 0))
    keep = valid_rows(valid)
    return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - keep.ndim)), x, 0).astype(x.dtype)


def paged_window(page_table, k, v, kv_lens, T, window_size):
    """The rows the sliding window of a step of T queries reads, through the page table: (k, v [B, L, H, D] and
    kv_lens - start), the L = T + W - 1 rows from start = max(kv_lens - L, 0) on (`nsa._plan.window_keys`' cut,
    made on the pages, so the window's op cuts nothing more); None where those rows span the whole capacity."""
    start = window_start(T, page_table.shape[1] * k.shape[1], window_size, kv_lens)
    if start is None:
        return None
    rows = start[:, None] + jnp.arange(T + int(window_size) - 1, dtype=jnp.int32)
    return read_rows(k, page_table, rows), read_rows(v, page_table, rows), kv_lens - start


def paged_selected(page_table, k, v, block_indices, kv_lens, block_size):
    """The blocks a decode step (T = 1) selects, read through the page table: (k, v [B, (S + 1) * bs, H, D],
    block_indices [B, 1, H, S], kv_lens [B]) on which the selected branch attends as it would on the whole
    sequences. Slot s of KV head h holds the block block_indices[b, 0, h, s] names: rows [s * bs, (s + 1) * bs)
    when it lies wholly before the query, the last slot S when it is the query's own block (q at position
    p = kv_lens - 1 of block p // bs, seen up to p % bs: the new lengths are S * bs + p % bs + 1). Entries outside
    [0, p // bs] become -1 (skipped, as the op skips them); a block listed twice is read twice (and attended
    twice, as the op does). O(B * H * S * bs) rows: nothing of the cache's size."""
    B, _, H, S = block_indices.shape
    pos = kv_lens.astype(jnp.int32) - 1
    own = (pos // block_size)[:, None, None]  # [B, 1, 1]: the query's own block (-1 for an empty sequence)
    blocks = block_indices[:, 0].astype(jnp.int32)  # [B, H, S]
    valid = (blocks >= 0) & (blocks <= own)
    slots = jnp.where(valid, jnp.where(blocks == own, S, jnp.arange(S, dtype=jnp.int32)), -1)
    read = jnp.concatenate([jnp.where(valid & (blocks != own), blocks, 0), jnp.broadcast_to(own, (B, H, 1))], -1)
    rows = (read[..., None] * block_size + jnp.arange(block_size)).reshape(B, H, -1).transpose(0, 2, 1)
    lens = jnp.where(pos >= 0, S * block_size + pos % block_size + 1, 0)
    return read_rows(k, page_table, rows), read_rows(v, page_table, rows), slots[:, None], lens


def cache_blocks(cache: Cache) -> tuple[int, int, int]:
    """The cache's (block_size, compress_block_size, compress_stride), checked (`_checks.compression`), Nones
    resolved."""
    own = _checks.positive_int("cache.block_size", cache.block_size)
    return (own,) + _checks.compression(own, cache.compress_block_size, cache.compress_stride)


def check_cache(cache: Cache, block_size: Optional[int] = None, compress_block_size: Optional[int] = None,
                compress_stride: Optional[int] = None) -> tuple[int, int, int]:
    """Checks that `cache` is a KVCache or a PagedKVCache whose arrays agree with each other and with its blocks, and that each
    given block argument (an op's) is the cache's; returns the cache's (block_size, compress_block_size,
    compress_stride)."""
    if not isinstance(cache, CACHES):
        raise TypeError(f"cache must be an nsa.KVCache or an nsa.PagedKVCache, got {type(cache).__name__}")
    blocks = cache_blocks(cache)
    for name, given, own in zip(BLOCKS, (block_size, compress_block_size, compress_stride), blocks):
        if given is not None and _checks.positive_int(name, given) != own:
            raise ValueError(f"{name} = {given} was given, but the cache was made with {name} = {own} (its blocks: "
                             f"{dict(zip(BLOCKS, blocks))}); leave {name} out (the cache carries its own)")
    stride = blocks[2]
    paged = isinstance(cache, PagedKVCache)
    lead_dims, cmp_rows = ("P, S", "S / compress_stride") if paged else ("B, N", "ceil(N / compress_stride)")
    _checks.array("cache.k", cache.k, 4)
    lead, N, H, Dk = cache.k.shape  # lead: B, or a paged cache's P; N: the capacity, or the page size S
    _checks.array("cache.v", cache.v, 4, dtypes=None)
    if cache.v.dtype != cache.k.dtype:
        raise TypeError(f"cache.v.dtype must equal cache.k.dtype ({cache.k.dtype.name}), got {cache.v.dtype.name}")
    Dv = cache.v.shape[3]
    _checks.shape("cache.v", cache.v, (lead, N, H, Dv), f"[{lead_dims}, H, Dv] ({lead_dims}, H from cache.k)")
    if paged and N % stride:
        raise ValueError(f"a paged cache's page size S (cache.k.shape[1] = {N}) must be a multiple of compress_stride "
                         f"= {stride}: each page holds the compressed rows of its strides")
    NC = cdiv(N, stride)
    for name, x, d in (("cache.k_cmp", cache.k_cmp, Dk), ("cache.v_cmp", cache.v_cmp, Dv)):
        _checks.array(name, x, 4, dtypes=None)
        if x.dtype != cache.k.dtype:
            raise TypeError(f"{name}.dtype must equal cache.k.dtype ({cache.k.dtype.name}), got {x.dtype.name}")
        _checks.shape(name, x, (lead, NC, H, d), f"[{lead_dims[0]}, {cmp_rows}, H, D] (compress_stride = {stride})")
    B = lead
    if paged:
        _checks.integer_array("cache.page_table", cache.page_table, 2)
        B = cache.page_table.shape[0]
    _checks.integer_array("cache.lens", cache.lens, 1)
    _checks.shape("cache.lens", cache.lens, (B,), "[B]" + (" (B from cache.page_table)" if paged else ""))
    if paged:
        _check_pages(cache)
    return blocks


def _check_pages(cache):
    """Raises ValueError where concrete lengths of a PagedKVCache reach a page-table entry that is no page of the
    pool (where `readable_lens` would cut a sequence: under jit it does, and nothing reads through that entry)."""
    lens, table = concrete(cache.lens), concrete(cache.page_table)
    if lens is None or table is None:
        return
    P, S = cache.k.shape[:2]
    pages = -(-np.clip(lens, 0, table.shape[1] * S) // S)  # the entries that hold each sequence's tokens
    prefix = np.asarray(_paged_prefix(table, P))  # readable_lens' cut, on the concrete table
    for b in np.flatnonzero(prefix < pages):
        j = int(prefix[b])
        raise ValueError(f"cache.lens[{b}] = {lens[b]} tokens reach entry {j} of cache.page_table[{b}] (its rows "
                         f"{j * S} ... {(j + 1) * S - 1}), which holds {table[b, j]}: no page of the pool "
                         f"(0 <= id < P = {P}); every page that holds a sequence's tokens must be one of the pool")
