"""One custom_vjp shared by every op, and the choice of the code that runs each op. It names no kernel family:
nsa._families is their registry, and each family describes itself.

`apply(op, implementation, static, arrays)` runs op's forward on `arrays` (a tuple; differentiable
arrays and integer arrays alike, the first one the op's main floating input, q or x) with the hashable
`static` configuration (a tuple of (name, value) pairs). Forward and backward each go through `_choose`:

- implementation="xla": the reference (nsa.reference);
- implementation=<a family's name>: what that family's `explicit` runs (it may choose per platform itself), or
  a ValueError (the family cannot run here, or has no kernel for the op) or TypeError (it has no kernel for the
  dtype) that says why: an explicitly requested kernel never falls back to the reference;
- implementation=None: `platform_dependent` (nsa._platform) between, per platform, the first family of
  nsa._families.PREFERENCE that can run the op on its dtype there (or, where a family it prefers later claims
  some inputs, a choice between the two at run time: `_claimed`), and the reference everywhere else. When no
  family can on a machine with a CUDA GPU, the reference runs there and a RuntimeWarning says so, once.

Each branch of `platform_dependent` is lowered for its platform alone, and a platform's kernel is traced only
when a program is lowered for that platform. `implementations()` tells which code implementation=None runs.
"""

import functools
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from nsa import _families, _platform, reference
from nsa._config import as_sequences
from nsa._platform import PLATFORMS, mapped_over_vmap, platform_dependent, platform_name

# the public name of each op
PUBLIC_NAMES = {"compress": "compress", "compressed": "compressed_attention", "select": "select_blocks",
                "selected": "selected_attention", "window": "sliding_window_attention"}


def _why_not(op, name, dtype):
    """None when family `name` has a kernel for op on inputs of `dtype` and can run in this process, else (the
    exception class, the reason): ValueError when the family cannot run here or has no kernel for op, TypeError
    when it has none for dtype."""
    wanted = f"implementation={name!r} cannot run {PUBLIC_NAMES[op]}"
    error = _families.missing(name)
    if error is not None:
        return ValueError, f"{wanted} here: {error}; or use implementation=None or 'xla'"
    family = _families.family(name)
    if op not in family.KERNELS:
        return ValueError, f"{wanted}: it has no kernel for it; use implementation=None or 'xla'"
    if jnp.dtype(dtype) not in family.DTYPES:
        names = ", ".join(jnp.dtype(d).name for d in family.DTYPES)
        return TypeError, (f"{wanted} on {jnp.dtype(dtype).name} inputs: its kernels take {names}; use "
                           f"implementation='xla', or None (the reference for {jnp.dtype(dtype).name})")
    return None


def _explicit_kernel(op, phase, name, dtype):
    """`phase` (0 forward, 1 backward) of op's kernel in family `name`, for inputs of `dtype`, as an explicit
    implementation=name runs it; raises `_why_not`'s error when it cannot run: an explicitly requested kernel
    never falls back to the reference."""
    why = _why_not(op, name, dtype)
    if why is not None:
        error, message = why
        raise error(message)
    return _families.family(name).explicit(op, phase, dtype)


_warned = set()


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def _runnable(op, name, dtype, platform):
    """Whether implementation=None can run family `name`'s kernel of op on dtype on `platform` in this process."""
    return _why_not(op, name, dtype) is None and _families.family(name).unavailable(op, 0, dtype, platform) is None


def _default_family(op, dtype, platform):
    """The kernel family implementation=None runs op on dtype with on `platform`, or None (the reference)."""
    return next((name for name in _families.preferred(op, platform) if _runnable(op, name, dtype, platform)), None)


def implementations(platform: Optional[str] = None, dtype: jnp.dtype = jnp.bfloat16) -> dict[str, str]:
    """Which code `implementation=None` runs for each op: {public op name: 'triton', 'pallas' or 'xla'}.

    For inputs of `dtype` on `platform` ('cpu', 'cuda', 'rocm', 'tpu', or 'gpu': this machine's GPUs, CUDA
    where it has none; default: jax's default backend), in this process (with the packages it can import).
    The family named runs the op; its forward, or some of its gradients, may run another family's kernel on the
    inputs that family claims (on CUDA: Mosaic GPU's selected-attention forward and dq where neighbouring tokens
    select much the same blocks, nsa.pallas.gpu.selected.packs and packs_dq, and the window's backward below 64k
    tokens, nsa.pallas.gpu.window.outruns_backward; Triton's select where a block sums several compressed rows,
    nsa.triton.select.sums_eq9).
    """
    if platform is not None and platform not in PLATFORMS + ("gpu",):
        names = ", ".join(repr(p) for p in PLATFORMS + ("gpu",))
        raise ValueError(f"platform must be one of {names} or None (jax's default backend), got {platform!r}")
    platform = platform_name(platform)
    return {PUBLIC_NAMES[op]: _default_family(op, dtype, platform) or "xla" for op in reference.OPS}


