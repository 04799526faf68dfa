"""Context parallelism (nsa.context, attention(..., context_axis=...)): one sequence split over meshes of 2, 4 and 8
CPU devices (tests/conftest.py makes 8) inside jax.shard_map, against the single-device ops on the whole inputs:
outputs and gradients, both layouts, G = 1 / 3 / 16, the paper's compression, a learned k_cmp / v_cmp, given
blocks; the layout helpers; the errors; the backward gathering k and v again instead of keeping them; the
interpreted kernels; and a step exported for TPU."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import nsa
from nsa import context
from tests.base import GRAD_TOLERANCE, TOLERANCE, Inputs, assert_close, gradient_scales

SEQ = PartitionSpec(None, "sp")  # [B, T, ...] split along T


def _mesh(P):
    return Mesh(np.array(jax.devices()[:P]), ("sp",))


def _sharded(f, P, layout, n):
    """f of n arrays [B, T, ...] run with the sequence split over P devices in `layout`: a function of the whole
    arrays in sequence order, giving the whole output in sequence order."""
    mesh_f = jax.shard_map(f, mesh=_mesh(P), in_specs=(SEQ,) * n, out_specs=SEQ)

    def whole(*arrays):
        out = mesh_f(*(context.to_context_layout(x, P, layout) for x in arrays))
        return context.from_context_layout(out, P, layout)

    return whole


# (P, layout, (B, T, HQ, H, Dk, Dv, block_size), extra attention arguments)
CASES = {
    "P2-zigzag-G3": (2, "zigzag", (2, 128, 6, 2, 16, 8, 16), {}),
    "P4-contiguous-G16": (4, "contiguous", (1, 128, 16, 1, 8, 8, 16), {}),
    "P8-zigzag-G1": (8, "zigzag", (1, 256, 2, 2, 16, 16, 16), {}),
    "P4-zigzag-paper": (4, "zigzag", (1, 256, 4, 2, 16, 16, 32), dict(compress_block_size=16, compress_stride=8)),
    "P8-contiguous-window-spans-shards": (8, "contiguous", (2, 128, 4, 2, 8, 8, 8), dict(window_size=40)),
}


@pytest.mark.parametrize("P, layout, shape, extra", CASES.values(), ids=CASES.keys())
def test_attention_equals_the_single_device_ops(P, layout, shape, extra):
    """Every branch and gate, forward and backward (q, k, v and the three gates), on the XLA reference: the
    sharded step equals nsa.attention on the whole sequence (within float32's tolerance: the reduce-scatter of dk
    and dv sums in another order)."""
    x = Inputs(shape, "float32", seed=P)
    kw = dict(dict(block_counts=3, block_size=x.block_size, window_size=24, implementation="xla"), **extra)
    names = ("g_cmp", "g_slc", "g_swa")
    local = lambda q, k, v, *g: nsa.attention(q, k, v, **dict(zip(names, g)), context_axis="sp",
                                              context_layout=layout, **kw)
    single = lambda q, k, v, *g: nsa.attention(q, k, v, **dict(zip(names, g)), **kw)
    args = (x.q, x.k, x.v, *(g[0] for g in x.gates))
    sharded = _sharded(local, P, layout, 6)
    assert_close(jax.jit(sharded)(*args), jax.jit(single)(*args), TOLERANCE["float32"], "o")
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * x.do), argnums=tuple(range(6))))(*args)
    scales = gradient_scales(x.q64, x.k64, x.v64, x.do64, x.q.shape[-1] ** -0.5, num_gates=3)
    for got, want, what, s in zip(grad(sharded), grad(single), ("dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"),
                                  scales):
        assert_close(got, want, GRAD_TOLERANCE["float32"], what, s)


def test_the_natural_call_needs_no_layout():
    """q, k, v and the gates sharded along T in their natural order and no context_layout given, the call one
    writes first: each device gets its rows of the unsharded attention (and of each branch op). Issue 51: with
    "zigzag" the default, the output of this call was 1.93 off, and nothing could detect it."""
    P, x = 4, Inputs((1, 128, 4, 2, 16, 16, 16), "float32", seed=11)
    k_cmp, v_cmp = (nsa.compress(y, block_size=16) for y in (x.k, x.v))
    indices = nsa.select_blocks(x.q, k_cmp, block_counts=3, block_size=16)
    ops = {  # name: (op, its arguments [B, T or T / 16, ...])
        "attention": (lambda q, k, v, g, **c: nsa.attention(q, k, v, g_cmp=g, block_counts=3, block_size=16,
                                                            window_size=24, **c), (x.q, x.k, x.v, x.gates[0][0])),
        "compressed_attention": (lambda q, kc, vc, **c: nsa.compressed_attention(q, kc, vc, block_size=16, **c)[0],
                                 (x.q, k_cmp, v_cmp)),
        "select_blocks": (lambda q, kc, **c: nsa.select_blocks(q, kc, block_counts=3, block_size=16, **c),
                          (x.q, k_cmp)),
        "selected_attention": (lambda q, k, v, i, **c: nsa.selected_attention(q, k, v, i, block_size=16, **c),
                               (x.q, x.k, x.v, indices)),
        "sliding_window_attention": (lambda q, k, v, **c: nsa.sliding_window_attention(q, k, v, window_size=24, **c),
                                     (x.q, x.k, x.v)),
    }
    for name, (op, args) in ops.items():
        local = jax.shard_map(functools.partial(op, context_axis="sp"), mesh=_mesh(P), in_specs=(SEQ,) * len(args),
                              out_specs=SEQ)
        got, want = jax.jit(local)(*args), jax.jit(op)(*args)
        if name == "select_blocks":
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        else:
            assert_close(got, want, TOLERANCE["float32"], name)


@pytest.mark.parametrize("layout", context.LAYOUTS)
def test_a_learned_compression_and_given_blocks(layout):
    """k_cmp, v_cmp given (overlapping windows, l = 16, d = 8: each device's compressed rows, sharded like q),
    block_indices and per-query block_counts given, sharded like q: output and gradients, k_cmp's and v_cmp's
    among them, equal the single-device call's."""
    P, (B, T, HQ, H, D, bs) = 4, (1, 128, 4, 2, 16, 16)
    x = Inputs((B, T, HQ, H, D, D, bs), "float32", seed=7)
    rng = np.random.default_rng(8)
    k_cmp, v_cmp = (jnp.asarray(rng.standard_normal((B, T // 8, H, D)), jnp.float32) for _ in range(2))
    indices = jnp.asarray(rng.integers(-1, T // bs, (B, T, H, 3)), jnp.int32)
    counts = jnp.asarray(rng.integers(0, 4, (B, T, H)), jnp.int32)
    g = [gi[0] for gi in x.gates]
    kw = dict(block_size=bs, compress_block_size=16, compress_stride=8, window_size=20, implementation="xla")

    def call(q, k, v, k_cmp, v_cmp, indices, counts, a, b, c, **more):
        return nsa.attention(q, k, v, k_cmp=k_cmp, v_cmp=v_cmp, block_indices=indices, block_counts=counts,
                             g_cmp=a, g_slc=b, g_swa=c, **kw, **more)

    # the compressed rows, blocks and counts are split along their axis 1 as the tokens are: to_context_layout
    # cuts them into the same 2P (or P) chunks
    sharded = _sharded(functools.partial(call, context_axis="sp", context_layout=layout), P, layout, 10)
    args = (x.q, x.k, x.v, k_cmp, v_cmp, indices, counts, *g)
    assert_close(jax.jit(sharded)(*args), jax.jit(call)(*args), TOLERANCE["float32"], "o")
    wrt = (0, 1, 2, 3, 4, 7)
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * x.do), argnums=wrt))(*args)
    for got, want, what in zip(grad(sharded), grad(call), ("dq", "dk", "dv", "dk_cmp", "dv_cmp", "dg_cmp")):
        assert_close(got, want, GRAD_TOLERANCE["float32"], what, 1e-2)


def _joined(o, lse):
    """compressed_attention's o [B, T, HQ, Dv] and lse [B, T, HQ] as one array [B, T, HQ, Dv + 1]."""
    return jnp.concatenate([o, lse[..., None]], -1)


@pytest.mark.parametrize("layout", context.LAYOUTS)
def test_each_branch_op_takes_the_context_axis(layout):
    """compressed_attention (o and lse), select_blocks (the same ids), selected_attention (per-query counts) and
    sliding_window_attention with context_axis over 4 devices equal each op on the whole sequence; so do the
    gradients of the attention ops."""
    P, (B, T, HQ, H, D, bs) = 4, (2, 128, 4, 2, 16, 8)
    x = Inputs((B, T, HQ, H, D, D, bs), "float32", seed=9)
    k_cmp, v_cmp = (nsa.compress(y, block_size=bs) for y in (x.k, x.v))
    rng = np.random.default_rng(10)
    indices = jnp.asarray(rng.integers(-1, T // bs, (B, T, H, 3)), jnp.int32)
    counts = jnp.asarray(rng.integers(0, 4, (B, T, H)), jnp.int32)
    ops = {  # name: (op of arrays [B, T or T / bs, ...], the arguments, those differentiated)
        "compressed_attention": (lambda q, kc, vc, **c: _joined(*nsa.compressed_attention(q, kc, vc, block_size=bs,
                                                                                           **c)),
                                 (x.q, k_cmp, v_cmp), (0, 1, 2)),
        "select_blocks": (lambda q, kc, **c: nsa.select_blocks(q, kc, block_counts=3, block_size=bs, **c),
                          (x.q, k_cmp), ()),
        "selected_attention": (lambda q, k, v, i, n, **c: nsa.selected_attention(q, k, v, i, block_counts=n,
                                                                                  block_size=bs, **c),
                               (x.q, x.k, x.v, indices, counts), (0, 1, 2)),
        "sliding_window_attention": (lambda q, k, v, **c: nsa.sliding_window_attention(q, k, v, window_size=20, **c),
                                     (x.q, x.k, x.v), (0, 1, 2)),
    }
    for name, (op, args, wrt) in ops.items():
        sharded = _sharded(functools.partial(op, context_axis="sp", context_layout=layout), P, layout, len(args))
        got, want = jax.jit(sharded)(*args), jax.jit(op)(*args)
        if name == "select_blocks":
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            continue
        finite = np.isfinite(np.asarray(want))  # lse: -inf where a query sees no compressed row
        np.testing.assert_array_equal(np.isfinite(np.asarray(got)), finite)
        assert_close(np.asarray(got)[finite], np.asarray(want)[finite], TOLERANCE["float32"], name)
        first = lambda f: lambda *a: f(*a)[..., :D]  # o
        grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(first(f)(*a) * x.do), argnums=wrt))(*args)
        for i, (g_got, g_want) in enumerate(zip(grad(sharded), grad(op))):
            assert_close(g_got, g_want, GRAD_TOLERANCE["float32"], f"{name} d{i}", 1e-2)


# packings of the whole sequence (B = 1), each crossing shard boundaries: (P, layout, T, cu_seqlens)
PACKED = {
    "P4-zigzag": (4, "zigzag", 128, [0, 5, 37, 38, 90, 128]),  # chunks of 16: sequences span up to 4 of them
    "P2-contiguous-empty": (2, "contiguous", 64, [0, 0, 29, 29, 64]),  # empty sequences; one spans both devices
}


@pytest.mark.parametrize("P, layout, T, cu", PACKED.values(), ids=PACKED.keys())
def test_packed_sequences_across_shards(P, layout, T, cu):
    """cu_seqlens over the whole sequence (the same on every device; here a traced one under jit): attention with
    every branch and gate, and selected_attention and sliding_window_attention, equal the single-device packed
    call, output and gradients of q, k, v and the gates."""
    x = Inputs((1, T, 4, 2, 16, 16, 8), "float32", seed=P + 20)
    cu = jnp.asarray(cu, jnp.int32)
    kw = dict(block_counts=3, block_size=8, window_size=12, implementation="xla")
    names = ("g_cmp", "g_slc", "g_swa")
    rng = np.random.default_rng(P)
    indices = jnp.asarray(rng.integers(-1, T // 8, (1, T, 2, 3)), jnp.int32)
    ops = {  # name: (op of (arrays [1, T, ...], cu_seqlens, **context), its arrays, names of their gradients)
        "attention": (lambda q, k, v, a, b, c, cu_seqlens, **more: nsa.attention(
            q, k, v, **dict(zip(names, (a, b, c))), cu_seqlens=cu_seqlens, **kw, **more),
            (x.q, x.k, x.v, *(g[0] for g in x.gates)), ("dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa")),
        "selected_attention": (lambda q, k, v, i, cu_seqlens, **more: nsa.selected_attention(
            q, k, v, i, block_size=8, cu_seqlens=cu_seqlens, implementation="xla", **more),
            (x.q, x.k, x.v, indices), ("dq", "dk", "dv")),
        "sliding_window_attention": (lambda q, k, v, cu_seqlens, **more: nsa.sliding_window_attention(
            q, k, v, window_size=20, cu_seqlens=cu_seqlens, implementation="xla", **more),
            (x.q, x.k, x.v), ("dq", "dk", "dv")),
    }
    for name, (op, args, wrt) in ops.items():
        n = len(args)
        local = jax.shard_map(lambda *a: op(*a[:n], a[n], context_axis="sp", context_layout=layout), mesh=_mesh(P),
                              in_specs=(SEQ,) * n + (PartitionSpec(),), out_specs=SEQ)
        sharded = lambda *a: context.from_context_layout(
            local(*(context.to_context_layout(y, P, layout) for y in a[:n]), a[n]), P, layout)
        assert_close(jax.jit(sharded)(*args, cu), jax.jit(op)(*args, cu), TOLERANCE["float32"], f"{name} o")
        grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * x.do), argnums=tuple(range(len(wrt)))))(*args, cu)
        for got, want, what in zip(grad(sharded), grad(op), wrt):
            assert_close(got, want, GRAD_TOLERANCE["float32"], f"{name} {what}", 1e-2)


def test_layout_helpers():
    """Zig-zag: device r holds chunks r and 2P - 1 - r (of 2P); contiguous (the default): its T / P tokens in
    order; from_context_layout undoes to_context_layout; context_positions is where each row came from."""
    T, P = 16, 4
    x = jnp.arange(2 * T).reshape(2, T) * 10
    zig = context.to_context_layout(x, P, "zigzag")
    np.testing.assert_array_equal(context.context_positions(T, P, "zigzag"), [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10,
                                                                              11, 6, 7, 8, 9])
    np.testing.assert_array_equal(zig, x[:, context.context_positions(T, P, "zigzag")])
    np.testing.assert_array_equal(context.from_context_layout(zig, P, "zigzag"), x)
    np.testing.assert_array_equal(context.context_positions(T, P), np.arange(T))
    np.testing.assert_array_equal(context.to_context_layout(x, P), x)
    np.testing.assert_array_equal(context.from_context_layout(x, P), x)
    y = jnp.arange(3 * T * 2).reshape(3, 2, T)
    np.testing.assert_array_equal(context.from_context_layout(context.to_context_layout(y, P, "zigzag", axis=2), P,
                                                              "zigzag", axis=2), y)


def test_errors_name_the_argument():
    x = Inputs((1, 24, 4, 2, 8, 8, 8), "float32")
    with pytest.raises(ValueError, match=r"x.shape\[1\] = 24 tokens must split into 16 equal chunks \(the 'zigzag' "
                                         r"layout over P = 8 devices\)"):
        context.to_context_layout(x.q, 8, "zigzag")
    with pytest.raises(ValueError, match=r"context_layout must be one of \('zigzag', 'contiguous'\), got 'ring'"):
        context.context_positions(16, 2, "ring")

    def run(f, n=3, P=2, *arrays):
        return jax.shard_map(f, mesh=_mesh(P), in_specs=(SEQ,) * n, out_specs=SEQ)(*(arrays or (x.q, x.k, x.v)))

    with pytest.raises(ValueError, match=r"the sequence of P \* T = 8 \* 3 = 24 tokens must split into 16 equal "
                                         r"chunks"):
        run(lambda q, k, v: nsa.attention(q, k, v, block_size=8, context_axis="sp", context_layout="zigzag"), P=8)
    with pytest.raises(ValueError, match=r"context_axis .* cannot be given with kv_lens \(not supported yet\)"):
        run(lambda q, k, v: nsa.attention(q, k, v, block_size=8, kv_lens=[12], context_axis="sp"))
    with pytest.raises(ValueError, match=r"with context_axis, cu_seqlens packs the whole sequence of P \* T = 24 "
                                         r"tokens \(T: the local rows\) and must end there, got cu_seqlens\[-1\] = 12"):
        run(lambda q, k, v: nsa.attention(q, k, v, block_size=8, cu_seqlens=[0, 5, 12], context_axis="sp"))
    with pytest.raises(ValueError, match=r"with context_axis and cu_seqlens, k_cmp and v_cmp cannot be given"):
        run(lambda q, k, v: nsa.compressed_attention(q, k, v, block_size=4, cu_seqlens=[0, 5, 24],
                                                     context_axis="sp"))
    with pytest.raises(ValueError, match=r"with context_axis, k must be sharded like q: \[B, T, ...\] = \[1, 12, "
                                         r"...\], got k.shape = \(1, 24, 2, 8\)"):
        jax.shard_map(lambda q, k, v: nsa.attention(q, k, v, block_size=8, context_axis="sp"), mesh=_mesh(2),
                      in_specs=(SEQ, PartitionSpec(), PartitionSpec()), out_specs=SEQ)(x.q, x.k, x.v)
    k_cmp = jnp.zeros((1, 6, 2, 8))
    with pytest.raises(ValueError, match=r"with context_axis, k_cmp must be sharded like q: \[B, T / 4, ...\] = "
                                         r"\[1, 3, ...\] \(the compressed rows of local chunks of 6 tokens, a "
                                         r"multiple of 4\), got k_cmp.shape = \(1, 3, 2, 8\)"):
        jax.shard_map(lambda q, k, v, c: nsa.attention(q, k, v, k_cmp=c, v_cmp=c, g_cmp=q[..., 0], block_size=4,
                                                       context_axis="sp", context_layout="zigzag"),
                      mesh=_mesh(2), in_specs=(SEQ,) * 4, out_specs=SEQ)(x.q, x.k, x.v, k_cmp)


def _collectives(text):
    """{(collective, result type)}: count} of the all-gathers and reduce-scatters in a StableHLO module's text."""
    found = re.findall(r"stablehlo\.(all_gather|reduce_scatter)\b.*?\) -> tensor<([\dx]+x\w+)>", text, re.S)
    return {key: found.count(key) for key in set(found)}


def test_the_backward_gathers_k_and_v_again():
    """The residuals the forward keeps for the backward are each device's own rows (its inputs and its chunks'
    compressed rows: nothing of the whole sequence's length, no gathered k or v), and the gradient's program gathers
    k and v (and the compressed rows, made locally before k and v are gathered) twice, forward then again in the
    backward, and reduce-scatters their gradients."""
    P, layout = 4, "zigzag"
    x = Inputs((1, 128, 4, 2, 16, 16, 16), "float32")
    g = [gi[0] for gi in x.gates]
    local = lambda q, k, v, a, b, c: nsa.attention(q, k, v, g_cmp=a, g_slc=b, g_swa=c, block_counts=3, block_size=16,
                                                   window_size=24, context_axis="sp", context_layout=layout,
                                                   implementation="xla")
    f = jax.shard_map(local, mesh=_mesh(P), in_specs=(SEQ,) * 6, out_specs=SEQ)
    _, vjp = jax.vjp(f, x.q, x.k, x.v, *g)
    inputs = (x.q, x.k, x.v, *g)
    kept = [r.shape for r in jax.tree_util.tree_leaves(vjp)
            if jnp.issubdtype(getattr(r, "dtype", int), jnp.floating) and r.size]
    compressed_rows = (P, 128 // P // 16, 2, 16)  # each device's (stacked over the P devices)
    assert sorted(kept) == sorted([y.shape for y in inputs] + [compressed_rows] * 2), kept
    step = jax.value_and_grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2))  # the loss too, as a training step
    assert _collectives(jax.jit(step).lower(x.q, x.k, x.v, *g).as_text()) == {
        ("all_gather", "1x128x2x16xf32"): 4, ("all_gather", "1x8x2x16xf32"): 4,
        ("reduce_scatter", "1x32x2x16xf32"): 2, ("reduce_scatter", "1x2x2x16xf32"): 2}


def test_one_device_runs_the_plain_ops():
    """Over P = 1 device (either layout) the step is the plain call: no jax.checkpoint but the plain call's own (the
    gated sum's: nothing is gathered, so nothing more is recomputed), the output and the gradients equal
    nsa.attention's bitwise."""
    x = Inputs((1, 64, 4, 2, 16, 16, 8), "float32", seed=5)
    g = [gi[0] for gi in x.gates]
    kw = dict(block_counts=2, block_size=8, window_size=12, implementation="xla")
    plain = lambda q, k, v, a, b, c: nsa.attention(q, k, v, g_cmp=a, g_slc=b, g_swa=c, **kw)
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * x.do), argnums=tuple(range(6)))
    args = (x.q, x.k, x.v, *g)
    remats = lambda f: len(re.findall(r"remat|checkpoint", str(jax.make_jaxpr(grad(f))(*args))))  # its primitive's
    for layout in context.LAYOUTS:
        local = jax.shard_map(lambda *a: nsa.attention(*a[:3], g_cmp=a[3], g_slc=a[4], g_swa=a[5], context_axis="sp",
                                                       context_layout=layout, **kw),
                              mesh=_mesh(1), in_specs=(SEQ,) * 6, out_specs=SEQ)
        assert remats(local) == remats(plain) > 0
        np.testing.assert_array_equal(jax.jit(local)(*args), jax.jit(plain)(*args))
        for got, want in zip(jax.jit(grad(local))(*args), jax.jit(grad(plain))(*args)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.interpreted
@pytest.mark.parametrize("implementation, layout, cu", [("pallas", "zigzag", None), ("triton", "contiguous", None),
                                                        ("triton", "zigzag", (0, 11, 40, 64))],
                         ids=["pallas-zigzag", "triton-contiguous", "triton-zigzag-packed"])
def test_the_kernels_inside_a_context_axis(implementation, layout, cu, interpreted):
    """Pallas (TPU interpret mode) and Triton (its interpreter) at a small shape over 2 devices, one sequence or
    packed ones crossing the shards: output and gradients equal the XLA reference's single-device call."""
    P, x = 2, Inputs((1, 64, 4, 2, 16, 16, 8), "float32", seed=3)
    kw = dict(block_counts=2, block_size=8, window_size=12, cu_seqlens=cu)
    g = [gi[0] for gi in x.gates]
    local = lambda q, k, v, a, b, c: nsa.attention(q, k, v, g_cmp=a, g_slc=b, g_swa=c, context_axis="sp",
                                                   context_layout=layout, implementation=implementation, **kw)
    single = lambda q, k, v, a, b, c: nsa.attention(q, k, v, g_cmp=a, g_slc=b, g_swa=c, implementation="xla", **kw)
    sharded = _sharded(local, P, layout, 6)
    args = (x.q, x.k, x.v, *g)
    assert_close(jax.jit(sharded)(*args), jax.jit(single)(*args), TOLERANCE["float32"], "o")
    grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * x.do), argnums=(0, 1, 2)))(*args)
    scales = gradient_scales(x.q64, x.k64, x.v64, x.do64, 16 ** -0.5)
    for got, want, what, s in zip(grad(sharded), grad(single), ("dq", "dk", "dv"), scales):
        assert_close(got, want, GRAD_TOLERANCE["float32"], what, s)


