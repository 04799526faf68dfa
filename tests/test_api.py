"""What the public API promises beyond the numbers: cu_seqlens values (checked when concrete, made valid
when traced, lists accepted), integer scalars of any kind, a traced (learned) scale, empty inputs, and
which implementation runs: explicit requests that cannot run raise, implementation=None says when it
falls back, and nsa.implementations() tells what runs where."""

import inspect
import typing
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import nsa
from nsa import _dispatch, _platform, pallas
from nsa._varlen import made_valid
from tests import oracle
from tests.base import MOSAIC_GPU_LOWERS, TOLERANCE, Inputs, assert_close, gradient_scales

B, T, HQ, H, D, BS = 1, 100, 4, 2, 16, 16


def _ops(x, cu, **kw):
    """Every op on the inputs x with cu_seqlens cu, as a tuple of outputs."""
    k_cmp = nsa.compress(x.k, block_size=BS, cu_seqlens=cu)
    v_cmp = nsa.compress(x.v, block_size=BS, cu_seqlens=cu)
    g = [gi[0] for gi in x.gates]
    return (k_cmp,
            *nsa.compressed_attention(x.q, k_cmp, v_cmp, block_size=BS, cu_seqlens=cu, **kw),
            nsa.select_blocks(x.q, k_cmp, block_counts=3, block_size=BS, cu_seqlens=cu, **kw),
            nsa.selected_attention(x.q, x.k, x.v, x.block_indices(3), block_size=BS, cu_seqlens=cu, **kw),
            nsa.sliding_window_attention(x.q, x.k, x.v, window_size=7, cu_seqlens=cu, **kw),
            nsa.attention(x.q, x.k, x.v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], block_counts=3, block_size=BS,
                          window_size=7, cu_seqlens=cu, **kw))


def _assert_equal(got, want):
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------- cu_seqlens

@pytest.mark.parametrize("bad, valid", [
    ([0, 60, 40, 100], [0, 60, 60, 100]),  # decreasing: an empty sequence where it goes down
    ([10, 40, 100], [0, 40, 100]),  # not starting at 0: the leading tokens join the first sequence
    ([0, 40, 70], [0, 40, 100]),  # not ending at T: the trailing tokens join the last sequence
    ([-5, 130, 130, 200], [0, 100, 100, 100]),  # out of [0, T]: clipped
])
def test_traced_invalid_cu_seqlens_runs_as_made_valid(bad, valid):
    """Under jit cu_seqlens cannot be checked: every op then runs on its valid form (the README's rule)."""
    np.testing.assert_array_equal(np.asarray(made_valid(jnp.asarray(bad), T)), valid)
    x = Inputs((B, T, HQ, H, D, D, BS), "float32")
    run = jax.jit(lambda cu: _ops(x, cu))
    _assert_equal(run(jnp.asarray(bad, jnp.int32)), run(jnp.asarray(valid, jnp.int32)))


def test_cu_seqlens_as_a_list_tuple_or_array():
    x = Inputs((B, T, HQ, H, D, D, BS), "float32")
    g = x.gates[0][0]
    run = lambda cu: nsa.attention(x.q, x.k, x.v, g_cmp=g, block_counts=3, block_size=BS, window_size=7,
                                   cu_seqlens=cu)
    want = run(np.array([0, 30, 30, 100], np.int32))
    for cu in ([0, 30, 30, 100], (0, 30, 30, 100)):
        np.testing.assert_array_equal(np.asarray(run(cu)), np.asarray(want))


@pytest.mark.parametrize("name", ["compressed", "select"])
def test_traced_cu_seqlens_asking_for_more_compressed_rows_than_given(interpreted, name):
    """Under jit a cu_seqlens may ask for more rows of a given k_cmp than it holds (a traced cu_seqlens' k_cmp
    holds at least the ceil(T / block_size) rows of one sequence): rows past its end count as not there, in the
    reference and in the kernels (which never read past it)."""
    x = Inputs((B, T, HQ, H, D, D, BS), "float32")
    cu = np.array([0, 20, 40, 60, 80, 100], np.int32)  # 2 compressed rows per sequence, 10 in all; k_cmp holds 7,
    # so the last sequence's row 0 (which its tokens 15 to 19 see) is past its end
    k_cmp, v_cmp = x.k[:, :T:BS], x.v[:, :T:BS]

    def run(impl):
        if name == "compressed":
            f = lambda q, kc, vc, cu: nsa.compressed_attention(q, kc, vc, block_size=BS, cu_seqlens=cu,
                                                               implementation=impl)
            out, vjp = jax.vjp(lambda q, kc, vc: jax.jit(f)(q, kc, vc, cu), x.q, k_cmp, v_cmp)
            dlse = jnp.where(jnp.isfinite(out[1]), 1.0, 0.0)
            return out + vjp((x.do, dlse))
        f = lambda q, kc, cu: nsa.select_blocks(q, kc, block_counts=4, block_size=BS, cu_seqlens=cu,
                                                implementation=impl)
        return (jax.jit(f)(x.q, k_cmp, cu),)

    got, want = run("triton"), run("xla")
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------------------- integer scalars

