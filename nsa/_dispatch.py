"""One custom_vjp shared by every op, and the choice of the code that runs each op.

`apply(op, implementation, static, arrays)` runs op's forward on `arrays` (a tuple; differentiable
arrays and integer arrays alike, the first one the op's main floating input, q or x) with the hashable
`static` configuration (a tuple of (name, value) pairs). Forward and backward each go through `_choose`:

- implementation="xla": the reference (nsa.reference);
- implementation="triton" / "pallas": that kernel (Pallas: Mosaic TPU on a TPU, Mosaic GPU on a CUDA GPU,
  its TPU interpret mode on every other platform: nsa.pallas.runner), or a ValueError (it does not import
  here, or has no kernel for the op) or TypeError (it has no kernel for the dtype) that says why;
- implementation=None: `platform_dependent` (below) between the kernels that can run the op on its
  dtype and the reference everywhere else: Pallas on tpu; on cuda, per op, the family of CUDA_PREFERENCE
  that comes first and can run it (Triton needs jax-triton, Mosaic GPU jax >= 0.11 and 16-bit inputs).
  When neither can on a machine with a CUDA GPU, the reference runs there and a RuntimeWarning says so, once.

`platform_dependent` is jax's, made for programs exported for several platforms at once: each branch is
lowered for its platform alone, and a platform's kernel is traced only when a program is lowered for that
platform (a Triton branch is only built where jax_triton imports: it does not on a CPU-only jaxlib).
`implementations()` tells which code implementation=None runs.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

from nsa import reference

# platform (as platform_dependent names it) -> the kernel families implementation=None may run there, per op, in
# the order it prefers them. On cuda, the faster one as measured on the H200 at 64k
# (benchmarks/results/ops-65536-pallas.json against ops-65536.json; select: 8.4 against 11.8 ms, the rest Triton).
CUDA_PREFERENCE = {"compressed": ("triton", "pallas"), "select": ("pallas", "triton"),
                   "selected": ("triton", "pallas"), "window": ("triton", "pallas")}
_FAMILIES = {"tpu": lambda op: ("pallas",), "cuda": lambda op: CUDA_PREFERENCE.get(op, ("triton", "pallas"))}
_INSTALL = {"triton": "pip install 'nsa[cuda]' (jax-triton 0.3.1, triton 3.6.0 and jax's CUDA 13 wheels)"}
# the platforms as platform_dependent names them
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# the public name of each op
PUBLIC_NAMES = {"compress": "compress", "compressed": "compressed_attention", "select": "select_blocks",
                "selected": "selected_attention", "window": "sliding_window_attention"}


@functools.cache
def import_error(family):
    """Why the kernel family cannot be imported in this process (a sentence), or None."""
    if family == "triton":
        try:
            import jax_triton  # noqa: F401  (the GPU path's only extra dependency)
        except Exception as e:  # ImportError, or a jax_triton that does not match this jax
            return f"jax-triton does not import ({type(e).__name__}: {e}); {_INSTALL['triton']}"
    return None


def _family(name):
    """(KERNELS, DTYPES) of nsa.triton or nsa.pallas; only call it when import_error(name) is None."""
    if name == "triton":
        from nsa import triton as family
    else:
        from nsa import pallas as family
    return family.KERNELS, family.DTYPES


def _why_not(op, name, dtype):
    """None when family `name` can run op on inputs of `dtype` in this process, else (the exception class,
    the reason): ValueError when the family does not import here or has no kernel for op, TypeError when
    it has none for dtype."""
    wanted = f"implementation={name!r} cannot run {PUBLIC_NAMES[op]}"
    error = import_error(name)
    if error is not None:
        return ValueError, f"{wanted} here: {error}; or use implementation=None or 'xla'"
    table, dtypes = _family(name)
    if op not in table:
        return ValueError, f"{wanted}: it has no kernel for it; use implementation=None or 'xla'"
    if jnp.dtype(dtype) not in dtypes:
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        return TypeError, (f"{wanted} on {jnp.dtype(dtype).name} inputs: its kernels take {names}; use "
                           f"implementation='xla', or None (the reference for {jnp.dtype(dtype).name})")
    return None


def _explicit_kernel(op, phase, name, dtype):
    """`phase` (0 forward, 1 backward) of op's kernel in family `name`, for inputs of `dtype`, as an explicit
    implementation=name runs it; raises `_why_not`'s error when it cannot run: an explicitly requested kernel
    never falls back to the reference. Pallas runs nsa.pallas.runner (Mosaic TPU, Mosaic GPU, or interpret
    mode elsewhere)."""
    why = _why_not(op, name, dtype)
    if why is not None:
        error, message = why
        raise error(message)
    if name == "pallas":
        from nsa import pallas
        return pallas.runner(op, phase, dtype)
    return _family(name)[0][op][phase]


def _platform_kernel(op, phase, name, platform):
    """`phase` of op's compiled kernel in family `name` on `platform` (only where `_runnable`)."""
    if name == "pallas":
        from nsa import pallas
        return pallas.kernel(op, phase, platform)
    return _family(name)[0][op][phase]


