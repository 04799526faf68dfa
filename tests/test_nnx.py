"""nsa.nnx.NativeSparseAttention, the Flax NNX layer: its output is nsa.attention between its own projections,
decoding through the KV cache gives the full-sequence outputs, gradients reach every weight, and bad
configurations raise. Small dimensions, float32, the XLA implementation, everything jitted (an eager call
dispatches nsa's ops one by one, slower than compiling them) with few distinct shapes: seconds each."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nsa
from nsa import context
from nsa.nnx import NativeSparseAttention, _positions

C = 24  # hidden_size
SPARSITY = dict(block_size=4, block_counts=2)
# overlapping compression: windows of 8 tokens every 2 under selection blocks of 4 (l > l' is allowed); a learned phi
BLOCKS = {"l=d=l'": {}, "overlapping": dict(compress_block_size=8, compress_stride=2),
          "overlapping, phi": dict(compress_block_size=8, compress_stride=2, phi=True)}
# (num_heads, num_kv_heads, head_dim, head_dim_v, window_size, rope_theta, qkv_bias)
CONFIGS = {
    "G=2, rope, bias": (4, 2, 8, 8, 6, 10000.0, True),
    "G=1, Dv>Dk, no rope, no window": (3, 3, 8, 12, 0, None, False),
    "G=4, Dv<Dk, rope": (4, 1, 10, 6, 6, 500.0, False),
}


class Phi(nnx.Module):
    """A learned compression (the paper's phi) of windows [B, NC, l, H, D] -> [B, NC, H, D]: a position embedding of
    the window's l slots, then tanh of a linear map of the flattened window."""

    def __init__(self, l, D, rngs):
        self.position = nnx.Param(0.5 * jax.random.normal(rngs.params(), (l, D)))
        self.linear = nnx.Linear(l * D, D, rngs=rngs)

    def __call__(self, windows):
        x = jnp.moveaxis(windows + self.position[...][:, None], 2, 3)  # [B, NC, H, l, D]
        return jnp.tanh(self.linear(x.reshape(*x.shape[:3], -1)))


def layer(config="G=2, rope, bias", seed=0, phi=False, **overrides):
    """The layer of `config`; phi=True: with a learned compression (Phi for the keys and the values)."""
    HQ, H, Dk, Dv, window_size, rope_theta, qkv_bias = CONFIGS[config]
    if phi:
        l = overrides.get("compress_block_size", SPARSITY["block_size"])
        overrides = dict(overrides, phi_k=Phi(l, Dk, nnx.Rngs(seed + 1)), phi_v=Phi(l, Dv, nnx.Rngs(seed + 2)))
    args = dict(hidden_size=C, num_heads=HQ, num_kv_heads=H, head_dim=Dk, head_dim_v=Dv, window_size=window_size,
                rope_theta=rope_theta, qkv_bias=qkv_bias, implementation="xla", rngs=nnx.Rngs(seed), **SPARSITY)
    return NativeSparseAttention(**{**args, **overrides})


@nnx.jit
def forward(model, x):
    return model(x)


def inputs(*shape, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), shape + (C,), jnp.float32)


