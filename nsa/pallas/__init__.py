"""The "pallas" kernel family (nsa._families): Mosaic TPU kernels on TPUs (nsa/pallas/tpu), Mosaic GPU kernels on
NVIDIA GPUs (nsa/pallas/gpu), and the TPU kernels in Pallas's TPU interpret mode everywhere else.

Layout. nsa/pallas/tpu and nsa/pallas/gpu are sibling families of kernels, each with its own flash kernels
(`_flash.py`, run by `window.py` and `compressed.py`), `select.py`, `selected.py` and the building blocks they
share (`_common.py`); neither imports the other. What both build around their kernels in XLA (names of blocks,
tile unions, selections inverted into per-block lists, segments, bands, packed heads, the backward's pre-pass)
is nsa/_plan.py, shared with every family; `_batch.py` runs a kernel once per sequence of a symbolic batch. Each
kernel module has one `Config` and one `default_config(shapes, dtype, device)` (nsa/_config.py), and reads the
device's numbers from nsa._device.facts when it is traced.

This module describes the family to the registry. KERNELS maps an op name of nsa.reference.OPS to its (forward,
backward) TPU kernels (nsa.pallas.tpu.KERNELS: the reference's signatures and residuals plus the keywords
`interpret` and `config`); DTYPES are the input dtypes they take. nsa.pallas.gpu has the same table for its
Mosaic GPU kernels (jax >= 0.11; bfloat16 and float16). An op missing here runs the reference on every platform.

`kernel(op, phase, platform)` is the compiled kernel of one platform ('tpu' or 'cuda'); `runner(op, phase,
dtype)` is what an explicit implementation="pallas" runs: `nsa._platform.platform_dependent` between the Mosaic TPU
kernel on a TPU, the Mosaic GPU kernel on a CUDA GPU, and the TPU kernel in interpret mode on every other
platform, chosen when the program is lowered (never by jax.default_backend(), so a program exported for TPU
or CUDA from a CPU machine holds the Mosaic kernels). Where the GPU kernels cannot run the op (an older jax, a
float32 input), lowering for CUDA raises and says why: an explicitly requested kernel never falls back.
Interpret mode runs the kernel's every grid step as plain JAX on the host: exact, slow, and a way to step
through a kernel on a laptop.

Where things go.
- A new op: its reference in nsa/reference (nsa.reference.OPS), then a kernel module in tpu/ and, where it has
  one, in gpu/, each with its Config and default_config and an entry of its package's KERNELS; index work that
  is not the kernel's own goes to nsa/_plan.py.
- A new GPU generation: a row of nsa._device.TABLE (its SMs, shared memory, ...): the kernels plan with it; and,
  where a measurement on it shows other tiles are faster, a branch of the kernel's default_config, with its
  comment pointing to the benchmarks/results file.
- A new platform's family: a sibling package (nsa/pallas/<platform>/, or its own family under nsa/ with a line of
  nsa._families.FAMILIES), its branch in `runner` and `kernel` here, and its row in nsa._families.PREFERENCE.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.extend import core as jex_core
from jax.interpreters import mlir

from nsa import _platform
from nsa.pallas import tpu

DTYPES = tpu.DTYPES
KERNELS = tpu.KERNELS

# The interpret-mode settings off TPU (the tests turn race detection on).
INTERPRET = {"detect_races": False}

MOSAIC_GPU_JAX = (0, 11)  # the first jax whose Mosaic GPU lowers these kernels (plgpu.kernel, for CUDA)


@functools.cache
def gpu_family():
    """(KERNELS, DTYPES) of nsa.pallas.gpu, or a sentence saying why it cannot run in this process."""
    if jax.__version_info__[:2] < MOSAIC_GPU_JAX:
        return (f"its Mosaic GPU kernels need jax >= {'.'.join(map(str, MOSAIC_GPU_JAX))}, this is jax "
                f"{jax.__version__}")
    from nsa.pallas import gpu

    return gpu.KERNELS, gpu.DTYPES


def claims(op, phase, platform):
    """On CUDA, the nsa._config.Claim on the arguments on which the Mosaic GPU kernel of op's `phase` outruns the
    family implementation=None prefers (nsa.pallas.gpu.CLAIMS), else None."""
    if platform != "cuda" or isinstance(gpu_family(), str):
        return None
    from nsa.pallas import gpu

    return gpu.CLAIMS.get((op, phase))


def gpu_unavailable(op, phase, dtype):
    """Why nsa.pallas.gpu cannot run `phase` of op on `dtype` inputs (a sentence), or None."""
    family = gpu_family()
    if isinstance(family, str):
        return family
    table, dtypes = family
    if table.get(op, (None, None))[phase] is None:
        return "it has no Mosaic GPU kernel for it yet"
    if jnp.dtype(dtype) not in dtypes:
        return (f"its Mosaic GPU kernels take {', '.join(jnp.dtype(d).name for d in dtypes)} (wgmma on float32 is "
                f"TF32, too coarse for float32 results), not {jnp.dtype(dtype).name}")
    return None


def missing():
    """Pallas ships in jax: the family always imports."""
    return None


def unavailable(op, phase, dtype, platform):
    """Why `phase` of op cannot run on `dtype` on `platform` beyond KERNELS and DTYPES: on CUDA, the Mosaic GPU
    kernels' reasons (gpu_unavailable); TPU and interpret mode take every op of KERNELS."""
    return gpu_unavailable(op, phase, dtype) if platform == "cuda" else None