def _choose(op, phase, implementation, dtype, static):
    """The function (*args) -> result that computes `phase` (0 forward, 1 backward) of `op` on inputs of
    `dtype`."""
    static = dict(static)
    ref = functools.partial(reference.OPS[op][phase], **static)
    if implementation == "xla":
        return ref
    if implementation is not None:
        return mapped_over_vmap(functools.partial(_explicit_kernel(op, phase, implementation, dtype), **static))
    kernels = {}
    for platform in _families.PREFERENCE:
        name = _default_family(op, dtype, platform)
        if name is not None:
            kernel = _claimed(op, phase, dtype, platform, name)
            kernels[platform] = mapped_over_vmap(functools.partial(kernel, **static))
        elif platform == "cuda" and _has_kernels(op, platform) and _platform.has_cuda_gpu():
            _warn_once(f"nsa runs its XLA reference on the GPU for {jnp.dtype(dtype).name} inputs, more than 10x "
                       f"slower than its kernels: {_cuda_reasons(op, dtype)}. nsa.implementations() tells what runs "
                       f"where.")
    if not kernels:
        return ref
    return lambda *args: platform_dependent(*args, default=ref, **kernels)


def _claimed(op, phase, dtype, platform, name):
    """The kernel implementation=None runs for `phase` of op on `platform`: family `name`'s, or where a family it
    prefers after `name` there claims some inputs (its `claims`: an nsa._config.Claim) and can run them, a
    run-time choice between the two (lax.cond on the claim's test, both compiled; per element under vmap:
    mapped_over_vmap)."""
    kernel = _families.family(name).kernel(op, phase, platform)
    order = _families.preferred(op, platform)
    for other in order[order.index(name) + 1:]:
        family = _families.family(other)
        claims = getattr(family, "claims", None) if family is not None else None
        claim = claims(op, phase, platform) if claims is not None else None
        if claim is not None and _why_not(op, other, dtype) is None and family.unavailable(op, phase, dtype,
                                                                                           platform) is None:
            return functools.partial(_switch, claim, family.kernel(op, phase, platform), kernel)
    return kernel


def _switch(claim, claimed, kernel, *args, **static):
    """claimed(*args, **static) where claim.test(*args, **static) holds, else kernel(*args, **static); a static False
    or True (the test decides by the arguments' shapes or the static configuration) runs one of them alone, no
    lax.cond. A claim on some gradients (claim.grads) chooses who computes those; kernel computes claim.rest either
    way."""
    holds = claim.test(*args, **static)
    if holds is False:
        return kernel(*args, **static)

    def chosen(**part):
        if holds is True:
            return claimed(*args, **part)
        return lax.cond(holds, functools.partial(claimed, **part), functools.partial(kernel, **part), *args)

    if claim.grads is None:
        return chosen(**static)
    mine = chosen(**static, grads=claim.grads)
    rest = kernel(*args, **dict(static, grads=claim.rest))
    return tuple(r if m is None else m for m, r in zip(mine, rest, strict=True))


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
    return _reverse_mode_only(_apply, op, implementation, arrays[0].dtype, static, arrays)


# Reverse mode only. JAX gives a function a forward mode (custom_jvp) or a custom backward (custom_vjp), never both:
# a custom_jvp's reverse mode is its jvp transposed. Measured on nsa.attention's gradient (T = 4096, HQ = 16, H = 1,
# D = 64, float32, implementation="xla"; XLA:CPU's temp memory, jax 0.10.2): 245 MiB with this custom_vjp, 2779 MiB
# with a custom_jvp whose tangents are the transpose of this vjp (the backward's recomputed probabilities become
# residuals), 4827 MiB with autodiff of the reference's forward. jax.jvp raises FORWARD_MODE (`_reverse_mode_only`);
# a JVP is jax.linear_transpose of the VJP, with implementation="xla" (tests/test_api.py).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _apply(op, implementation, dtype, static, arrays):
    return _choose(op, 0, implementation, dtype, static)(*arrays)[0]


FORWARD_MODE = ("nsa's ops have no forward-mode derivative (jax.jvp, jax.jacfwd, jax.hessian): each is a custom_vjp, "
                "reverse mode only (jax.grad, jax.vjp, jax.jacrev and jax.linearize work), since forward mode would "
                "cost about 11x reverse mode's memory. A JVP is the VJP transposed, with implementation='xla': "
                "out, vjp = jax.vjp(f, *primals); jax.linear_transpose(vjp, out)(tangents) (docs/contract.md, Limits)")


