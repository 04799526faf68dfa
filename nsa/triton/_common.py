"""What every Triton kernel of nsa shares: the base-2 constants, the padding of tile sides, a dot with a
float32 accumulator, the online softmax's step and the run count of a sorted tile; and on the host, the device
the heuristics plan for and the one form of a wrapper's input check.

The kernels keep logits in base 2 (exp2 and log2 are the GPU's native forms): a natural-log value x is
x * LOG2E in base 2, and a base-2 value y is y * LN2 in natural log (the lse every op returns).
"""

import math

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
def runs(first_a, last_a, runs_a, first_b, last_b, runs_b):
    """Combine of an associative scan: (first value, last value, number of runs of equal values) of a stretch
    of a sequence, from those of its two halves (a sorted tile's ranks: its distinct values counted)."""
    return first_a, last_b, runs_a + runs_b - (last_a == first_b).to(tl.int32)


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
