"""The layout of nsa/ holds: no import circle (not even a lazy one), no module importing one above it, no
private name crossing modules, the two Pallas families siblings, no device number in kernel code, and a new
family is one line of the registry."""

import ast
import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa import _families
from nsa._config import Claim, wanted

ROOT = pathlib.Path(nsa.__file__).parent

# Each module's layer: a module imports only modules of its own layer or below (a package's __init__, the family's
# description, sits above the modules of its package).
LAYERS = [
    ("nsa._varlen", "nsa._device", "nsa._config", "nsa._platform", "nsa._plan"),
    ("nsa.reference",),
    ("nsa.triton.", "nsa.pallas."),  # the kernel modules of each family
    ("nsa.triton", "nsa.pallas"),  # the families' descriptions
    ("nsa._families",),
    ("nsa._checks", "nsa._dispatch", "nsa._kvcache", "nsa.context"),
    ("nsa.api",),
    ("nsa.cache", "nsa.packing"),
    ("nsa.nnx", "nsa.demo", "nsa"),
]


def _name(path):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _layer(module):
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or (p.endswith(".") and module.startswith(p)) for p in prefixes):
            return rank
    for rank, prefixes in enumerate(LAYERS):  # nsa.reference.select: its package's layer
        if any(module.startswith(p + ".") for p in prefixes if not p.endswith(".")):
            return rank
    raise AssertionError(f"{module} has no layer in tests/test_house.py LAYERS")


