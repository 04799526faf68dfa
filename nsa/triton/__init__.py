"""Triton kernels for NVIDIA GPUs, called from JAX through jax-triton (imported only when a kernel launches).

The family's description for nsa._families: KERNELS maps an op name of nsa.reference.OPS to its (forward,
backward) kernels, with the reference's signatures and residuals; DTYPES are the input dtypes they take
(Triton has no float64). The kernels run on CUDA (or in Triton's interpreter: nsa.triton.interpreter); the
fused decode step (nsa.triton.decode.attention) is the family's serving step.

The modules, each importing only those below it:

- ops (KERNELS' entry points): window.py and compressed.py (on the flash kernels of _flash.py), selected.py
  and select.py (their kernels their own); each forward takes decode=None|True|False (None: the decode
  kernels run for a few queries at the end of a KV cache, `_splits.decoding`) and config=None or the Config
  of the kernels that run;
- the flash-decoding kernels: decode.py (window, compressed and selected attention, and the fused step on a
  `decode.Step`), decode_select.py (the block selection);
- what several share: _flash.py (window and compressed training kernels), _topk.py (the two selections'
  running top), _splits.py (the decode kernels' choice, splits and merged statistics), _common.py (base-2
  constants, the online softmax, the device the heuristics plan for), _launch.py (the one launch).

A kernel module has one `Config` (a `nsa._config.validated` NamedTuple) and one `default_config(shapes, dtype,
device)` (nsa/_config.py), which plans from the device's facts (`nsa._device.facts("cuda")`, read at trace
time) and cites the measurement that chose it. A new op: its kernel module (kernels, Config, default_config,
forward and backward with the reference's signatures), one line of KERNELS, and a case in
tests/test_triton_interpreted.py. A new GPU generation: its row in nsa._device.TABLE (SMs, shared memory), and
where it changes what is fastest, a measurement behind the default_config that it changes
(scripts/triton_launches.py shows every launch a device's facts plan).
"""

import jax.numpy as jnp

from nsa._config import Claim
from nsa._plan import one_row_per_block

from nsa.triton import _launch, _splits, compressed, decode, select, selected, window

DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))

KERNELS = {
    "window": (window.forward, window.backward),
    "compressed": (compressed.forward, compressed.backward),
    "selected": (selected.forward, selected.backward),
    "select": (select.forward, None),
}

# {(op, phase): Claim}: the arguments on which the kernel outruns the family implementation=None prefers before it
# (nsa._families: `claims`): block selection where a block scores several compressed rows (Eq. 9)
CLAIMS = {("select", 0): Claim(select.sums_eq9)}


def missing():
    """Why the kernels cannot launch in this process (jax-triton does not import), or None."""
    return _launch.missing()


def unavailable(op, phase, dtype, platform):
    return None if platform == "cuda" else "its kernels run on CUDA GPUs only"


def kernel(op, phase, platform):
    return KERNELS[op][phase]


def explicit(op, phase, dtype):
    return KERNELS[op][phase]


def claims(op, phase, platform):
    return CLAIMS.get((op, phase)) if platform == "cuda" else None


def fused_step(q, k, static):
    """{None: the fused decode step} (nsa.triton.decode.attention: three launches instead of the ops' ten, on the
    arrays of a `decode.Step`, wherever the family runs) where it applies to q [B, TQ, HQ, Dk] against the cache k
    (few queries: `_splits.applies`) and its decode selection to the blocks of `static` (one compressed row per
    selection block), else None."""
    return {None: decode.attention} if _splits.applies(q, k) and one_row_per_block(**_blocks(static)) else None


def _blocks(static):
    return {name: static[name] for name in ("block_size", "compress_block_size", "compress_stride")}
