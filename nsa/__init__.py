"""nsa: DeepSeek's Native Sparse Attention in JAX.

Plain functions, arrays positional and everything else keyword-only:

    o = nsa.attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_counts=16,
                      block_size=64, window_size=512)

The paper's compression (windows of 32 tokens every 16, selection blocks of 64): `block_size=64,
compress_block_size=32, compress_stride=16`; a learned compression phi: `compression_windows`, then k_cmp=, v_cmp=.
Serving from a KV cache (`nsa.cache`, contiguous or paged): `prefill_cache` or `empty_paged_cache`, `append_to_cache`
(ragged: `lens=`), then `attention(q, cache=cache, q_lens=..., ...)`.
Padded batches and segment ids to packed sequences (cu_seqlens) and back: `nsa.packing`.

Each op has a readable XLA reference (nsa.reference) and, where they exist, Triton (GPU) and Pallas
(TPU) kernels with the same contract; `implementation=None` picks the best for the platform.
"""

from nsa._dispatch import implementations
from nsa.api import (attention, check_cu_seqlens, compress, compressed_attention, compression_windows,
                     select_blocks, selected_attention, sliding_window_attention)
from nsa.cache import KVCache, PagedKVCache, append_to_cache, empty_cache, empty_paged_cache, prefill_cache
from nsa.packing import (cu_seqlens_from_mask, cu_seqlens_from_segment_ids, pack, segment_ids_from_cu_seqlens,
                         unpack)

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "PagedKVCache",
    "append_to_cache",
    "attention",
    "check_cu_seqlens",
    "compress",
    "compressed_attention",
    "compression_windows",
    "cu_seqlens_from_mask",
    "cu_seqlens_from_segment_ids",
    "empty_cache",
    "empty_paged_cache",
    "implementations",
    "pack",
    "prefill_cache",
    "segment_ids_from_cu_seqlens",
    "select_blocks",
    "selected_attention",
    "sliding_window_attention",
    "unpack",
]