@pytest.mark.parametrize("wrap", [np.int64, np.int32, jnp.int32, np.array, jnp.array],
                         ids=["np.int64", "np.int32", "jnp.int32", "np.array", "jnp.array"])
def test_any_integer_scalar_where_an_int_goes(wrap):
    x = Inputs((B, T, HQ, H, D, D, BS), "float32")
    g = x.gates[0][0]
    run = lambda c, bs, w: nsa.attention(x.q, x.k, x.v, g_cmp=g, block_counts=c, block_size=bs, window_size=w)
    np.testing.assert_array_equal(np.asarray(run(wrap(2), wrap(BS), wrap(7))), np.asarray(run(2, BS, 7)))
    k_cmp = nsa.compress(x.k, block_size=wrap(BS))
    np.testing.assert_array_equal(np.asarray(nsa.select_blocks(x.q, k_cmp, block_counts=wrap(3), block_size=wrap(BS))),
                                  np.asarray(nsa.select_blocks(x.q, k_cmp, block_counts=3, block_size=BS)))


def test_traced_scalar_block_counts_in_selected_attention():
    x = Inputs((B, T, HQ, H, D, D, BS), "float32")
    idx = x.block_indices(4)
    f = lambda c: nsa.selected_attention(x.q, x.k, x.v, idx, block_counts=c, block_size=BS)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(jnp.int32(2))), np.asarray(f(2)))
    with pytest.raises(ValueError, match="block_counts is a traced array and block_indices is None"):
        jax.jit(lambda c: nsa.attention(x.q, x.k, x.v, block_counts=c, block_size=BS))(jnp.int32(2))


# ------------------------------------------------------------------- block_counts above the number of blocks

def test_block_counts_above_the_blocks_select_them_all_at_no_more_cost():
    """A block_counts above the blocks of the longest sequence (T = 100 in blocks of 16: 7; a cache of 128 tokens:
    8) runs the very program of that number of blocks (the slots are capped, so neither the time nor the memory
    grows with it: 10**5 slots on 4 blocks once took 38 s and 1.8 GB), in every op, over a KV cache, and as a
    per-query array; selected_attention caps it at the slots of block_indices."""
    x = Inputs((B, T, HQ, H, D, D, BS), "float32")
    g = x.gates[0][0]
    k_cmp = nsa.compress(x.k, block_size=BS)
    program = lambda f, *args: str(jax.make_jaxpr(f)(*args))
    select = lambda c: lambda q: nsa.select_blocks(q, k_cmp, block_counts=c, block_size=BS)
    assert program(select(1000), x.q) == program(select(7), x.q)
    assert nsa.select_blocks(x.q, k_cmp, block_counts=1000, block_size=BS).shape == (B, T, H, 7)
    attend = lambda c: lambda q: nsa.attention(q, x.k, x.v, g_cmp=g, block_counts=c, block_size=BS, window_size=7)
    assert program(attend(1000), x.q) == program(attend(7), x.q)
    cache = nsa.prefill_cache(x.k[:, :-1], x.v[:, :-1], block_size=BS, capacity=128)
    cache = nsa.append_to_cache(cache, x.k[:, -1:], x.v[:, -1:])
    step = lambda c: lambda q: nsa.attention(q, cache=cache, g_cmp=g[:, -1:], block_counts=c, window_size=7)
    assert program(step(1000), x.q[:, -1:]) == program(step(8), x.q[:, -1:])
    per_query = np.full((B, T, H), 1000, np.int32)
    np.testing.assert_array_equal(np.asarray(attend(per_query)(x.q)), np.asarray(attend(7)(x.q)))
    idx = x.block_indices(3)
    selected = lambda c: nsa.selected_attention(x.q, x.k, x.v, idx, block_counts=c, block_size=BS)
    np.testing.assert_array_equal(np.asarray(selected(2 ** 40)), np.asarray(selected(None)))
    np.testing.assert_array_equal(np.asarray(jax.jit(selected)(jnp.full((B, T, H), 2 ** 20, jnp.int32))),
                                  np.asarray(selected(None)))


