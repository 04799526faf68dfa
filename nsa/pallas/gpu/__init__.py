"""Pallas kernels for NVIDIA GPUs (Mosaic GPU, jax >= 0.11, Hopper): the TPU kernels' contract with nothing but
jax[cuda].

KERNELS maps an op name of nsa.reference.OPS to its (forward, backward) kernels, with the reference's
signatures and residuals (and the keyword `config`); DTYPES are the input dtypes they take (bfloat16 and
float16: wgmma on float32 is TF32). The sliding-window and compressed branches (`window.py`, `compressed.py`)
run this package's flash kernels (`_flash.py`); selected attention and block selection have their own
(`selected.py`, `select.py`); `_common.py` holds their shared building blocks. The index planning around the
kernels is nsa._plan's.
"""

from nsa._config import Claim
from nsa.pallas.gpu import compressed, select, selected, window
from nsa.pallas.gpu._common import DTYPES

# select has no backward: no gradient flows through the selection
KERNELS = {op: (module.forward, getattr(module, "backward", None)) for op, module in (
    ("window", window), ("compressed", compressed), ("selected", selected), ("select", select))}

# {(op, phase): Claim}: the arguments on which the kernel outruns Triton's (nsa._families: `claims`): selected
# attention's forward, and its dq alone (Triton's dk and dv run over it either way); the window's backward on
# calls of fewer than 64k tokens
CLAIMS = {("selected", 0): Claim(selected.packs),
          ("selected", 1): Claim(selected.packs_dq, grads=(0,), rest=(1, 2)),
          ("window", 1): Claim(window.outruns_backward)}

__all__ = ["CLAIMS", "DTYPES", "KERNELS"]