def explicit(op, phase, dtype):
    return runner(op, phase, dtype)


def kernel(op, phase, platform):
    """`phase` (0 forward, 1 backward) of op's compiled kernel on `platform`: 'tpu' (Mosaic TPU) or 'cuda'
    (Mosaic GPU; only where gpu_unavailable is None)."""
    if platform == "cuda":
        return in_32_bits(gpu_family()[0][op][phase])
    return in_32_bits(functools.partial(KERNELS[op][phase], interpret=False))


def in_32_bits(fn):
    """fn traced in jax's default 32-bit mode, also where jax_enable_x64 is on. The kernels take 16- and 32-bit
    inputs and are written for that mode: in x64 mode their Python scalars (indices, shifts, loop bounds, constants)
    would be 64-bit values, which Mosaic does not take (i64 ref indices and rotations) and lax.div refuses beside an
    int32 grid index."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.enable_x64(False):
            return fn(*args, **kwargs)

    return traced


def runner(op, phase, dtype):
    """What implementation="pallas" runs for `phase` of op on `dtype` inputs (see the module docstring)."""
    tpu = kernel(op, phase, "tpu")
    why_not = gpu_unavailable(op, phase, dtype)
    cuda = kernel(op, phase, "cuda") if why_not is None else functools.partial(
        _refuse, f"implementation='pallas' cannot run this op on a CUDA GPU: {why_not}; use implementation='triton', "
                 f"'xla' or None")

    def run(*args, **static):
        interpreted = in_32_bits(functools.partial(KERNELS[op][phase], interpret=pltpu.InterpretParams(**INTERPRET),
                                                   **static))
        if jax.default_backend() != "cpu":  # see _INTERPRETED_ONLY_ON_CPU
            interpreted = functools.partial(_refused, _INTERPRETED_ONLY_ON_CPU, interpreted)
        return _platform.platform_dependent(*args, tpu=functools.partial(tpu, **static),
                                            cuda=functools.partial(cuda, **static), default=interpreted)

    return run


def paged_selected(q, k, v, static):
    """Selected attention's forward of a decode step over a paged cache's pools k, v, reading them through the page
    table inside the kernel (nsa.pallas.tpu.selected.paged_forward), where it applies (`reads_pages`): {"tpu":
    Mosaic, and "cpu": interpret mode on a machine whose default backend is the CPU}; None elsewhere. On a CUDA GPU
    the blocks are gathered in XLA for Mosaic GPU's op (nsa._dispatch.paged_selected)."""
    if not tpu.selected.reads_pages(q, k, v, static["block_size"]):
        return None
    offers = {"tpu": in_32_bits(functools.partial(tpu.selected.paged_forward, interpret=False))}
    if jax.default_backend() == "cpu":
        offers["cpu"] = in_32_bits(functools.partial(tpu.selected.paged_forward,
                                                     interpret=pltpu.InterpretParams(**INTERPRET)))
    return offers


def _refuse(message, *args, **static):
    """The CUDA branch of an explicit implementation="pallas" that cannot run there: traced only when a program is
    lowered for CUDA (nsa._platform.platform_dependent), which it stops."""
    raise TypeError(message)


# Interpret mode runs a kernel's memory operations as ordered host callbacks: effects, which every program that
# traces it then has (its runtime tokens; jax.checkpoint cannot partially evaluate them). The default branch of
# nsa._platform.platform_dependent is traced with the op, so the interpret branch is traced only where jax's default
# backend is the CPU (where it is the one that runs, and where programs are exported for TPU or CUDA with the Mosaic
# kernels); on a TPU or GPU machine the other platforms' branch refuses, and the programs hold no callback.
_INTERPRETED_ONLY_ON_CPU = ("implementation='pallas' runs Mosaic on a TPU or a CUDA GPU, and its TPU interpret mode "
                            "only on a machine whose default backend is the CPU")


# A primitive whose lowering raises: the other platforms' branch of an explicit implementation="pallas" on a TPU or
# GPU machine.
_refusal = jex_core.Primitive("nsa_refused")
_refusal.multiple_results = True
_refusal.def_abstract_eval(lambda *args, message, outputs: outputs)


def _refuse_lowering(ctx, *args, message, outputs):
    raise TypeError(message)


mlir.register_lowering(_refusal, _refuse_lowering)


def _refused(message, like, *args):
    """The results `like(*args)` would have, from a computation that cannot be lowered: it raises TypeError(message)
    when a program that runs it is compiled."""
    closed, shapes = jax.make_jaxpr(like, return_shape=True)(*args)  # its avals keep shard_map's varying axes
    outs = _refusal.bind(*jax.tree_util.tree_leaves(args), message=message, outputs=tuple(closed.out_avals))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outs)