# ----------------------------------------------------------------------------- the compression's blocks

@pytest.mark.parametrize("block_size, compress_block_size, stride", [(16, 32, 16), (32, 16, 16), (16, 16, 16),
                                                                      (32, 48, 16)])
def test_compress_stride_defaults_to_the_largest_stride_of_both_blocks(block_size, compress_block_size, stride):
    """Without compress_stride, d = gcd(l, l'): the largest stride that divides the window l and the selection block
    l', as it must; windows that do not overlap wherever l divides l'. So a call without it never raises (block_size=16,
    compress_block_size=32 once raised about a compress_stride = 32 the user never passed), and the op and a cache
    resolve it alike."""
    x = Inputs((B, T, HQ, H, D, D, block_size), "float32")
    g = x.gates[0][0]
    run = lambda **blocks: nsa.attention(x.q, x.k, x.v, g_cmp=g, block_counts=3, block_size=block_size,
                                         compress_block_size=compress_block_size, **blocks)
    np.testing.assert_array_equal(np.asarray(run()), np.asarray(run(compress_stride=stride)))
    cache = nsa.empty_cache(B, 64, H, D, block_size=block_size, compress_block_size=compress_block_size)
    assert (cache.compress_block_size, cache.compress_stride) == (compress_block_size, stride)


# ---------------------------------------------------------------------------------- a learned scale

def _loss_of_scale(x, name):
    def loss(scale):
        kw = dict(scale=scale)
        if name == "compressed":
            kc, vc = nsa.compress(x.k, block_size=BS), nsa.compress(x.v, block_size=BS)
            o, lse = nsa.compressed_attention(x.q, kc, vc, block_size=BS, **kw)
            return jnp.sum(o * x.do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        if name == "selected":
            o = nsa.selected_attention(x.q, x.k, x.v, x.block_indices(3), block_size=BS, **kw)
        elif name == "window":
            o = nsa.sliding_window_attention(x.q, x.k, x.v, window_size=7, **kw)
        else:
            g = [gi[0] for gi in x.gates]
            o = nsa.attention(x.q, x.k, x.v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], block_counts=3, block_size=BS,
                              window_size=7, **kw)
        return jnp.sum(o * x.do)

    return loss


@pytest.mark.parametrize("name", ["compressed", "selected", "window", "attention"])
def test_traced_scale_is_differentiable(name):
    """A traced scale (a learned temperature) gives the float scale's result, and its gradient matches a
    central difference (float64)."""
    with jax.enable_x64(True):
        x = Inputs((B, 60, HQ, H, D, D, BS), "float64")
        loss = _loss_of_scale(x, name)
        np.testing.assert_allclose(float(jax.jit(loss)(jnp.float64(0.3))), float(loss(0.3)), rtol=1e-12)
        grad = float(jax.jit(jax.grad(loss))(jnp.float64(0.3)))
        h = 1e-5
        numeric = (float(loss(0.3 + h)) - float(loss(0.3 - h))) / (2 * h)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6)


def test_traced_scale_in_select_blocks():
    x = Inputs((B, T, HQ, H, D, D, BS), "float32")
    k_cmp = nsa.compress(x.k, block_size=BS)
    f = lambda s: nsa.select_blocks(x.q, k_cmp, block_counts=3, block_size=BS, scale=s)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(jnp.float32(0.5))), np.asarray(f(0.5)))


# ------------------------------------------------------------------------------------- empty inputs

