"""Triton kernels for NVIDIA GPUs, called from JAX through jax-triton (imported only when a kernel launches).

The family's description for nsa._families: KERNELS maps an op name of nsa.reference.OPS to its (forward,
backward) kernels, with the reference's signatures and residuals; DTYPES are the input dtypes they take
(Triton has no float64). The kernels run on CUDA (or in Triton's interpreter: nsa.triton.interpreter); the
fused decode step (nsa.triton.decode) is the family's serving step.
"""

import jax.numpy as jnp

from nsa.triton import _launch, compressed, decode, select, selected, window

DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))

KERNELS = {
    "window": (window.forward, window.backward),
    "compressed": (compressed.forward, compressed.backward),
    "selected": (selected.forward, selected.backward),
    "select": (select.forward, None),
}


def missing():
    """Why the kernels cannot launch in this process (jax-triton does not import), or None."""
    return _launch.missing()


def unavailable(op, phase, dtype, platform):
    return None if platform == "cuda" else "its kernels run on CUDA GPUs only"


def kernel(op, phase, platform):
    return KERNELS[op][phase]


def explicit(op, phase, dtype):
    return KERNELS[op][phase]


def fused_step(q, k):
    """The fused decode step (nsa.triton.decode.attention: five launches instead of the ops' ten) where it applies
    to q [B, TQ, HQ, Dk] against the cache k (few queries: decode.applies), else None."""
    return decode.attention if decode.applies(q, k) else None