@functools.cache
def _has_cuda_gpu():
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:  # no CUDA backend in this jaxlib, or no GPU
        return False


_warned = set()


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def _runnable(op, name, dtype, platform):
    """Whether implementation=None can run family `name`'s kernel of op on dtype on `platform` in this process."""
    if _why_not(op, name, dtype) is not None:
        return False
    if name == "pallas" and platform == "cuda":
        from nsa import pallas
        return pallas.gpu_unavailable(op, 0, dtype) is None
    return True


def _default_family(op, dtype, platform):
    """The kernel family implementation=None runs op on dtype with on `platform`, or None (the reference)."""
    families = _FAMILIES.get(platform, lambda op: ())(op)
    return next((name for name in families if _runnable(op, name, dtype, platform)), None)


def implementations(platform=None, dtype=jnp.bfloat16):
    """Which code `implementation=None` runs for each op: {public op name: 'triton', 'pallas' or 'xla'}.

    For inputs of `dtype` on `platform` ('cpu', 'cuda', 'rocm', 'tpu', or 'gpu': this machine's GPUs, CUDA
    where it has none; default: jax's default backend), in this process (with the packages it can import).
    """
    if platform is not None and platform not in PLATFORMS + ("gpu",):
        names = ", ".join(repr(p) for p in PLATFORMS + ("gpu",))
        raise ValueError(f"platform must be one of {names} or None (jax's default backend), got {platform!r}")
    platform = _platform(platform)
    return {PUBLIC_NAMES[op]: _default_family(op, dtype, platform) or "xla" for op in reference.OPS}


def _platform(name):
    """A platform as platform_dependent names it: None is jax's default backend, and 'gpu' (jax's name for both
    CUDA and ROCm) this machine's GPUs, CUDA where it has none."""
    name = jax.default_backend() if name is None else name
    if name == "gpu":
        return "cuda" if _has_cuda_gpu() or jax.default_backend() != "gpu" else "rocm"
    return name