@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("batch, seq_len", [(0, 40), (1, 0)], ids=["B=0", "T=0"])
def test_empty_inputs(interpreted, impl, batch, seq_len):
    """No tokens: every op returns empty outputs of the right shapes and zero gradients."""
    x = Inputs((batch, seq_len, HQ, H, D, 8, BS), "float32")
    g = [gi[0] for gi in x.gates]

    def loss(q, k, v, *gates):
        o = nsa.attention(q, k, v, g_cmp=gates[0], g_slc=gates[1], g_swa=gates[2], block_counts=3, block_size=BS,
                          window_size=7, implementation=impl)
        assert o.shape == (batch, seq_len, HQ, 8)
        return jnp.sum(o)

    grads = jax.grad(loss, argnums=tuple(range(6)))(x.q, x.k, x.v, *g)
    for grad, arg in zip(grads, (x.q, x.k, x.v, *g)):
        assert grad.shape == arg.shape and not np.any(np.asarray(grad))
    k_cmp = nsa.compress(x.k, block_size=BS)
    assert k_cmp.shape == (batch, -(-seq_len // BS), H, D)
    assert nsa.select_blocks(x.q, k_cmp, block_counts=3, block_size=BS, implementation=impl).shape == (
        batch, seq_len, H, min(3, k_cmp.shape[1]))  # the slots capped at the blocks of T tokens


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_no_visible_compressed_row(interpreted, impl):
    """T < block_size: k_cmp's one row is a partial block, which no query sees: compressed attention sees
    nothing, and the selection still holds the query's own block 0."""
    x = Inputs((B, 10, HQ, H, D, D, BS), "float32")
    k_cmp, v_cmp = nsa.compress(x.k, block_size=BS), nsa.compress(x.v, block_size=BS)
    (o, lse), vjp = jax.vjp(lambda q: nsa.compressed_attention(q, k_cmp, v_cmp, block_size=BS,
                                                               implementation=impl), x.q)
    assert not np.any(np.asarray(o)) and np.all(np.isneginf(np.asarray(lse)))
    assert not np.any(np.asarray(vjp((x.do, jnp.ones_like(lse)))[0]))
    idx = nsa.select_blocks(x.q, k_cmp, block_counts=2, block_size=BS, implementation=impl)
    np.testing.assert_array_equal(np.asarray(idx), np.zeros((B, 10, H, 1)))  # 2 slots capped at the one block


# --------------------------------------------------------------------------- which implementation runs

def test_explicit_triton_without_jax_triton_raises(without_jax_triton):
    x = Inputs((B, 20, HQ, H, D, D, BS), "float32")
    with pytest.raises(ValueError, match=r"implementation='triton' cannot run sliding_window_attention here: "
                                         r"jax-triton does not import \((ModuleNotFound|Import)Error.*pip install '\.\[cuda\]'"):
        nsa.sliding_window_attention(x.q, x.k, x.v, window_size=3, implementation="triton")


def test_default_on_a_gpu_without_jax_triton_warns_once(without_jax_triton, monkeypatch):
    monkeypatch.setattr(_platform, "has_cuda_gpu", lambda: True)
    monkeypatch.setattr(_dispatch, "_warned", set())
    x = Inputs((B, 20, HQ, H, D, D, BS), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = nsa.attention(x.q, x.k, x.v, block_counts=2, block_size=BS, window_size=5)
        nsa.attention(x.q, x.k, x.v, block_counts=2, block_size=BS, window_size=5)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "XLA reference on the GPU" in messages[0] and "pip install '.[cuda]'" in messages[0]
    want = nsa.attention(x.q, x.k, x.v, block_counts=2, block_size=BS, window_size=5, implementation="xla")
    np.testing.assert_array_equal(np.asarray(o), np.asarray(want))
    assert set(nsa.implementations("gpu", dtype=jnp.float32).values()) == {"xla"}
    # 16-bit inputs run the Mosaic GPU kernels where jax lowers them (tests/test_pallas_gpu_export.py)
    mosaic = pallas.gpu_unavailable("selected", 0, jnp.bfloat16) is None
    assert nsa.implementations("gpu")["selected_attention"] == ("pallas" if mosaic else "xla")


def test_no_warning_without_a_gpu(without_jax_triton, monkeypatch):
    monkeypatch.setattr(_dispatch, "_warned", set())
    x = Inputs((B, 20, HQ, H, D, D, BS), "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        nsa.attention(x.q, x.k, x.v, block_counts=2, block_size=BS, window_size=5)


def test_explicit_triton_on_float64_raises(interpreted):
    with jax.enable_x64(True):
        x = Inputs((B, 20, HQ, H, D, D, BS), "float64")
        with pytest.raises(TypeError, match=r"implementation='triton' cannot run selected_attention on float64 "
                                            r"inputs: its kernels take float32, bfloat16, float16"):
            nsa.selected_attention(x.q, x.k, x.v, x.block_indices(2), block_size=BS, implementation="triton")
        # implementation=None runs the reference for float64
        o = nsa.selected_attention(x.q, x.k, x.v, x.block_indices(2), block_size=BS)
        assert o.dtype == jnp.float64


def test_implementations_tells_what_runs_where(interpreted):
    """nsa.implementations() with jax_triton importable (as the interpreted fixture makes it): on CUDA, select on
    the Mosaic GPU kernels where this jax lowers them (measured faster on the H200), every other op on Triton."""
    kernels = {"compress": "xla", "compressed_attention": "triton", "selected_attention": "triton",
               "select_blocks": "pallas" if MOSAIC_GPU_LOWERS else "triton", "sliding_window_attention": "triton"}
    assert nsa.implementations("gpu") == nsa.implementations("cuda") == kernels
    assert nsa.implementations("cuda", dtype=jnp.float32)["select_blocks"] == "triton"  # Mosaic GPU: 16-bit only
    assert set(nsa.implementations("cuda", dtype=jnp.float64).values()) == {"xla"}
    assert set(nsa.implementations("cpu").values()) == {"xla"}
    assert set(nsa.implementations().values()) == {"xla"}  # the CPU is the default backend here
    on_tpu = {name: "xla" if family == "xla" else "pallas" for name, family in kernels.items()}
    assert nsa.implementations("tpu") == on_tpu
    assert set(nsa.implementations("tpu", dtype=jnp.float64).values()) == {"xla"}


def test_implementations_of_an_unknown_platform_raises():
    with pytest.raises(ValueError, match=r"platform must be one of 'cpu', 'cuda', 'rocm', 'tpu', 'gpu' or None "
                                         r"\(jax's default backend\), got 'bogus'"):
        nsa.implementations("bogus")


def _sharded(fn):
    """fn inside shard_map, the batch split over a mesh of one local device."""
    mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("b",))
    spec = jax.sharding.PartitionSpec("b")
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)


def _gradient(fn, checkpoint=False):
    loss = lambda *args: jnp.sum(fn(*args) ** 2)
    return jax.grad(jax.checkpoint(loss) if checkpoint else loss, argnums=(0, 1, 2, 3))


# How the platform switch of implementation=None (nsa._platform.platform_dependent) is run: transformations of
# fn(q, k, v, g), each giving a function of the same arguments.
TRANSFORMS = {
    "eager": lambda fn: fn,
    "jit": jax.jit,
    "vmap": lambda fn: jax.jit(lambda *args: jax.vmap(fn)(*(x[:, None] for x in args))[:, 0]),
    "scan": lambda fn: jax.jit(lambda *args: jax.lax.scan(lambda c, xs: (c, fn(*(x[None] for x in xs))[0]), 0,
                                                          args)[1]),  # a loop over the batch
    "shard_map": lambda fn: jax.jit(_sharded(fn)),
    "eager shard_map": _sharded,
    "grad": lambda fn: jax.jit(_gradient(fn)),
    "grad of checkpoint": lambda fn: jax.jit(_gradient(fn, checkpoint=True)),
    "grad of vmap": lambda fn: jax.jit(_gradient(lambda *args: jax.vmap(fn)(*(x[:, None] for x in args))[:, 0])),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_default_dispatch_under_transformations(transform):
    """implementation=None (the reference on the CPU, through nsa's platform switch) under each transformation
    gives implementation="xla"'s result."""
    x = Inputs((2, 40, HQ, H, D, D, 8), "float32")
    args = (x.q, x.k, x.v, x.gates[0][0])

    def f(implementation):
        return lambda q, k, v, g: nsa.attention(q, k, v, g_cmp=g, g_slc=g, g_swa=g, block_counts=3, block_size=8,
                                                window_size=9, implementation=implementation)

    got, want = (TRANSFORMS[transform](f(implementation))(*args) for implementation in (None, "xla"))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert_close(a, b, 1e-6, transform)


def test_forward_mode_is_the_vjp_transposed():
    """jax.jvp of an op raises (a custom_vjp: forward mode would cost reverse mode 11x its memory, see
    nsa._dispatch); with implementation="xla" a JVP is the VJP transposed (jax.linear_transpose), the documented
    way, and matches a central difference (float64)."""
    with jax.enable_x64(True):
        x, t = Inputs((1, 40, HQ, H, D, D, 8), "float64"), Inputs((1, 40, HQ, H, D, D, 8), "float64", seed=1)
        primals, tangents = (x.q, x.k, x.v, x.gates[0][0]), (t.q, t.k, t.v, t.gates[0][0])
        f = lambda q, k, v, g: nsa.attention(q, k, v, g_cmp=g, g_slc=g, g_swa=g, block_counts=3, block_size=8,
                                             window_size=9, implementation="xla")
        with pytest.raises(TypeError, match=r"nsa's ops have no forward-mode derivative \(jax.jvp, jax.jacfwd, "
                                            r"jax.hessian\): each is a custom_vjp, reverse mode only"):
            jax.jvp(f, primals, tangents)
        out, vjp = jax.vjp(f, *primals)
        (jvp,) = jax.linear_transpose(vjp, out)(tangents)
        h = 1e-6
        shifted = lambda sign: f(*(p + sign * h * d for p, d in zip(primals, tangents)))
        assert_close(jvp, (shifted(1) - shifted(-1)) / (2 * h), 1e-6, "jvp")


def test_the_backward_keeps_no_float32_copy_of_the_branch_outputs(capsys):
    """The gated sum of the branches computes in float32, but what nsa.attention's backward keeps of it is each
    branch's output in its own dtype (the gate's gradient converts it again): no float32 [B, T, HQ, Dv] residual
    (three of them, 6 GiB at 64k tokens, before `api._gated_sum`)."""
    x = Inputs((1, 64, HQ, H, D, D, 8), "bfloat16")
    f = lambda q, k, v, g: nsa.attention(q, k, v, g_cmp=g, g_slc=g, g_swa=g, block_counts=2, block_size=8,
                                         window_size=9, implementation="xla").astype(jnp.float32).sum()
    jax.ad_checkpoint.print_saved_residuals(f, x.q, x.k, x.v, x.gates[0][0])
    residuals = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"bf16[1,64,{HQ},{D}]") for line in residuals), residuals  # the outputs, kept
    assert not any(line.startswith(f"f32[1,64,{HQ},{D}]") for line in residuals), residuals


def test_gradient_scales_are_never_zero_where_the_gradient_is():
    """The test base's natural sizes: a window of 1 makes dq and dk exactly 0, yet their sizes are not."""
    x = Inputs((B, 30, HQ, H, D, D, BS), "float32")
    f = lambda q, k, v: nsa.sliding_window_attention(q, k, v, window_size=1, implementation="xla")
    _, vjp = jax.vjp(f, x.q, x.k, x.v)
    dq, dk, dv = vjp(x.do)
    sizes = gradient_scales(x.q, x.k, x.v, x.do, D ** -0.5)
    assert all(s > 0.1 for s in sizes)
    assert_close(dq, np.zeros(dq.shape), 1e-6, "dq", sizes[0])  # roundoff against a natural size
    assert_close(dv, np.asarray(x.do).reshape(B, 30, H, HQ // H, D).sum(3), 1e-6, "dv", sizes[2])


class TestJitAndEager(chex.TestCase):
    """nsa.attention gives the oracle's output called eagerly and jitted (chex.variants), on the reference and
    on the Pallas kernels (interpret mode here)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("xla", "pallas")
    def test_attention(self, implementation):
        x = Inputs((1, 40, 6, 2, 16, 8, 8), "float32")  # G = 3, Dv != Dk
        g = [gi[0] for gi in x.gates]
        kw = dict(block_counts=3, block_size=8, window_size=9)
        f = self.variant(lambda q, k, v, *g: nsa.attention(q, k, v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], **kw,
                                                           implementation=implementation))
        g64 = [gi[1] for gi in x.gates]
        ref = oracle.attention(x.q64, x.k64, x.v64, g_cmp=g64[0], g_slc=g64[1], g_swa=g64[2], **kw)
        assert_close(f(x.q, x.k, x.v, *g), ref, TOLERANCE["float32"], "o")


@pytest.mark.parametrize("name", [name for name in nsa.__all__ if not isinstance(getattr(nsa, name), type)])
def test_every_public_function_is_annotated(name):
    """The public functions carry type annotations: every argument and the result (shapes stay in docstrings)."""
    fn = getattr(nsa, name)
    signature = inspect.signature(fn)
    unannotated = [p.name for p in signature.parameters.values() if p.annotation is inspect.Parameter.empty]
    assert not unannotated and signature.return_annotation is not inspect.Signature.empty, (name, unannotated)
    typing.get_type_hints(fn)  # every annotation resolves