def assert_close(got, want, rtol=1e-5):
    """Equal up to rtol of the largest |want| (float32 rounding in differently ordered sums)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_array_less(np.max(np.abs(got - want)), rtol * np.max(np.abs(want)))


def by_hand(model, x, positions):
    """The layer's output from its weights: NumPy projections, RoPE as a complex rotation, nsa.attention."""
    x = np.asarray(x, np.float64)
    B, T, _ = x.shape
    HQ, H, Dk, Dv = model.num_heads, model.num_kv_heads, model.head_dim, model.head_dim_v

    def linear(proj, heads, d):
        y = x @ np.asarray(proj.kernel[...], np.float64)
        if proj.bias is not None:
            y = y + np.asarray(proj.bias[...], np.float64)
        return y.reshape(B, T, heads, d)

    def rope(y):  # pairs (i, i + D/2) as complex numbers, turned by position * theta ** (-i / (D/2))
        if model.rope_theta is None:
            return y
        half = y.shape[-1] // 2
        z = (y[..., :half] + 1j * y[..., half:]) * np.exp(
            1j * np.asarray(positions)[:, :, None, None] * model.rope_theta ** (-np.arange(half) / half))
        return np.concatenate([z.real, z.imag], axis=-1)

    f32 = lambda y: jnp.asarray(y, jnp.float32)
    q, k, v = rope(linear(model.q_proj, HQ, Dk)), rope(linear(model.k_proj, H, Dk)), linear(model.v_proj, H, Dv)
    learned = {}
    if model.phi_k is not None:  # phi's rows of the windows of k and v
        windows = lambda y: nsa.compression_windows(f32(y), block_size=model.compress_block_size,
                                                    stride=model.compress_stride)[0]
        learned = dict(k_cmp=model.phi_k(windows(k)), v_cmp=model.phi_v(windows(v)))
    names = ("g_cmp", "g_slc", "g_swa")[:len(model.branches)]
    g = 1 / (1 + np.exp(-linear(model.g_proj, HQ, len(names))))
    gates = {name: f32(g[..., i]) for i, name in enumerate(names)}
    blocks = dict(block_size=model.block_size, compress_block_size=model.compress_block_size,
                  compress_stride=model.compress_stride, block_counts=model.block_counts)
    o = jax.jit(nsa.attention, static_argnames=("window_size", "implementation", *blocks))(
        f32(q), f32(k), f32(v), **gates, **learned, window_size=model.window_size, implementation="xla", **blocks)
    return np.asarray(o, np.float64).reshape(B, T, HQ * Dv) @ np.asarray(model.o_proj.kernel[...], np.float64)


def test_import_nsa_imports_neither_the_layer_nor_flax():
    code = "import sys, nsa; print('flax' in sys.modules, 'nsa.nnx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_import_without_flax_says_what_to_install():
    code = "import sys; sys.modules['flax'] = None; import nsa.nnx"  # None: flax does not import
    error = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stderr
    assert "ModuleNotFoundError: nsa.nnx needs flax >= 0.12" in error and "pip install '.[nnx]'" in error


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("config", CONFIGS)
def test_output_is_nsa_attention_between_its_own_projections(config, blocks):
    """At given positions (the default ones, each token's index, are checked against these by the tests
    below: a cache step places its tokens at cache.lens + i)."""
    model = layer(config, **BLOCKS[blocks])
    x = inputs(2, 19)
    positions = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (2, 19)), jnp.int32)
    got = nnx.jit(lambda model, x, positions: model(x, positions=positions))(model, x, positions)
    assert_close(got, by_hand(model, x, positions))


def test_packed_sequences_equal_separate_calls():
    """cu_seqlens packs sequences of 7, 0, 9 and 4 tokens: each gives what it gives alone (positions restart),
    the separate sequences run as one right-padded batch (causal: padding after a token never reaches it)."""
    model = layer()
    cu_seqlens = np.array([0, 7, 7, 16, 20])
    x = inputs(1, 20)
    packed = nnx.jit(lambda model, x, cu_seqlens: model(x, cu_seqlens=cu_seqlens))(model, x, cu_seqlens)
    spans = [(start, end) for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]) if end > start]
    padded = jnp.stack([jnp.pad(x[0, start:end], ((0, 9 - (end - start)), (0, 0))) for start, end in spans])
    alone = forward(model, padded)
    for (start, end), y in zip(spans, alone):
        assert_close(packed[0, start:end], y[:end - start])
    # RoPE is relative, so the outputs cannot tell restarted positions from global ones; restarting keeps the
    # angles small (float32 loses angle precision at large positions): each token's index in its own sequence
    restarted = np.concatenate([np.arange(end - start) for start, end in spans])
    np.testing.assert_array_equal(_positions(1, jnp.arange(20), jnp.asarray(cu_seqlens)), restarted[None])


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("config", ["G=2, rope, bias", "G=1, Dv>Dk, no rope, no window"])
def test_decode_through_the_cache_equals_the_full_sequence_call(config, blocks):
    """A ragged batch: prefill prompts of 11 and 5 tokens (right-padded), then three one-token steps, a chunk
    of four and one more step, jitted with the cache donated; every output equals the whole-sequence call's
    (the whole sequences of 19 and 13 tokens as one right-padded batch)."""
    model = layer(config, **BLOCKS[blocks])
    lens, chunks = [11, 5], [1, 1, 1, 4, 1]
    prompts, new = inputs(2, 11, seed=2), inputs(2, sum(chunks), seed=3)
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, x, cache: nnx.merge(graphdef, state).step(x, cache), donate_argnums=2)
    prefill = nnx.jit(lambda model, x, lens: model.prefill(x, capacity=11 + sum(chunks), lens=lens))
    y_prompt, cache = prefill(model, prompts, jnp.asarray(lens))
    outputs, offset = [], 0
    for n in chunks:
        y, cache = step(state, new[:, offset:offset + n], cache)
        outputs.append(y)
        offset += n
    y_new = jnp.concatenate(outputs, axis=1)
    np.testing.assert_array_equal(cache.lens, np.add(lens, sum(chunks)))
    whole = forward(model, jnp.stack([jnp.concatenate([prompts[b, :n], new[b], prompts[b, n:]])
                                      for b, n in enumerate(lens)]))
    for b, (n, full) in enumerate(zip(lens, whole)):
        assert_close(y_prompt[b, :n], full[:n])
        assert_close(y_new[b], full[n:n + sum(chunks)])


