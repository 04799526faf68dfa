"""The KV cache (nsa.cache): prefill and append against compressing the whole sequence, in place under jit,
one compilation for every length, clear errors, and a decode step that reads O(TK / block_size + selected +
window) keys of the cache, never all of them."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from tests.base import Inputs, assert_close, largest_intermediate

B, N, H, DK, DV, BS = 2, 80, 2, 16, 8, 8


def _tokens(T, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((B, T, H, DK)), dtype), jnp.asarray(rng.standard_normal((B, T, H, DV)), dtype))


def _assert_holds(cache, k, v, lens):
    """cache holds sequence b = k[b, :lens[b]], v[b, :lens[b]]: its rows and the compressed rows of its
    complete blocks, bitwise as nsa.compress gives them."""
    np.testing.assert_array_equal(np.asarray(cache.lens), lens)
    for b, n in enumerate(lens):
        np.testing.assert_array_equal(np.asarray(cache.k[b, :n]), np.asarray(k[b, :n]))
        np.testing.assert_array_equal(np.asarray(cache.v[b, :n]), np.asarray(v[b, :n]))
        for x_cmp, x in ((cache.k_cmp, k), (cache.v_cmp, v)):
            full = nsa.compress(x[b:b + 1, :n], block_size=BS)[0, :n // BS]
            np.testing.assert_array_equal(np.asarray(x_cmp[b, :n // BS]), np.asarray(full))


def test_prefill_holds_each_prompt_and_its_complete_blocks():
    k, v = _tokens(50)
    cache = nsa.prefill_cache(k, v, block_size=BS, capacity=N, lens=[50, 21])
    assert cache.k.shape == (B, N, H, DK) and cache.v_cmp.shape == (B, N // BS, H, DV)
    _assert_holds(cache, k, v, [50, 21])
    # the rows of blocks that are not complete stay as empty_cache made them
    np.testing.assert_array_equal(np.asarray(cache.k_cmp[1, 21 // BS:]), 0.0)


@pytest.mark.parametrize("steps", [[1] * 13, [5, 8, 1, 16], [30]], ids=["decode", "chunks", "one-chunk"])
def test_appends_hold_what_a_prefill_of_everything_holds(steps):
    """Prompts of 29 and 3 tokens, then appends of 1, a few and many tokens (some completing several blocks
    at once, some none) hold what one prefill of the whole sequences holds."""
    lens = np.array([29, 3])
    k, v = _tokens(lens.max() + sum(steps), seed=1)
    cache = nsa.prefill_cache(k[:, :29], v[:, :29], block_size=BS, capacity=N, lens=lens)
    full_k, full_v = np.array(k), np.array(v)
    start = 29
    for n in steps:
        new_k, new_v = k[:, start:start + n], v[:, start:start + n]
        for b in range(B):  # sequence b's new tokens follow its own lens[b]
            full_k[b, lens[b]:lens[b] + n], full_v[b, lens[b]:lens[b] + n] = new_k[b], new_v[b]
        cache = nsa.append_to_cache(cache, new_k, new_v, block_size=BS)
        lens, start = lens + n, start + n
    _assert_holds(cache, jnp.asarray(full_k), jnp.asarray(full_v), lens)


def test_append_under_jit_is_in_place_and_compiles_once():
    """With the cache donated the compiled step aliases every cache buffer to its output (XLA writes the new
    rows in place), and one compilation serves every length."""
    k, v = _tokens(40, seed=2)
    cache = nsa.prefill_cache(k[:, :7], v[:, :7], block_size=BS, capacity=N, lens=[7, 2])
    chex.clear_trace_counter()
    step = jax.jit(chex.assert_max_traces(lambda c, k, v: nsa.append_to_cache(c, k, v, block_size=BS), n=1),
                   donate_argnums=0)
    compiled = step.lower(cache, k[:, :1], v[:, :1]).compile().as_text()
    aliased = re.findall(r"\{(\d+)\}: \((\d+), \{\}, (?:may|must)-alias\)", compiled.split("entry_computation_layout")[0])
    assert sorted(aliased) == [(str(i), str(i)) for i in range(len(cache))], aliased
    for t in range(7, 30):
        old = cache
        cache = step(cache, k[:, t:t + 1], v[:, t:t + 1])
        assert old.k.is_deleted()  # donated: the step took its buffer
    np.testing.assert_array_equal(np.asarray(cache.lens), [30, 25])


def test_append_past_the_capacity():
    """Concrete lengths: ValueError. Under jit (traced lengths): the tokens that do not fit are dropped, lens
    stops at the capacity, and no other row changes (nothing written out of bounds)."""
    k, v = _tokens(N, seed=3)
    cache = nsa.prefill_cache(k[:, :N - 2], v[:, :N - 2], block_size=BS, capacity=N, lens=[N - 2, 40])
    with pytest.raises(ValueError, match=r"appending 3 tokens past the cache's capacity N = 80: cache.lens\[0\] = 78"):
        nsa.append_to_cache(cache, k[:, :3], v[:, :3], block_size=BS)
    new = jax.jit(lambda c, k, v: nsa.append_to_cache(c, k, v, block_size=BS))(cache, k[:, :3] + 100, v[:, :3])
    np.testing.assert_array_equal(np.asarray(new.lens), [N, 43])
    np.testing.assert_array_equal(np.asarray(new.k[0, :N - 2]), np.asarray(cache.k[0, :N - 2]))
    np.testing.assert_array_equal(np.asarray(new.k[0, N - 2:]), np.asarray(k[0, :2] + 100))
    np.testing.assert_array_equal(np.asarray(new.k[1, 43:]), np.asarray(cache.k[1, 43:]))


def test_bad_caches_and_tokens_raise():
    k, v = _tokens(16)
    cache = nsa.empty_cache(B, N, H, DK, head_dim_v=DV, block_size=BS, dtype=jnp.float32)
    append = lambda c, k, v, bs=BS: nsa.append_to_cache(c, k, v, block_size=bs)
    with pytest.raises(TypeError, match=r"k.dtype must equal the cache's \(float32\), got bfloat16"):
        append(cache, k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match=r"v must have shape \[B, TN, H, D\] .* = \(2, 16, 2, 8\), got \(2, 16, 2, 16\)"):
        append(cache, k, k)
    with pytest.raises(ValueError, match=r"cache.k_cmp must have shape .*block_size = 16.* = \(2, 5, 2, 16\), "
                                         r"got \(2, 10, 2, 16\)"):
        append(cache, k, v, bs=16)  # a cache made for another block size
    with pytest.raises(TypeError, match=r"cache.v.dtype must equal cache.k.dtype \(float32\), got bfloat16"):
        append(cache._replace(v=cache.v.astype(jnp.bfloat16)), k, v)
    with pytest.raises(TypeError, match=r"cache must be an nsa.KVCache, got tuple"):
        append(tuple(cache), k, v)
    with pytest.raises(ValueError, match=r"cache.lens must have shape \[B\] = \(2,\), got \(3,\)"):
        append(cache._replace(lens=jnp.zeros(3, jnp.int32)), k, v)
    with pytest.raises(ValueError, match=r"the prompts \(k.shape\[1\] = 16 tokens\) must fit .* got capacity = 8"):
        nsa.prefill_cache(k, v, block_size=BS, capacity=8)
    with pytest.raises(ValueError, match=r"lens must lie in \[0, TP = k.shape\[1\]\] = \[0, 16\], got lens\[1\] = 17"):
        nsa.prefill_cache(k, v, block_size=BS, capacity=N, lens=[3, 17])


def test_decode_loop_under_jit_matches_a_full_recompute():
    """Greedy-style decode over a ragged batch: a jitted step (append, then nsa.attention on the cache) in a
    lax.fori_loop, the cache as carry; every step's output equals nsa.attention on the whole sequences so
    far, at each sequence's last token."""
    x = Inputs((B, 40, 6, H, DK, DV, BS), "float32", seed=5)
    g = [gi[0] for gi in x.gates]
    prompt = np.array([23, 9])
    kw = dict(block_counts=3, block_size=BS, window_size=9)
    cache = nsa.prefill_cache(x.k[:, :23], x.v[:, :23], block_size=BS, capacity=N, lens=prompt)
    steps = 12
    # the token each sequence appends at each step: sequence b's tokens prompt[b] ... prompt[b] + steps - 1
    at = lambda y, i: jnp.stack([y[b, prompt[b] + i] for b in range(B)])[:, None]

    def step(i, carry):
        cache, out = carry
        cache = nsa.append_to_cache(cache, at(x.k, i), at(x.v, i), block_size=BS)
        o = nsa.attention(at(x.q, i), cache.k, cache.v, g_cmp=at(g[0], i), g_slc=at(g[1], i), g_swa=at(g[2], i),
                          k_cmp=cache.k_cmp, v_cmp=cache.v_cmp, kv_lens=cache.lens, **kw)
        return cache, out.at[i].set(o[:, 0])

    out = jnp.zeros((steps, B, 6, DV))
    cache, out = jax.jit(lambda c, o: jax.lax.fori_loop(0, steps, step, (c, o)), donate_argnums=0)(cache, out)
    np.testing.assert_array_equal(np.asarray(cache.lens), prompt + steps)
    for b in range(B):
        n = prompt[b] + steps
        one = lambda y: y[b:b + 1, :n]
        full = nsa.attention(one(x.q), one(x.k), one(x.v), g_cmp=one(g[0]), g_slc=one(g[1]), g_swa=one(g[2]), **kw)
        assert_close(out[:, b], full[0, prompt[b]:], 2e-5, f"decode outputs of sequence {b}")