def _reverse_mode_only(custom_vjp, *args):
    """custom_vjp(*args), raising TypeError(FORWARD_MODE) under forward-mode autodiff instead of JAX's message, which
    names only a custom_vjp function."""
    try:
        return custom_vjp(*args)
    except TypeError as error:
        if "forward-mode autodiff" not in str(error):
            raise
        raise TypeError(FORWARD_MODE) from error


def _apply_fwd(op, implementation, dtype, static, arrays):
    return _choose(op, 0, implementation, dtype, static)(*arrays)


def _apply_bwd(op, implementation, dtype, static, residuals, cotangents):
    return (tuple(_choose(op, 1, implementation, dtype, static)(residuals, cotangents)),)


_apply.defvjp(_apply_fwd, _apply_bwd)


def _has_kernels(op, platform):
    """Whether some family that implementation=None may prefer on `platform` has a kernel for op (compress has
    none anywhere: XLA is its implementation)."""
    return any(op in getattr(_families._load(name), "KERNELS", ()) for name in _families.preferred(op, platform))


def _cuda_reasons(op, dtype):
    """Why no kernel family can run op on dtype on a CUDA GPU here (a sentence per family)."""
    def reason(name):
        if _families.missing(name) is not None:
            return _families.missing(name)
        why = _why_not(op, name, dtype)
        return why[1] if why is not None else _families.family(name).unavailable(op, 0, dtype, "cuda")

    return "; ".join(f"{name}: {reason(name)}" for name in sorted(_families.preferred(op, "cuda")))


def _offers(hook, implementation, dtype, *args):
    """{platform: fn} (platform None: every platform): what the family that runs selected attention offers through
    its optional `hook` (nsa._families: `fused_step`, `paged_selected`) for a call on `args` (its first a floating
    array of `dtype`). implementation=<name>: that family's offer (any platform it names, or every one); None: per
    platform, that of the family implementation=None runs selected attention with there, for that platform."""
    if implementation == "xla":
        return {}
    chosen = ({None: implementation} if implementation is not None else
              {platform: _default_family("selected", dtype, platform) for platform in _families.PREFERENCE})
    offers = {}
    for platform, name in chosen.items():
        offer = getattr(_families.family(name), hook, None) if name is not None else None
        offered = offer(*args) if offer is not None and _why_not("selected", name, dtype) is None else None
        for where, fn in (offered or {}).items():
            if platform is None or where in (None, platform):
                offers[platform if platform is not None else where] = fn
    return offers


def _forward_of(steps, default, static, arrays):
    """default(*arrays), or where `steps` ({platform: fn}, None: every platform) offers one, that function's forward
    (fn(*arrays, **static)) with default's gradient: a step's own forward runs only when no gradient is taken."""
    if not steps:
        return default(*arrays)
    steps = {platform: mapped_over_vmap(functools.partial(step, **dict(static))) for platform, step in steps.items()}
    choose = steps[None] if None in steps else (lambda *a: platform_dependent(*a, default=default, **steps))

    @jax.custom_vjp
    def step(*arrays):
        return choose(*arrays)

    def step_fwd(*arrays):
        return jax.vjp(default, *arrays)

    step.defvjp(step_fwd, lambda vjp, cotangent: vjp(cotangent))
    return _reverse_mode_only(step, *_as_jax(arrays))


def decode_step(implementation, static, branches, arrays):
    """nsa.attention over a KV cache with the compressed branch on and the blocks selected: `branches(*arrays)`
    (the ops one after another), or where the family that runs it has a fused serving step for this step's shape
    (a family's `fused_step`), that step. arrays: an nsa._config.Step, gates None or arrays. The gradient is
    always that of `branches`: a fused step runs only when no gradient is taken."""
    steps = _offers("fused_step", implementation, arrays.q.dtype, arrays.q,
                    as_sequences(arrays.k, arrays.page_table), dict(static))
    return _forward_of(steps, branches, static, arrays)


def paged_selected(implementation, static, gathered, arrays):
    """Selected attention of a decode step over a paged cache, arrays = (q, k, v, block_indices, block_counts,
    kv_lens, page_table) with k and v its pools of pages: `gathered(*arrays)` (the blocks gathered through the page
    table in XLA, then the op), or where the family that runs selected attention reads the pages itself (its
    `paged_selected`), that forward. The gradient is always that of `gathered`."""
    q, k, v = arrays[:3]
    steps = _offers("paged_selected", implementation, q.dtype, q, k, v, dict(static))
    return _forward_of(steps, gathered, static, arrays)