def _imports(module):
    """[(imported nsa module, [names taken from it])] of every import statement of `module`, at any depth."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] == "nsa"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "nsa":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found += [(sub, [])] if sub in MODULES else [(node.module, [alias.name])]
    return found


def test_no_module_imports_one_above_it():
    upward = [f"{m} -> {target}" for m in MODULES for target, _ in _imports(m)
              if target in MODULES and _layer(target) > _layer(m)]
    assert not upward, upward


def test_no_import_circle():
    graph = {m: {t for t, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    state = {}

    def visit(m, path):
        if state.get(m) == "open":
            raise AssertionError(f"import circle: {' -> '.join(path[path.index(m):] + [m])}")
        if state.get(m) is None:
            state[m] = "open"
            for t in sorted(graph[m]):
                visit(t, path + [m])
            state[m] = "done"

    for m in MODULES:
        visit(m, [])


def test_no_private_name_crosses_modules():
    crossing = [f"{m} takes {target}.{name}" for m in MODULES for target, names in _imports(m) for name in names
                if name.startswith("_")]
    assert not crossing, crossing


def test_the_pallas_families_are_siblings():
    crossing = [f"{m} -> {t}" for m in MODULES for t, _ in _imports(m)
                for a, b in (("nsa.pallas.tpu", "nsa.pallas.gpu"), ("nsa.pallas.gpu", "nsa.pallas.tpu"))
                if m.startswith(a) and t.startswith(b)]
    assert {"nsa.pallas.tpu", "nsa.pallas.gpu"} <= set(MODULES) and not crossing, crossing


# An H200's SMs and shared memory per block (KiB and bytes): they come from nsa._device, never from kernel code.
H200_NUMBERS = {132, 227, 227 * 1024, 228 * 1024}


def test_no_device_number_in_kernel_code():
    found = [f"{m}:{node.lineno}: {node.value}" for m in MODULES if m.startswith(("nsa.triton", "nsa.pallas"))
             for node in ast.walk(ast.parse(MODULES[m].read_text()))
             if isinstance(node, ast.Constant) and type(node.value) is int and node.value in H200_NUMBERS]
    assert not found, found


def _register(monkeypatch, name, window_forward, window_backward=nsa.reference.OPS["window"][1]):
    """A family `name` that describes itself: window_forward and window_backward (the reference's) behind a kernel
    table of one op, for float32."""
    family = types.ModuleType(f"nsa_test_{name}")
    family.DTYPES = (jnp.dtype(jnp.float32),)
    family.KERNELS = {"window": (window_forward, window_backward)}
    family.missing = lambda: None
    family.unavailable = lambda op, phase, dtype, platform: None
    family.kernel = lambda op, phase, platform: family.KERNELS[op][phase]
    family.explicit = lambda op, phase, dtype: family.KERNELS[op][phase]
    monkeypatch.setitem(sys.modules, family.__name__, family)
    monkeypatch.setitem(_families.FAMILIES, name, (family.__name__, "it is a test"))
    _families._load.cache_clear()  # an earlier test's family of the same name
    return family


def test_a_new_family_is_one_line_of_the_registry(monkeypatch):
    """A family that describes itself (here: the reference behind a kernel table of one op) runs as
    implementation=<its name>, and implementation=None picks it where PREFERENCE puts it first."""
    calls = []

    def window_forward(*args, **static):
        calls.append(static)
        return nsa.reference.OPS["window"][0](*args, **static)

    _register(monkeypatch, "mine", window_forward)
    monkeypatch.setitem(_families.PREFERENCE, "cpu", {"window": ("mine",)})
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, 32, h, 16)), jnp.float32) for h in (4, 2))
    want = nsa.sliding_window_attention(q, k, k, window_size=8, implementation="xla")
    assert nsa.implementations("cpu", jnp.float32)["sliding_window_attention"] == "mine"
    np.testing.assert_array_equal(nsa.sliding_window_attention(q, k, k, window_size=8), want)
    assert len(calls) == 1
    with pytest.raises(TypeError, match="implementation='mine' cannot run sliding_window_attention on bfloat16"):
        nsa.sliding_window_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                                     window_size=8, implementation="mine")


def test_a_later_family_claims_inputs_at_run_time(monkeypatch):
    """A family preferred second whose `claims` test holds on some inputs runs its forward on those, decided at run
    time (under jit, and per element under vmap); the first family runs the others, and every input where the test
    is a static False (here: T < 16). Where the test is a static True (16 <= T < 32), the claimed kernel runs alone,
    no cond."""
    reference = nsa.reference.OPS["window"][0]

    def doubled(*args, **static):  # the claiming family's forward: o doubled, to tell which one ran
        o, residuals = reference(*args, **static)
        return 2 * o, residuals

    def test(q, *args, **static):
        return False if q.shape[1] < 16 else True if q.shape[1] < 32 else jnp.sum(q) > 0

    _register(monkeypatch, "first", reference)
    _register(monkeypatch, "second", doubled).claims = lambda op, phase, platform: Claim(test) if phase == 0 else None
    monkeypatch.setitem(_families.PREFERENCE, "cpu", {"window": ("first", "second")})
    assert nsa.implementations("cpu", jnp.float32)["sliding_window_attention"] == "first"
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(np.abs(rng.standard_normal((1, 32, h, 16))), jnp.float32) for h in (4, 2))
    attend = jax.jit(lambda q, k: nsa.sliding_window_attention(q, k, k, window_size=8))
    want = nsa.sliding_window_attention(q, k, k, window_size=8, implementation="xla")
    np.testing.assert_allclose(attend(q, k), 2 * want, rtol=1e-6)  # claimed: sum(q) > 0
    np.testing.assert_allclose(attend(-q, k), nsa.sliding_window_attention(-q, k, k, window_size=8,
                                                                           implementation="xla"), rtol=1e-6)
    np.testing.assert_allclose(attend(q[:, :8], k[:, :8]), want[:, :8], rtol=1e-6)  # a static False
    for sign in (1, -1):  # a static True, whatever sum(q)
        np.testing.assert_allclose(attend(sign * q[:, :24], k[:, :24]), 2 * nsa.sliding_window_attention(
            sign * q[:, :24], k[:, :24], k[:, :24], window_size=8, implementation="xla"), rtol=1e-6)
    assert "stablehlo.case" not in attend.lower(q[:, :24], k[:, :24]).as_text()
    assert "stablehlo.case" in attend.lower(q, k).as_text()  # the traced test's cond
    both = jax.vmap(attend)(jnp.stack([q, -q]), jnp.stack([k, k]))
    np.testing.assert_allclose(both[0], 2 * want, rtol=1e-6)
    np.testing.assert_allclose(both[1], attend(-q, k), rtol=1e-6)


def test_a_later_family_claims_some_gradients_at_run_time(monkeypatch):
    """A claim on a backward's gradients (Claim.grads): where its test holds the claiming family computes those
    (here dq, doubled to tell), elsewhere the first family does; the first family computes the rest (dk, dv) either
    way, asked for them alone, and nobody computes a gradient twice. Under jit and per element under vmap."""
    reference_forward, reference_backward = nsa.reference.OPS["window"]
    asked = []

    def first_backward(residuals, do, grads=None, **static):
        asked.append(grads)
        full = reference_backward(residuals, do, **static)
        return tuple(g if wanted(grads, i) else None for i, g in enumerate(full))

    def second_backward(residuals, do, grads=None, **static):
        assert grads == (0,)
        full = reference_backward(residuals, do, **static)
        return (2 * full[0],) + (None,) * (len(full) - 1)

    def test(residuals, do, **static):
        return jnp.sum(residuals[0]) > 0

    _register(monkeypatch, "first", reference_forward, first_backward)
    claim = Claim(test, grads=(0,), rest=(1, 2))
    _register(monkeypatch, "second", reference_forward, second_backward).claims = (
        lambda op, phase, platform: claim if phase == 1 else None)
    monkeypatch.setitem(_families.PREFERENCE, "cpu", {"window": ("first", "second")})
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(np.abs(rng.standard_normal((1, 32, h, 16))), jnp.float32) for h in (4, 2))
    w = jnp.asarray(rng.standard_normal((1, 32, 4, 16)), jnp.float32)

    def gradients(implementation):
        loss = lambda q, k, v: jnp.sum(w * nsa.sliding_window_attention(q, k, v, window_size=8,
                                                                        implementation=implementation))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    for sign in (1, -1):
        got, want = gradients(None)(sign * q, k, k), gradients("xla")(sign * q, k, k)
        for name, a, b, factor in zip("qkv", got, want, (2 if sign > 0 else 1, 1, 1)):
            np.testing.assert_allclose(a, factor * b, rtol=1e-5, atol=1e-6, err_msg=f"d{name}, sign {sign}")
    assert set(asked) == {(0,), (1, 2)}, asked  # never the whole backward
    both = jax.vmap(gradients(None))(jnp.stack([q, -q]), jnp.stack([k, k]), jnp.stack([k, k]))
    for i, sign in enumerate((1, -1)):
        for a, b in zip(both, gradients(None)(sign * q, k, k)):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-6)