def test_a_decode_step_never_touches_the_whole_cache():
    """nsa.attention of one new token per sequence over a cache of TK = 65536 (the standard heads, traced, not
    run): no intermediate is anywhere near the size of the cache's k (a copy, a cast or a pad of the whole
    cache would be): the reference reads the compressed rows, the selected blocks and the window only."""
    Bd, TK, HQ, Hd, D, bs = 4, 65536, 64, 4, 128, 64
    q = jax.ShapeDtypeStruct((Bd, 1, HQ, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((Bd, TK, Hd, D), jnp.bfloat16)
    cmp = jax.ShapeDtypeStruct((Bd, TK // bs, Hd, D), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((Bd, 1, HQ), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((Bd,), jnp.int32)

    def decode(q, k, v, k_cmp, v_cmp, lens, a, b, c):
        return nsa.attention(q, k, v, g_cmp=a, g_slc=b, g_swa=c, k_cmp=k_cmp, v_cmp=v_cmp, kv_lens=lens,
                             block_counts=16, block_size=bs, window_size=512, implementation="xla")

    largest = largest_intermediate(jax.make_jaxpr(decode)(q, kv, kv, cmp, cmp, lens, g, g, g).jaxpr)
    cache_bytes = Bd * TK * Hd * D * 2
    assert largest <= cache_bytes // 16, f"largest intermediate {largest / 2 ** 20:.1f} MiB of a {cache_bytes >> 20} MiB k"
