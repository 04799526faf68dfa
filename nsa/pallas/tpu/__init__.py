"""Pallas kernels for TPUs (Mosaic TPU), also run in Pallas's TPU interpret mode on any platform.

KERNELS maps an op name of nsa.reference.OPS to its (forward, backward) kernels, with the reference's
signatures and residuals plus the keywords `interpret` (False: Mosaic; a pltpu.InterpretParams: interpret mode)
and `config`; DTYPES are the input dtypes they take. The sliding-window and compressed branches (`window.py`,
`compressed.py`) run jax's splash attention kernels where they apply (`_splash.py`: in training, heads of 128 lanes
in bf16 or float32), else this package's flash kernels (`_flash.py`); selected attention and block selection have
their own (`selected.py`, `select.py`); `_common.py` holds what they share. The index planning around the
kernels is nsa._plan's.
"""

import jax.numpy as jnp

from nsa.pallas.tpu import compressed, select, selected, window

DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))

# select has no backward: no gradient flows through the selection
KERNELS = {op: (module.forward, getattr(module, "backward", None)) for op, module in (
    ("window", window), ("compressed", compressed), ("selected", selected), ("select", select))}

__all__ = ["DTYPES", "KERNELS"]