def _mapped_over_vmap(fn):
    """fn with a vmap rule: jax_triton's triton_call has none. Under vmap the kernel runs once per
    mapped element (lax.map), which also keeps packed sequences (cu_seqlens, B = 1) valid."""

    @jax.custom_batching.custom_vmap
    def batchable(*args):
        return fn(*args)

    @batchable.def_vmap
    def rule(axis_size, in_batched, *args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        batched = jax.tree_util.tree_leaves(in_batched)
        mapped = [x for x, b in zip(leaves, batched) if b]

        def one(xs):
            xs = iter(xs)
            return fn(*jax.tree_util.tree_unflatten(tree, [next(xs) if b else x for x, b in zip(leaves, batched)]))

        out = lax.map(one, mapped)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return batchable


def _choose(op, phase, implementation, dtype, static):
    """The function (*args) -> result that computes `phase` (0 forward, 1 backward) of `op` on inputs of
    `dtype`."""
    static = dict(static)
    ref = functools.partial(reference.OPS[op][phase], **static)
    if implementation == "xla":
        return ref
    if implementation is not None:
        return _mapped_over_vmap(functools.partial(_explicit_kernel(op, phase, implementation, dtype), **static))
    kernels = {}
    for platform in _FAMILIES:
        name = _default_family(op, dtype, platform)
        if name is not None:
            kernels[platform] = _mapped_over_vmap(functools.partial(_platform_kernel(op, phase, name, platform),
                                                                    **static))
        elif platform == "cuda" and op in _family("pallas")[0] and import_error("triton") is not None and \
                _has_cuda_gpu():  # an op with kernels elsewhere (compress has none: XLA is its implementation)
            _warn_once(f"nsa runs its XLA reference on the GPU for {jnp.dtype(dtype).name} inputs, more than 10x "
                       f"slower than its kernels: {_cuda_reasons(op, dtype)}. nsa.implementations() tells what runs "
                       f"where.")
    if not kernels:
        return ref
    return lambda *args: platform_dependent(*args, default=ref, **kernels)


def _as_jax(arrays):
    return jax.tree_util.tree_map(jnp.asarray, arrays)


def run(op, implementation, static, arrays):
    """Runs the forward of an op that has no gradient and no residuals (select)."""
    arrays = _as_jax(arrays)
    return _choose(op, 0, implementation, arrays[0].dtype, static)(*arrays)


def apply(op, implementation, static, arrays):
    """Runs op as a custom_vjp: differentiable in every floating array of `arrays` (reverse mode only: see
    `_apply`)."""
    arrays = _as_jax(arrays)
    return _apply(op, implementation, arrays[0].dtype, static, arrays)


# Reverse mode only. JAX gives a function a forward mode (custom_jvp) or a custom backward (custom_vjp), never both:
# a custom_jvp's reverse mode is its jvp transposed. Measured on nsa.attention's gradient (T = 4096, HQ = 16, H = 1,
# D = 64, float32, implementation="xla"; XLA:CPU's temp memory, jax 0.10.2): 245 MiB with this custom_vjp, 2779 MiB
# with a custom_jvp whose tangents are the transpose of this vjp (the backward's recomputed probabilities become
# residuals), 4827 MiB with autodiff of the reference's forward. jax.jvp raises "can't apply forward-mode autodiff
# (jvp) to a custom_vjp function"; a JVP is jax.linear_transpose of the VJP, with implementation="xla"
# (tests/test_api.py).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _apply(op, implementation, dtype, static, arrays):
    return _choose(op, 0, implementation, dtype, static)(*arrays)[0]


def _apply_fwd(op, implementation, dtype, static, arrays):
    return _choose(op, 0, implementation, dtype, static)(*arrays)


def _apply_bwd(op, implementation, dtype, static, residuals, cotangents):
    return (tuple(_choose(op, 1, implementation, dtype, static)(residuals, cotangents)),)


_apply.defvjp(_apply_fwd, _apply_bwd)


def _cuda_reasons(op, dtype):
    """Why no kernel family can run op on dtype on a CUDA GPU here (a sentence per family)."""
    from nsa import pallas

    triton = import_error("triton") or (_why_not(op, "triton", dtype) or (None, "it cannot run it"))[1]
    return f"Triton: {triton}; Mosaic GPU: {pallas.gpu_unavailable(op, 0, dtype)}"


def _fuses_decode(implementation, q, k):
    """Whether nsa.attention's decode step on q [B, TQ, HQ, Dk] and the cache k may run Triton's fused
    kernels: implementation None or 'triton', Triton runnable here on q's dtype, and few queries
    (nsa.triton.decode.applies)."""
    if implementation not in (None, "triton") or not _runnable("selected", "triton", q.dtype, "cuda"):
        return False
    from nsa.triton import decode

    return decode.applies(q, k)


def decode_step(implementation, static, branches, arrays):
    """nsa.attention over a KV cache with the compressed branch on and the blocks selected: `branches(*arrays)`
    (the ops one after another), or where Triton runs it (implementation 'triton', or None on a CUDA GPU) and
    the step is a decode one, the same result from nsa.triton.decode.attention's fused kernels (five launches
    instead of the ops' ten). arrays: (q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, kv_lens), gates None or
    arrays. The gradient is always that of `branches`: a fused step runs only when no gradient is taken."""
    q, k = arrays[0], arrays[1]
    if not _fuses_decode(implementation, q, k):
        return branches(*arrays)
    from nsa.triton import decode

    fused = _mapped_over_vmap(lambda *a: decode.attention(*a, **dict(static)))
    choose = fused if implementation == "triton" else (
        lambda *a: platform_dependent(*a, cuda=fused, default=branches))

    @jax.custom_vjp
    def step(*arrays):
        return choose(*arrays)

    def step_fwd(*arrays):
        return jax.vjp(branches, *arrays)

    step.defvjp(step_fwd, lambda vjp, cotangent: vjp(cotangent))
    return step(*_as_jax(arrays))


# ------------------------------------------------------------------------------------------- the platform switch

def platform_dependent(*args, default, **per_platform):
    """`jax.lax.platform_dependent(*args, default=default, **per_platform)`, made for programs lowered (exported) for
    several platforms at once, and for the kernels' limits to apply only where they run:

    - each branch is lowered for its platform alone. jax's platform_dependent (a cond) lowers the branches it keeps
      for every platform of the program, so that a Pallas TPU kernel is also lowered for the CPU ("Only interpret
      mode is supported on CPU backend") and for CUDA ("Compiler params for platform tpu cannot be used for gpu
      lowering"), and Mosaic GPU's for every platform ("mpmd_map does not support multi-platform lowering");
    - `default` is traced now (it may close over traced values): its results' shapes and dtypes are every branch's,
      and its effects the switch's. The branches of `per_platform` are traced only when the program is lowered for
      their platform: they must not close over traced values nor have effects, and their results must match
      `default`'s (else lowering raises). A program lowered for the CPU never traces the TPU or GPU kernels.
    """
    leaves, in_tree = jax.tree_util.tree_flatten(args)
    flat = lambda fn: lambda *xs: jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(in_tree, xs)))
    closed, shapes = jax.make_jaxpr(default, return_shape=True)(*args)
    outs = _switch(leaves, closed, tuple((platform, flat(fn)) for platform, fn in per_platform.items()))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outs)