def test_steps_from_an_empty_cache_equal_the_full_sequence_call():
    model = layer()
    x = inputs(2, 10)
    cache = model.init_cache(2, 16)
    assert (cache.k.shape, cache.v.shape, cache.block_size) == ((2, 16, 2, 8), (2, 16, 2, 8), SPARSITY["block_size"])
    step = nnx.jit(lambda model, x, cache: model.step(x, cache))
    y_first, cache = step(model, x[:, :5], cache)
    y_rest, cache = step(model, x[:, 5:], cache)
    assert_close(jnp.concatenate([y_first, y_rest], axis=1), forward(model, x))


def test_gradients_reach_every_parameter():
    model = layer()  # qkv_bias: biases too
    x = inputs(2, 13)
    grads = nnx.jit(nnx.grad(lambda model, x: jnp.sum(jnp.sin(model(x)))))(model, x)
    named = jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))
    assert len(named) == 8  # q, k, v kernels and biases, g_proj and o_proj kernels
    for path, g in named:
        assert np.all(np.isfinite(g)) and np.any(g != 0), jax.tree_util.keystr(path)


def test_gradients_reach_a_learned_phi():
    model = layer(phi=True, compress_block_size=8, compress_stride=2)
    grads = nnx.jit(nnx.grad(lambda model, x: jnp.sum(jnp.sin(model(x)))))(model, inputs(2, 13))
    for module in ("phi_k", "phi_v"):
        named = jax.tree_util.tree_leaves_with_path(nnx.state(getattr(grads, module), nnx.Param))
        assert len(named) == 3  # the position embedding, the linear map's kernel and bias
        for path, g in named:
            assert np.all(np.isfinite(g)) and np.any(g != 0), module + jax.tree_util.keystr(path)


