"""Pallas kernels for TPUs (Mosaic TPU), and Pallas's TPU interpret mode everywhere else.

KERNELS maps an op name of nsa.reference.OPS to its (forward, backward) kernels, with the reference's
signatures and residuals plus the keyword `interpret`; DTYPES are the input dtypes they take. An op
missing here runs the reference on every platform.

`runner(kernel, everywhere)` binds `interpret`: on a TPU the Mosaic kernel; with everywhere=True (an
explicit implementation="pallas") the same kernel in Pallas's TPU interpret mode on any other platform,
chosen by `jax.lax.platform_dependent` when the program is lowered (never by jax.default_backend(), so a
program exported for TPU from a CPU machine holds the Mosaic kernels). Interpret mode runs the kernel's
every grid step as plain JAX on the host: exact, slow, and a way to step through a kernel on a laptop.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from nsa.pallas import compressed, select, selected, window

DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))

KERNELS = {
    "window": (window.forward, window.backward),
    "compressed": (compressed.forward, compressed.backward),
    "selected": (selected.forward, selected.backward),
    "select": (select.forward, None),
}

# The interpret-mode settings off TPU (the tests turn race detection on).
INTERPRET = {"detect_races": False}


def runner(kernel, everywhere):
    """kernel(*args, **static) with `interpret` bound: Mosaic on a TPU; with `everywhere`, interpret mode
    on every other platform (else the function is only valid on a TPU)."""
    mosaic = functools.partial(kernel, interpret=False)
    if not everywhere:
        return mosaic

    def run(*args, **static):
        interpreted = functools.partial(kernel, interpret=pltpu.InterpretParams(**INTERPRET), **static)
        return lax.platform_dependent(*args, tpu=functools.partial(mosaic, **static), default=interpreted)

    return run
