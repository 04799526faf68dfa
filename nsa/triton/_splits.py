"""What the flash-decoding kernels share: the attention ones (nsa/triton/decode.py) and the block selection's
(nsa/triton/decode_select.py). When an op runs them rather than its training kernels (`applies`, `decoding`),
how many splits of one (b, h)'s work they launch (`splits`), and the softmax statistics of the splits merged
(`split_stats`, read by the combine and by the selection of the fused step).
"""

import triton
import triton.language as tl

from nsa._varlen import cdiv

MAX_ROWS = 128  # the largest tile (TQ * G rows) the decode kernels take: `applies`
MAX_TOKENS = 16  # and the most query tokens


def applies(q, k):
    """Whether the decode kernels should run q [B, TQ, HQ, Dk] against k [B, TK, H, Dk] rather than the
    training kernels (static shapes only): a few tokens (1 <= TQ <= MAX_TOKENS = 16) whose tile of all
    G = HQ / H query heads has at most MAX_ROWS = 128 rows. Beyond, the float32 accumulator [TQ * G, Dv]
    no longer fits in registers, the selected kernel's sort of the TQ * S slots grows, and the queries
    are enough to fill the GPU with the training kernels' query tiles."""
    TQ, HQ, H = q.shape[1], q.shape[2], k.shape[2]
    return 1 <= TQ <= MAX_TOKENS and TQ * (HQ // H) <= MAX_ROWS


def decoding(decode, q, k, kv_lens, config, configs):
    """Whether an op's forward runs its decode kernels: `decode` True (they need kv_lens: the queries end the
    sequences of a KV cache), False, or None, where they run for a few queries at the end of a cache (kv_lens
    given and `applies`). `config` (None or a Config) must be the Config of the kernels that run, `configs` =
    (the training kernels' Config class, the decode kernels'): a pinned config never changes which run."""
    if decode not in (None, True, False):
        raise ValueError(f"decode: expected None (the decode kernels run where they apply), True or False, got "
                         f"{decode!r}")
    if decode and kv_lens is None:
        raise ValueError("decode: expected None or False without kv_lens (the decode kernels attend the last "
                         "queries of a KV cache), got True")
    chosen = (kv_lens is not None and applies(q, k)) if decode is None else decode
    wanted = configs[chosen]
    if config is not None and not isinstance(config, wanted):
        why = f"decode={decode!r}" + (": few queries at the end of a KV cache" if decode is None and chosen else "")
        raise ValueError(f"config: expected None or a {wanted.__module__}.{wanted.__name__}, the Config of the "
                         f"{'decode' if chosen else 'training'} kernels that run ({why}), got a "
                         f"{type(config).__module__}.{type(config).__name__}; pass decode={not chosen} to run the "
                         f"other kernels")
    return chosen


def splits(units, batch_heads, programs_per_sm, device, most=None):
    """How many splits each (b, h) of batch_heads = B * H cuts its work into: enough programs to give each of
    the device's SMs (device.cores) programs_per_sm of them, cdiv(cores * programs_per_sm, B * H), never more
    than its work units (more would only add empty programs), nor `most`; at least 1."""
    wanted = cdiv(device.cores * programs_per_sm, max(1, batch_heads))
    return max(1, min(units, wanted, units if most is None else most))


@triton.jit
def split_stats(M, L, rows, ok, R: tl.constexpr, NSPLIT: tl.constexpr, NSP: tl.constexpr, CACHE: tl.constexpr):
    """The merged softmax statistics of the rows `rows` (int64 [N]: split 0's row of M; split s adds s * R) over
    the NSPLIT splits of M, L [.., NSPLIT, R] (base-2 max and sum): (m_use: the max, or 0 where nothing was
    seen; l: the sum at m_use; lse2: the base-2 log-sum-exp, -inf where nothing was seen), each [N], loaded at
    once ([NSP, N], NSP = next_pow2(NSPLIT)) with the cache modifier CACHE ("" or ".cg": partials that other
    programs of the same launch stored)."""
    sp = tl.arange(0, NSP)
    stat = (sp < NSPLIT)[:, None] & ok[None, :]
    m_all = tl.load(M + rows[None, :] + sp[:, None] * R, mask=stat, other=float("-inf"), cache_modifier=CACHE)
    m_max = tl.max(m_all, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_all = tl.load(L + rows[None, :] + sp[:, None] * R, mask=stat, other=0.0, cache_modifier=CACHE)
    l_sum = tl.sum(tl.exp2(m_all - m_use[None, :]) * l_all, 0)
    seen = l_sum > 0
    return m_use, l_sum, tl.where(seen, m_use + tl.log2(tl.where(seen, l_sum, 1.0)), float("-inf"))
