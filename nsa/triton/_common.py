"""What every Triton kernel of nsa shares: the base-2 constants and the padding of tile sides.

The kernels keep logits in base 2 (exp2 and log2 are the GPU's native forms): a natural-log value x is
x * LOG2E in base 2, and a base-2 value y is y * LN2 in natural log (the lse every op returns).
"""

import math

import triton
import triton.language as tl

LOG2E = tl.constexpr(math.log2(math.e))
LN2 = tl.constexpr(math.log(2.0))


def pow2(n, least=16):
    """n rounded up to a power of two, at least `least` (tl.dot and tl.arange want powers of two >= 16)."""
    return max(least, triton.next_power_of_2(int(n)))