_switch_p = jex_core.Primitive("nsa_platform_dependent")
_switch_p.multiple_results = True
_switch_p.def_effectful_abstract_eval(lambda *avals, outputs, switch_effects, **_: (outputs, switch_effects))


def _switch(operands, closed, branches):
    """The switch's outputs: on `operands` and the constants of `closed` (the default branch traced on operands;
    its constants may be traced values, hence operands too), with `branches` ((platform, fn of operands), ...)."""
    n = len(operands)
    default = lambda *xs: jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(closed.jaxpr, xs[n:]))(*xs[:n])
    branches = tuple((platform, functools.partial(_first, n, fn)) for platform, fn in branches)
    return _switch_p.bind(*operands, *closed.consts, default=default, branches=branches,
                          outputs=tuple(closed.out_avals), switch_effects=frozenset(closed.effects))


def _first(n, fn, *xs):
    return fn(*xs[:n])


def _switch_batched(args, dims, *, default, branches, **_):
    """vmap: every branch vmapped (the kernels' own rules then apply, `_mapped_over_vmap`)."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)  # None: not mapped
    vmapped = lambda fn: jax.vmap(fn, in_axes=tuple(dims), axis_size=size)
    outs = _switch(args, jax.make_jaxpr(vmapped(default))(*args),
                   tuple((platform, vmapped(fn)) for platform, fn in branches))
    return outs, [0] * len(outs)


def _switch_eager(*args, default, branches, outputs, **_):
    """Called outside jit: the branch of the platform jax runs it on (its default backend)."""
    platform = _platform(None)
    return _checked(platform, dict(branches).get(platform, default), outputs)(*args)


def _switch_lowering(platform, ctx, *args, default, branches, outputs, switch_effects):
    """The switch lowered for `platform` (None: one without a rule of its own). Each platform has its own rule, so
    that jax, lowering a program for several, lowers each for that platform alone (mlir.lower_per_platform), and
    what its branch holds (a kernel, another switch) with it."""
    fn = _checked(platform, dict(branches).get(platform, default), outputs)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _checked(platform, fn, outputs):
    """fn, raising TypeError unless its results have the shapes and dtypes `outputs` (the default branch's)."""
    def run(*xs):
        outs = fn(*xs)
        got, want = [(o.shape, o.dtype) for o in outs], [(a.shape, a.dtype) for a in outputs]
        if got != want:
            raise TypeError(f"nsa: the {platform} branch of a platform_dependent returns {got}, its default {want}")
        return outs

    return run


_switch_p.def_impl(_switch_eager)
batching.primitive_batchers[_switch_p] = _switch_batched
mlir.register_lowering(_switch_p, functools.partial(_switch_lowering, None))  # the platforms without a rule
for _platform_name in PLATFORMS:
    mlir.register_lowering(_switch_p, functools.partial(_switch_lowering, _platform_name), platform=_platform_name)
