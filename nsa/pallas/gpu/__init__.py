"""Pallas kernels for NVIDIA GPUs (Mosaic GPU, jax >= 0.11): the TPU kernels' contract with nothing but jax[cuda].

KERNELS maps an op name of nsa.reference.OPS to its (forward, backward) kernels, with the reference's
signatures and residuals; DTYPES are the input dtypes they take (bfloat16 and float16: wgmma on float32 is
TF32). The sliding-window and compressed branches are nsa/pallas/window.py and compressed.py on this
package's flash kernels (`_flash.py`); selected attention and block selection have their own (`selected.py`,
`select.py`).
"""

import functools

from nsa.pallas import compressed, window
from nsa.pallas.gpu import select, selected
from nsa.pallas.gpu._flash import DTYPES

KERNELS = {
    "window": (functools.partial(window.forward, gpu=True), functools.partial(window.backward, gpu=True)),
    "compressed": (functools.partial(compressed.forward, gpu=True), functools.partial(compressed.backward, gpu=True)),
    "selected": (selected.forward, selected.backward),
    "select": (select.forward, None),
}

__all__ = ["DTYPES", "KERNELS"]