def _context_parallel(model, P, layout):
    """model's __call__ with the sequence split over P CPU devices in `layout` (inside jax.shard_map): a function
    of the whole x [B, T, C] and cu_seqlens (None, or over the whole sequence), giving the whole y in sequence
    order."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:P]), ("sp",))
    graphdef, state = nnx.split(model)
    seq, whole = jax.sharding.PartitionSpec(None, "sp"), jax.sharding.PartitionSpec()

    def local(state, x, cu_seqlens):
        return nnx.merge(graphdef, state)(x, cu_seqlens=cu_seqlens)

    @jax.jit
    def call(x, cu_seqlens):
        sharded = jax.shard_map(local, mesh=mesh, in_specs=(whole, seq, whole), out_specs=seq)
        return context.from_context_layout(sharded(state, context.to_context_layout(x, P, layout), cu_seqlens), P,
                                           layout)

    return call


@pytest.mark.parametrize("P, layout, phi, packed", [(4, "zigzag", True, False), (2, "contiguous", False, True),
                                                    (4, "contiguous", True, False)])
def test_context_parallel_layer_equals_the_unsharded_layer(P, layout, phi, packed):
    """layer(x) with context_axis inside jax.shard_map over P CPU devices (tests/conftest.py makes 8), x split
    along T in `layout`: the outputs equal the unsharded layer's with the same weights (RoPE at each row's place in
    the whole sequence, a learned phi over windows that do not overlap, packed sequences over the whole sequence)."""
    kw = dict(phi=phi, compress_block_size=2, compress_stride=2)
    model = layer(**kw)
    sharded = layer(**kw, context_axis="sp", context_layout=layout)
    nnx.update(sharded, nnx.state(model))
    x = inputs(1 if packed else 2, 32, seed=4)
    cu_seqlens = jnp.asarray([0, 5, 21, 32], jnp.int32) if packed else None
    want = nnx.jit(lambda model, x, cu: model(x, cu_seqlens=cu))(model, x, cu_seqlens)
    assert_close(_context_parallel(sharded, P, layout)(x, cu_seqlens), want)


def test_context_parallel_layer_refuses_what_it_cannot_compute():
    """A learned phi over overlapping windows (each device's windows would reach into another's chunk), phi with
    packed sequences, and a KV cache (prefill, step) with context_axis: errors that say why."""
    with pytest.raises(ValueError, match=r"phi_k, phi_v with context_axis need windows that do not overlap "
                                         r"\(compress_block_size = compress_stride\), got compress_block_size = 8 > "
                                         r"compress_stride = 2"):
        layer(phi=True, compress_block_size=8, compress_stride=2, context_axis="sp")
    model = layer(phi=True, context_axis="sp")
    with pytest.raises(ValueError, match=r"phi_k, phi_v with context_axis cannot take cu_seqlens"):
        _context_parallel(model, 2, "zigzag")(inputs(1, 16), jnp.asarray([0, 8, 16], jnp.int32))
    with pytest.raises(ValueError, match=r"prefill serves through a KV cache, which context parallelism does not take"):
        model.prefill(inputs(1, 4), capacity=8)
    with pytest.raises(ValueError, match=r"step serves through a KV cache, which context parallelism does not take"):
        model.step(inputs(1, 1), model.init_cache(1, 8))
    with pytest.raises(ValueError, match=r"context_layout must be one of \('zigzag', 'contiguous'\), got 'ring'"):
        layer(context_axis="sp", context_layout="ring")
    with pytest.raises(ValueError, match=r"context_axis = 'sp' must name a mesh axis of the jax.shard_map .* call the "
                                         r"op inside jax.shard_map"):
        layer(context_axis="sp")(inputs(1, 8))  # outside shard_map
    with pytest.raises(ValueError, match=r"phi_k was given without phi_v"):
        layer(phi_k=Phi(4, 8, nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"phi_v must be a callable \(an nnx Module\) .*, got int"):
        layer(phi_k=Phi(4, 8, nnx.Rngs(0)), phi_v=3)


@pytest.mark.parametrize("overrides, name", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(num_heads=5, num_kv_heads=5, head_dim=None), "head_dim"),
    (dict(head_dim=7), "rope_theta"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(head_dim_v=0), "head_dim_v"),
    (dict(block_size=0), "block_size"),
    (dict(block_counts=0), "block_counts"),
    (dict(compress_block_size=6, compress_stride=3), "compress_stride"),  # 3 does not divide block_size 4
    (dict(window_size=-1), "window_size"),
    (dict(implementation="bogus"), "implementation"),
])
def test_a_bad_configuration_raises_naming_the_argument(overrides, name):
    with pytest.raises(ValueError, match=name):
        layer(**overrides)


def test_bad_calls_raise_naming_the_argument():
    model = layer()
    with pytest.raises(ValueError, match="hidden_size"):
        model(jnp.zeros((1, 4, C + 1)))
    with pytest.raises(ValueError, match="positions"):
        model(inputs(1, 4), positions=jnp.zeros((1, 5), jnp.int32))
    other = layer(block_size=8).init_cache(1, 8)
    with pytest.raises(ValueError, match="block_size"):
        model.step(inputs(1, 1), other)
    overlapping = layer(**BLOCKS["overlapping"]).init_cache(1, 8)
    with pytest.raises(ValueError, match="compress_block_size"):
        model.step(inputs(1, 1), overlapping)
    for cache in (model.init_cache(3, 8), model.init_paged_cache(4, 4, 3, 2)):
        with pytest.raises(ValueError, match=r"cache must hold the B = 2 sequences of x \(x.shape\[0\]\), got a cache "
                                             r"of 3 \(cache.lens.shape = \(3,\)\)"):
            model.step(inputs(2, 1), cache)
