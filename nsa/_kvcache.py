"""The KV cache's type (nsa.KVCache, a pytree dataclass) and its checks: below nsa.api, which attends over a cache,
and nsa.cache, which fills one (its docstring says what the cache holds)."""

import dataclasses
from typing import Optional

import jax

from nsa import _checks
from nsa._varlen import cdiv


@dataclasses.dataclass(frozen=True)
class KVCache:
    """A KV cache: its arrays (a pytree's leaves) and the blocks it was made with (static metadata, part of the
    pytree's structure: jit compiles once per set of blocks, and a step never mistakes them). See nsa.cache's
    docstring; `cache.replace(lens=...)` is a copy with some fields changed. compress_block_size and
    compress_stride None mean block_size (as the ops' defaults); nsa.cache's functions store them resolved."""

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


ARRAYS = ("k", "v", "k_cmp", "v_cmp", "lens")
BLOCKS = ("block_size", "compress_block_size", "compress_stride")
jax.tree_util.register_dataclass(KVCache, data_fields=list(ARRAYS), meta_fields=list(BLOCKS))



def cache_blocks(cache: KVCache) -> tuple[int, int, int]:
    """The cache's (block_size, compress_block_size, compress_stride), checked (`_checks.compression`), Nones
    resolved."""
    own = _checks.positive_int("cache.block_size", cache.block_size)
    return (own,) + _checks.compression(own, cache.compress_block_size, cache.compress_stride)


def check_cache(cache: KVCache, block_size: Optional[int] = None, compress_block_size: Optional[int] = None,
                compress_stride: Optional[int] = None) -> tuple[int, int, int]:
    """Checks that `cache` is a KVCache whose arrays agree with each other and with its blocks, and that each
    given block argument (an op's) is the cache's; returns the cache's (block_size, compress_block_size,
    compress_stride)."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be an nsa.KVCache, got {type(cache).__name__}")
    blocks = cache_blocks(cache)
    for name, given, own in zip(BLOCKS, (block_size, compress_block_size, compress_stride), blocks):
        if given is not None and _checks.positive_int(name, given) != own:
            raise ValueError(f"{name} = {given} was given, but the cache was made with {name} = {own} (its blocks: "
                             f"{dict(zip(BLOCKS, blocks))}); leave {name} out (the cache carries its own)")
    block_size, compress_block_size, stride = blocks
    _checks.array("cache.k", cache.k, 4)
    B, N, H, Dk = cache.k.shape
    _checks.array("cache.v", cache.v, 4, dtypes=None)
    if cache.v.dtype != cache.k.dtype:
        raise TypeError(f"cache.v.dtype must equal cache.k.dtype ({cache.k.dtype.name}), got {cache.v.dtype.name}")
    Dv = cache.v.shape[3]
    _checks.shape("cache.v", cache.v, (B, N, H, Dv), "[B, N, H, Dv] (B, N, H from cache.k)")
    NC = cdiv(N, stride)
    for name, x, d in (("cache.k_cmp", cache.k_cmp, Dk), ("cache.v_cmp", cache.v_cmp, Dv)):
        _checks.array(name, x, 4, dtypes=None)
        if x.dtype != cache.k.dtype:
            raise TypeError(f"{name}.dtype must equal cache.k.dtype ({cache.k.dtype.name}), got {x.dtype.name}")
        _checks.shape(name, x, (B, NC, H, d), f"[B, ceil(N / compress_stride), H, D] (compress_stride = {stride})")
    _checks.integer_array("cache.lens", cache.lens, 1)
    _checks.shape("cache.lens", cache.lens, (B,), "[B]")
    return blocks
