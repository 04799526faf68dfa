"""The registry of kernel families: the one place that names them.

A family is a package under nsa/ whose module describes itself with these names (nsa/triton/__init__.py and
nsa/pallas/__init__.py are the two there are):

- `DTYPES`: the input dtypes its kernels take;
- `KERNELS`: {op of nsa.reference.OPS: (forward, backward or None)}, with the reference's signatures and residuals;
- `missing()`: why the family cannot run at all in this process (a sentence: a package that does not import),
  or None;
- `unavailable(op, phase, dtype, platform)`: why it cannot run `phase` (0 forward, 1 backward) of op on `dtype`
  inputs on `platform` (as platform_dependent names it) in this process, beyond KERNELS and DTYPES, or None;
- `kernel(op, phase, platform)`: the compiled kernel of one platform, as implementation=None runs it there;
- `explicit(op, phase, dtype)`: what an explicit implementation=<name> runs (it may choose per platform itself);
- optionally `claims(op, phase, platform)`: None, or an nsa._config.Claim: the arguments of `phase` on which this
  family's kernel outruns that of the family implementation=None prefers before it on `platform`, where
  implementation=None then decides between the two at run time (a lax.cond, both compiled) where both can run
  (`nsa._dispatch`). A claim on a backward may cover some of its gradients only: both families' backwards of op
  then take the keyword `grads` (the indices of the gradients to compute; None comes back at the others);
- optionally `fused_step(q, k, static)`: a fused serving step for nsa.attention over a KV cache with q's shape
  and the configuration `static` (`nsa._dispatch.decode_step`), as {platform: fn} (None: every platform the family
  runs on), or None where it does not apply;
- optionally `paged_selected(q, k, v, static)`: selected attention's forward of a decode step that reads a paged
  cache's pools k, v [P, S, H, D] through the page table itself (`nsa._dispatch.paged_selected`), as
  {platform: fn}, or None where it does not apply.

Adding a family is its folder plus one line of FAMILIES; PREFERENCE says where implementation=None runs it.
"""

import functools
import importlib

# name (implementation=<name>) -> (the module that describes it, how to install what it needs)
FAMILIES = {
    "triton": ("nsa.triton", "from a checkout of nsa, pip install '.[cuda]' (jax-triton 0.3.1, triton 3.6.0 and "
                             "jax's CUDA 13 wheels)"),
    "pallas": ("nsa.pallas", "jax[tpu] on a TPU VM, jax[cuda13] (jax >= 0.11) on an NVIDIA GPU"),
}

# platform -> {op: the families implementation=None may run there, in the order it prefers them}; an op missing
# from a platform's table takes its "*" entry. On cuda, the faster one as measured on the H200 at 64k
# (benchmarks/results/ops-65536-pallas.json against ops-65536.json; select: 8.4 against 11.8 ms, the rest Triton),
# and selected attention's forward and dq chosen per input: Mosaic GPU's where its tiles' tokens share blocks (its
# `claims`: nsa.pallas.gpu.selected.packs and packs_dq); select runs Triton's kernel where a block sums several
# compressed rows (Eq. 9, the Triton family's claim: nsa.triton.select.sums_eq9); the window's backward runs Mosaic
# GPU's below 64k tokens (nsa.pallas.gpu.window.outruns_backward).
PREFERENCE = {
    "tpu": {"*": ("pallas",)},
    "cuda": {"*": ("triton", "pallas"), "select": ("pallas", "triton")},
}


def preferred(op, platform):
    """The families implementation=None tries for op on `platform`, in order (none: the reference runs there)."""
    table = PREFERENCE.get(platform, {})
    return table.get(op, table.get("*", ()))


@functools.cache
def _load(name):
    """The family's module, or the sentence saying why it does not import."""
    module, install = FAMILIES[name]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        return f"{module} does not import ({type(e).__name__}: {e}); {install}"


def family(name):
    """The module describing family `name` (a key of FAMILIES), or None where it cannot run in this process."""
    module = _load(name)
    return None if isinstance(module, str) or module.missing() is not None else module


def missing(name):
    """Why family `name` cannot run at all in this process (a sentence), or None."""
    module = _load(name)
    if isinstance(module, str):
        return module
    why = module.missing()
    return None if why is None else f"{why}; {FAMILIES[name][1]}"
