"""What every Triton kernel of nsa shares: the base-2 constants, the padding of tile sides, a dot with a
float32 accumulator, the online softmax's step and the run count of a sorted tile; and on the host, the device
the heuristics plan for and the one form of a wrapper's input check.

The kernels keep logits in base 2 (exp2 and log2 are the GPU's native forms): a natural-log value x is
x * LOG2E in base 2, and a base-2 value y is y * LN2 in natural log (the lse every op returns).
"""

import math

import jax.numpy as jnp
import triton
import triton.language as tl

from nsa import _device

LOG2E = tl.constexpr(math.log2(math.e))
LN2 = tl.constexpr(math.log(2.0))


def pow2(n, least=16):
    """n rounded up to a power of two, at least `least` (tl.dot and tl.arange want powers of two >= 16)."""
    return max(least, triton.next_power_of_2(int(n)))


@triton.jit
def mm(a, b, IEEE: tl.constexpr):
    """a @ b with a float32 accumulator; IEEE float32 products for float32 inputs (no TF32)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def online_step(m, l_sum, acc, s, v, visible, IEEE: tl.constexpr):
    """One step of the online softmax: the base-2 logits s [M, N] where visible, the values v [N, DVP];
    returns the running max m, the sum l_sum [M] and acc [M, DVP] (float32) updated."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet: no NaN
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, IEEE)
    return m_new, l_sum, acc


@triton.jit
def sequence_rows(b, pos, load, h, NK: tl.constexpr, H: tl.constexpr):
    """The int64 rows (b * NK + pos) * H + h of a contiguous cache [B, NK, H, D] seen as rows of D: positions pos
    [N] of sequence b (int64), KV head h; where not `load`, position 0's (in bounds, for a masked load)."""
    return (b * NK + tl.where(load, pos, 0)) * H + h


@triton.jit
def cache_rows(PAGES, b, pos, load, h, NK: tl.constexpr, H: tl.constexpr, PAGE: tl.constexpr, MP: tl.constexpr,
               NP: tl.constexpr):
    """The int64 rows of positions pos [N] of sequence b (int64), KV head h, in a cache seen as rows of D: PAGE = 0,
    a contiguous cache [B, NK, H, D] (`sequence_rows`; PAGES unused); PAGE > 0, a pool of NP pages of PAGE rows
    [NP, PAGE, H, D] that the page table PAGES int32 [B, MP] maps each sequence onto (position j of sequence b is
    row j % PAGE of page PAGES[b, j // PAGE]): (page * PAGE + pos % PAGE) * H + h, the page table read only where
    `load`, a page id outside [0, NP) clipped into the pool (a step never reads past it, whatever the table
    holds)."""
    if PAGE > 0:
        pos = tl.where(load, pos, 0)
        page = tl.load(PAGES + b * MP + pos // PAGE, mask=load, other=0)
        page = tl.minimum(tl.maximum(page, 0), NP - 1).to(tl.int64)
        rows = (page * PAGE + pos % PAGE) * H + h
    else:
        rows = sequence_rows(b, pos, load, h, NK=NK, H=H)
    return rows


@triton.jit
def runs(first_a, last_a, runs_a, first_b, last_b, runs_b):
    """Combine of an associative scan: (first value, last value, number of runs of equal values) of a stretch
    of a sequence, from those of its two halves (a sorted tile's ranks: its distinct values counted)."""
    return first_a, last_b, runs_a + runs_b - (last_a == first_b).to(tl.int32)


def paging(page_table, pool):
    """(the PAGES input, the constexprs PAGE, MP, NP): how a kernel finds each sequence's rows (`cache_rows`) in
    `pool` [NP, PAGE, H, D] through page_table int [B, MP]; page_table None: a contiguous cache (PAGE = 0, PAGES
    unread)."""
    if page_table is None:
        return jnp.zeros((1,), jnp.int32), dict(PAGE=0, MP=1, NP=1)
    return page_table.astype(jnp.int32), dict(PAGE=pool.shape[1], MP=page_table.shape[1], NP=pool.shape[0])


def all_queries(q):
    """q_lens int32 [B] when every row of q [B, TQ, ...] is a query (not a ragged step): TQ each."""
    return jnp.full((q.shape[0],), q.shape[1], jnp.int32)


def device():
    """The `nsa._device.Device` the default configs plan for: this process's CUDA GPU (read at trace time)."""
    return _device.facts("cuda")


def check(ok, argument, expected, got):
    """Raises ValueError naming the argument, what was expected and what was received, unless ok."""
    if not ok:
        raise ValueError(f"{argument}: expected {expected}, got {got}")


def check_keys(q, k, v, names=("k", "v")):
    """q [B, T, HQ, Dk] against keys k [B, NK, H, Dk] (H dividing HQ) and values v [B, NK, H, Dv] (names: how
    the caller calls k and v): a ValueError names the one that does not fit."""
    B, _, HQ, Dk = q.shape
    check(k.ndim == 4 and k.shape[0] == B and k.shape[3] == Dk and HQ % k.shape[2] == 0, names[0],
          f"shape [B, NK, H, Dk] = [{B}, NK, H, {Dk}] with H dividing HQ = {HQ} (q {tuple(q.shape)})",
          tuple(k.shape))
    check(v.ndim == 4 and v.shape[:3] == k.shape[:3], names[1],
          f"shape [B, NK, H, Dv] with [B, NK, H] = {tuple(k.shape[:3])} ({names[0]}'s)", tuple(v.shape))
