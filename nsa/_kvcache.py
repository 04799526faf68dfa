"""The KV cache's type (nsa.KVCache, a pytree dataclass) and its checks: below nsa.api, which attends over a cache,
and nsa.cache, which fills one (its docstring says what the cache holds)."""

import dataclasses
from typing import Optional

import jax

from nsa import _checks
from nsa._varlen import cdiv


@dataclasses.dataclass(frozen=True)
class KVCache:
    """A KV cache: its arrays (a pytree's leaves) and the compression it was made with (static metadata, part
    of the pytree's structure: jit compiles once per block_size, and a step never mistakes it). See the module
    docstring; `cache.replace(lens=...)` is a copy with some fields changed."""

    k: jax.Array  # [B, N, H, Dk]
    v: jax.Array  # [B, N, H, Dv]
    k_cmp: jax.Array  # [B, ceil(N / block_size), H, Dk]
    v_cmp: jax.Array  # [B, ceil(N / block_size), H, Dv]
    lens: jax.Array  # int32 [B]
    block_size: int  # the compression block: k_cmp's row c is the mean of tokens [c * block_size, (c + 1) * block_size)

    def replace(self, **changes) -> "KVCache":
        return dataclasses.replace(self, **changes)


ARRAYS = ("k", "v", "k_cmp", "v_cmp", "lens")
jax.tree_util.register_dataclass(KVCache, data_fields=list(ARRAYS), meta_fields=["block_size"])



def check_cache(cache: KVCache, block_size: Optional[int] = None) -> int:
    """Checks that `cache` is a KVCache whose arrays agree with each other and with its block_size, and that a
    given `block_size` (an op's argument) is the cache's; returns the cache's block_size."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be an nsa.KVCache, got {type(cache).__name__}")
    own = _checks.positive_int("cache.block_size", cache.block_size)
    if block_size is not None and _checks.positive_int("block_size", block_size) != own:
        raise ValueError(f"block_size = {block_size} was given, but the cache was made with block_size = {own}: its "
                         f"compressed rows are means of {own} tokens; leave block_size out (the cache carries its own)")
    block_size = own
    _checks.array("cache.k", cache.k, 4)
    B, N, H, Dk = cache.k.shape
    _checks.array("cache.v", cache.v, 4, dtypes=None)
    if cache.v.dtype != cache.k.dtype:
        raise TypeError(f"cache.v.dtype must equal cache.k.dtype ({cache.k.dtype.name}), got {cache.v.dtype.name}")
    Dv = cache.v.shape[3]
    _checks.shape("cache.v", cache.v, (B, N, H, Dv), "[B, N, H, Dv] (B, N, H from cache.k)")
    NC = cdiv(N, block_size)
    for name, x, d in (("cache.k_cmp", cache.k_cmp, Dk), ("cache.v_cmp", cache.v_cmp, Dv)):
        _checks.array(name, x, 4, dtypes=None)
        if x.dtype != cache.k.dtype:
            raise TypeError(f"{name}.dtype must equal cache.k.dtype ({cache.k.dtype.name}), got {x.dtype.name}")
        _checks.shape(name, x, (B, NC, H, d), f"[B, ceil(N / block_size), H, D] (block_size = {block_size})")
    _checks.integer_array("cache.lens", cache.lens, 1)
    _checks.shape("cache.lens", cache.lens, (B,), "[B]")
    return block_size