def test_a_training_step_exported_for_tpu():
    """The gradient of a context-parallel step over 4 devices, exported for TPU with implementation=None: Mosaic
    kernels, k and v and their compressed rows all-gathered (forward and again in the backward), their gradients
    reduce-scattered in float32 (k and v are bf16), and no other collective."""
    from tests.test_pallas import _mosaic_kernels

    P = 4
    q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((1, 1024, 8), jnp.bfloat16)
    local = lambda q, k, v, a, b, c: nsa.attention(q, k, v, g_cmp=a, g_slc=b, g_swa=c, block_counts=4, block_size=64,
                                                   window_size=128, context_axis="sp")
    f = jax.shard_map(local, mesh=_mesh(P), in_specs=(SEQ,) * 6, out_specs=SEQ)
    step = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2)))
    module = jax.export.export(step, platforms=["tpu"])(q, kv, kv, g, g, g).mlir_module()
    assert _mosaic_kernels(module)
    assert not re.search(r"stablehlo\.(all_reduce|all_to_all|collective_permute)", module)
    # k, v and their compressed rows gathered in the forward and again in the backward; the gradients of the bf16
    # k, v (and of the compressed rows) reduce-scattered in float32
    assert _collectives(module) == {("all_gather", "1x1024x2x128xbf16"): 4, ("all_gather", "1x16x2x128xbf16"): 4,
                                    ("reduce_scatter", "1x256x2x128xf32"): 2, ("reduce_scatter", "1x4x2x128xf32"): 2}
