"""The KV caches (nsa.cache): prefill and append against compressing the whole sequence, in place under jit,
one compilation for every length, clear errors, and a decode step that reads O(TK / block_size + selected +
window) keys of the cache, never all of them; the paged cache against the contiguous one, ragged appends, and
the gradients of a ragged step. (Attention over both caches on every implementation: the shared base,
tests/base.py's test_ragged_steps_over_a_paged_cache_equal_full_recompute.)"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa._kvcache import sequences
from tests.base import TOLERANCE, Inputs, assert_close, largest_intermediate

B, N, H, DK, DV, BS = 2, 80, 2, 16, 8, 8


def _tokens(T, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((B, T, H, DK)), dtype), jnp.asarray(rng.standard_normal((B, T, H, DV)), dtype))


def _complete(n, l, d):
    """The compressed rows of a sequence of n tokens whose windows (l tokens every d) are complete."""
    return max(n - l + d, 0) // d


def _assert_holds(cache, k, v, lens, l=BS, d=BS):
    """cache holds sequence b = k[b, :lens[b]], v[b, :lens[b]]: its rows and the compressed rows of its
    complete windows (l tokens every d), bitwise as nsa.compress gives them."""
    np.testing.assert_array_equal(np.asarray(cache.lens), lens)
    for b, n in enumerate(lens):
        np.testing.assert_array_equal(np.asarray(cache.k[b, :n]), np.asarray(k[b, :n]))
        np.testing.assert_array_equal(np.asarray(cache.v[b, :n]), np.asarray(v[b, :n]))
        rows = _complete(n, l, d)
        for x_cmp, x in ((cache.k_cmp, k), (cache.v_cmp, v)):
            full = nsa.compress(x[b:b + 1, :n], block_size=l, stride=d)[0, :rows]
            np.testing.assert_array_equal(np.asarray(x_cmp[b, :rows]), np.asarray(full))


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


@pytest.mark.parametrize("steps", [[1] * 13, [5, 8, 1, 16]], ids=["decode", "chunks"])
def test_overlapping_windows_are_written_once_complete(steps):
    """Windows of l = 8 tokens every d = 4 (selection blocks of 16): after each prefill or append, row i of k_cmp
    holds nsa.compress(..., block_size=8, stride=4)'s row i bitwise once token i * d + l - 1 has arrived, and is
    still empty_cache's zeros before (a partial window is never written)."""
    l, d, sel = 8, 4, 16
    lens = np.array([29, 3])
    k, v = _tokens(lens.max() + sum(steps), seed=6)
    cache = nsa.prefill_cache(k[:, :29], v[:, :29], block_size=sel, compress_block_size=l, compress_stride=d,
                              capacity=N, lens=lens)
    assert (cache.block_size, cache.compress_block_size, cache.compress_stride) == (sel, l, d)
    assert cache.k_cmp.shape == (B, N // d, H, DK)
    # each sequence in full, its prompt then every new token: a complete window's row is the same over any length
    total = sum(steps)
    rows = [[nsa.compress(jnp.concatenate([x[b, :n], x[b, 29:29 + total]])[None], block_size=l, stride=d)[0]
             for b, n in enumerate(lens)] for x in (k, v)]
    start = 29
    for n in [0] + steps:
        if n:
            cache = nsa.append_to_cache(cache, k[:, start:start + n], v[:, start:start + n])
            lens, start = lens + n, start + n
        for b, length in enumerate(lens):
            complete = max(0, (length - l) // d + 1)  # rows i with i * d + l <= length
            for x_cmp, want in zip((cache.k_cmp, cache.v_cmp), rows):
                np.testing.assert_array_equal(np.asarray(x_cmp[b, :complete]), np.asarray(want[b][:complete]))
                np.testing.assert_array_equal(np.asarray(x_cmp[b, complete:]), 0.0)


def test_attention_over_a_cache_of_overlapping_windows():
    """nsa.attention(q, cache=cache) with windows of 8 tokens every 4 and selection blocks of 16 (the cache brings
    all three): the last tokens' outputs of the whole sequences (the reference on each sequence alone), for a
    decode step and a chunk; a block argument that is not the cache's raises, naming it."""
    l, d, sel, tq = 8, 4, 16, 5
    x = Inputs((B, 70, 4, H, DK, DV, sel), "float32", seed=7)
    lens = [70, 44]
    g = [gi[0] for gi in x.gates]
    kw = dict(block_counts=3, window_size=9)
    blocks = dict(block_size=sel, compress_block_size=l, compress_stride=d)
    for chunk in (1, tq):
        cache = nsa.prefill_cache(x.k, x.v, capacity=N, lens=[n - chunk for n in lens], **blocks)
        last = lambda y: jnp.stack([y[b, n - chunk:n] for b, n in enumerate(lens)])
        cache = nsa.append_to_cache(cache, last(x.k), last(x.v))
        o = jax.jit(lambda q, cache, *g: nsa.attention(q, cache=cache, g_cmp=g[0], g_slc=g[1], g_swa=g[2], **kw))(
            last(x.q), cache, *(last(gi) for gi in g))
        whole = jax.jit(lambda q, k, v, *g: nsa.attention(q, k, v, g_cmp=g[0], g_slc=g[1], g_swa=g[2],
                                                          implementation="xla", **kw, **blocks))
        for b, n in enumerate(lens):
            one = lambda y: y[b:b + 1, :n]
            want = whole(one(x.q), one(x.k), one(x.v), *(one(gi) for gi in g))[0, n - chunk:]
            assert_close(o[b], want, 1e-5, f"o[{b}], chunk {chunk}")
    for name, value in (("compress_stride", 8), ("compress_block_size", 16), ("block_size", 32)):
        with pytest.raises(ValueError, match=f"{name} = {value} was given, but the cache was made with {name} = "):
            nsa.attention(last(x.q), cache=cache, **{name: value})


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
    assert sorted(aliased) == [(str(i), str(i)) for i in range(len(jax.tree_util.tree_leaves(cache)))], aliased
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
    with pytest.raises(ValueError, match=r"block_size = 16 was given, but the cache was made with block_size = 8"):
        append(cache, k, v, bs=16)  # the cache carries its own block size
    with pytest.raises(ValueError, match=r"cache.k_cmp must have shape .*compress_stride = 16.* = \(2, 5, 2, 16\), "
                                         r"got \(2, 10, 2, 16\)"):
        append(cache.replace(block_size=16, compress_block_size=16, compress_stride=16), k, v, bs=None)  # other rows
    with pytest.raises(TypeError, match=r"cache.block_size must be an int, got float"):
        append(cache.replace(block_size=8.0), k, v, bs=None)
    with pytest.raises(TypeError, match=r"cache.v.dtype must equal cache.k.dtype \(float32\), got bfloat16"):
        append(cache.replace(v=cache.v.astype(jnp.bfloat16)), k, v)
    with pytest.raises(TypeError, match=r"cache must be an nsa.KVCache or an nsa.PagedKVCache, got tuple"):
        append((cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.lens), k, v)
    with pytest.raises(ValueError, match=r"cache.lens must have shape \[B\] = \(2,\), got \(3,\)"):
        append(cache.replace(lens=jnp.zeros(3, jnp.int32)), k, v)
    with pytest.raises(ValueError, match=r"the prompts \(k.shape\[1\] = 16 tokens\) must fit .* got capacity = 8"):
        nsa.prefill_cache(k, v, block_size=BS, capacity=8)
    with pytest.raises(ValueError, match=r"lens must lie in \[0, k.shape\[1\]\] = \[0, 16\], got lens\[1\] = 17"):
        nsa.prefill_cache(k, v, block_size=BS, capacity=N, lens=[3, 17])


def test_decode_loop_under_jit_matches_a_full_recompute():
    """Greedy-style decode over a ragged batch: a jitted step (append, then nsa.attention(q, cache=cache)) in a
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
        cache = nsa.append_to_cache(cache, at(x.k, i), at(x.v, i))
        o = nsa.attention(at(x.q, i), cache=cache, g_cmp=at(g[0], i), g_slc=at(g[1], i), g_swa=at(g[2], i), **kw)
        return cache, out.at[i].set(o[:, 0])

    out = jnp.zeros((steps, B, 6, DV))
    cache, out = jax.jit(lambda c, o: jax.lax.fori_loop(0, steps, step, (c, o)), donate_argnums=0)(cache, out)
    np.testing.assert_array_equal(np.asarray(cache.lens), prompt + steps)
    for b in range(B):
        n = prompt[b] + steps
        one = lambda y: y[b:b + 1, :n]
        full = nsa.attention(one(x.q), one(x.k), one(x.v), g_cmp=one(g[0]), g_slc=one(g[1]), g_swa=one(g[2]), **kw)
        assert_close(out[:, b], full[0, prompt[b]:], 2e-5, f"decode outputs of sequence {b}")


def test_attention_over_the_cache_is_the_call_with_its_arrays_and_cannot_be_mismatched():
    """attention(q, cache=cache) is attention on the cache's arrays, kv_lens and block size, bitwise, eager and under
    jit; a block size, keys or lengths given beside the cache raise instead of being mixed with it."""
    x = Inputs((B, 40, 4, H, DK, DV, BS), "float32", seed=6)
    g = [gi[0][:, -2:] for gi in x.gates]
    cache = nsa.prefill_cache(x.k[:, :38], x.v[:, :38], block_size=BS, capacity=N, lens=[38, 17])
    cache = nsa.append_to_cache(cache, x.k[:, 38:], x.v[:, 38:])
    kw = dict(g_cmp=g[0], g_slc=g[1], g_swa=g[2], block_counts=3, window_size=9)
    raw = nsa.attention(x.q[:, -2:], cache.k, cache.v, k_cmp=cache.k_cmp, v_cmp=cache.v_cmp, kv_lens=cache.lens,
                        block_size=BS, **kw)
    np.testing.assert_array_equal(np.asarray(nsa.attention(x.q[:, -2:], cache=cache, **kw)), np.asarray(raw))
    jitted = jax.jit(lambda q, c: nsa.attention(q, cache=c, **kw))(x.q[:, -2:], cache)
    assert_close(jitted, raw, 1e-6, "attention(q, cache=cache) under jit")
    q = x.q[:, -2:]
    with pytest.raises(ValueError, match=r"block_size = 16 was given, but the cache was made with block_size = 8"):
        nsa.attention(q, cache=cache, block_size=16)
    np.testing.assert_array_equal(np.asarray(nsa.attention(q, cache=cache, block_size=BS, **kw)), np.asarray(raw))
    with pytest.raises(ValueError, match=r"cache= brings the keys, .* pass k and v or cache, not both"):
        nsa.attention(q, cache.k, cache.v, cache=cache)
    with pytest.raises(ValueError, match=r"pass kv_lens or cache, not both"):
        nsa.attention(q, cache=cache, kv_lens=cache.lens)
    with pytest.raises(ValueError, match=r"cache.lens must lie in \[T, TK = k.shape\[1\]\] = \[2, 80\].*"
                                         r"got cache.lens\[0\] = 1"):
        nsa.attention(q, cache=cache.replace(lens=jnp.array([1, 20], jnp.int32)))
    with pytest.raises(TypeError, match=r"cache must be an nsa.KVCache or an nsa.PagedKVCache, got dict"):
        nsa.attention(q, cache=dict(k=cache.k))


def test_the_cache_is_a_pytree_of_its_arrays_with_its_block_size_static():
    """Its leaves are the five arrays; block_size is part of its structure: it survives jit, and a jitted function
    of a cache compiles once per block size."""
    caches = [nsa.empty_cache(B, N, H, DK, block_size=bs, dtype=jnp.float32) for bs in (BS, 2 * BS)]
    assert [len(jax.tree_util.tree_leaves(c)) for c in caches] == [5, 5]
    assert jax.tree_util.tree_structure(caches[0]) != jax.tree_util.tree_structure(caches[1])
    traces = []
    block_size = jax.jit(lambda c: traces.append(c.block_size) or c)
    assert [block_size(c).block_size for c in caches + caches] == [BS, 2 * BS, BS, 2 * BS]
    assert traces == [BS, 2 * BS]


def test_compressed_rows_written_a_token_at_a_time_equal_compress_bitwise():
    """A jitted one-token decode step writes each compressed row as its block completes: bitwise nsa.compress of
    the whole sequences (a reduction over a block alone and inside a long sequence could round differently:
    compress sums in one fixed order). The shapes where XLA's own reduction differed in the last bit."""
    rng = np.random.default_rng(7)
    k = jnp.asarray(rng.standard_normal((3, 77, 1, 32)), jnp.float32)
    cache = nsa.prefill_cache(k[:, :1], k[:, :1], block_size=BS, capacity=128)
    step = jax.jit(nsa.append_to_cache)
    for t in range(1, 77):
        cache = step(cache, k[:, t:t + 1], k[:, t:t + 1])
    rows = 77 // BS
    np.testing.assert_array_equal(np.asarray(cache.k_cmp[:, :rows]), np.asarray(nsa.compress(k, block_size=BS))[:, :rows])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_decode_step_never_touches_the_whole_cache(paged):
    """nsa.attention of one new token per sequence over a cache of TK = 65536 (the standard heads, traced, not
    run): no intermediate is anywhere near the size of the cache's k (a copy, a cast or a pad of the whole
    cache would be): the reference reads the compressed rows, the selected blocks and the window only. Over a
    paged cache (pages of 256 tokens in a pool of Bd * TK / 256) the same: the window and the selected blocks
    are read through the page table, only the compressed rows are gathered."""
    Bd, TK, HQ, Hd, D, bs, page = 4, 65536, 64, 4, 128, 64, 256
    q = jax.ShapeDtypeStruct((Bd, 1, HQ, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((Bd, TK, Hd, D), jnp.bfloat16)
    cmp = jax.ShapeDtypeStruct((Bd, TK // bs, Hd, D), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((Bd, 1, HQ), jnp.bfloat16)
    lens = jax.ShapeDtypeStruct((Bd,), jnp.int32)
    gates = dict(block_counts=16, window_size=512, implementation="xla")

    def decode(q, k, v, k_cmp, v_cmp, lens, a, b, c):
        return nsa.attention(q, k, v, g_cmp=a, g_slc=b, g_swa=c, k_cmp=k_cmp, v_cmp=v_cmp, kv_lens=lens,
                             block_size=bs, **gates)

    def paged_decode(q, cache, a, b, c):
        return nsa.attention(q, cache=cache, g_cmp=a, g_slc=b, g_swa=c, **gates)

    if paged:
        pool = lambda rows: jax.ShapeDtypeStruct((Bd * TK // page, rows, Hd, D), jnp.bfloat16)
        cache = nsa.PagedKVCache(pool(page), pool(page), pool(page // bs), pool(page // bs),
                                 jax.ShapeDtypeStruct((Bd, TK // page), jnp.int32), lens, block_size=bs)
        jaxpr = jax.make_jaxpr(paged_decode)(q, cache, g, g, g)
    else:
        jaxpr = jax.make_jaxpr(decode)(q, kv, kv, cmp, cmp, lens, g, g, g)
    largest = largest_intermediate(jaxpr.jaxpr)
    cache_bytes = Bd * TK * Hd * D * 2
    assert largest <= cache_bytes // 16, f"largest intermediate {largest / 2 ** 20:.1f} MiB of a {cache_bytes >> 20} MiB k"


PAGE = 16  # tokens a page in the paged tests: 5 pages hold a sequence of N = 80


def _paged(table, dtype=jnp.float32, **blocks):
    """A paged cache of 13 pages of PAGE tokens, NaN everywhere (a row read before it is written shows), with the
    page table `table` [B, 5]."""
    cache = nsa.empty_paged_cache(13, PAGE, B, 5, H, DK, head_dim_v=DV, dtype=dtype, **(blocks or dict(block_size=BS)))
    nan = lambda x: jnp.full_like(x, jnp.nan)
    return cache.replace(k=nan(cache.k), v=nan(cache.v), k_cmp=nan(cache.k_cmp), v_cmp=nan(cache.v_cmp),
                         page_table=jnp.asarray(table, jnp.int32))


@pytest.mark.parametrize("l, d", [(8, 8), (16, 8)], ids=["l8-d8", "l16-d8"])
def test_ragged_appends_to_a_paged_cache_hold_what_the_contiguous_cache_holds(l, d):
    """Ragged appends (0 tokens to an idle sequence, 1, and chunks that complete several windows at once) to a
    paged cache whose pages lie in random order: each sequence's rows and complete compressed rows, read through
    the page table, equal the contiguous cache's bitwise; the pages no sequence owns keep their NaN, and so do the
    rows past each sequence."""
    table = [[7, 2, 11, 0, 5], [3, 12, 9, -1, -1]]  # pages 1, 4, 6, 8, 10 owned by no sequence
    blocks = dict(block_size=BS, compress_block_size=l, compress_stride=d)
    paged = _paged(table, **blocks)
    contiguous = nsa.empty_cache(B, N, H, DK, head_dim_v=DV, dtype=jnp.float32, **blocks)
    k, v = _tokens(70, seed=8)
    steps = [[9, 0], [1, 1], [0, 23], [30, 1], [1, 17]]
    done = np.zeros(B, int)
    for n in map(np.array, steps):
        rows = lambda y: jnp.stack([jnp.pad(y[b, done[b]:done[b] + n[b]], [(0, n.max() - n[b]), (0, 0), (0, 0)])
                                    for b in range(B)])
        paged = nsa.append_to_cache(paged, rows(k), rows(v), lens=n)
        contiguous = nsa.append_to_cache(contiguous, rows(k), rows(v), lens=n)
        done += n
    np.testing.assert_array_equal(np.asarray(paged.lens), done)
    _assert_holds(contiguous, k, v, done, l, d)
    for got, want, per_row in zip(sequences(paged), sequences(contiguous), (1, 1, d, d)):
        for b, n in enumerate(done):
            rows = n if per_row == 1 else _complete(n, l, d)  # those written
            np.testing.assert_array_equal(np.asarray(got[b, :rows]), np.asarray(want[b, :rows]))
            owned = sum(page >= 0 for page in table[b]) * PAGE // per_row  # the rows of the sequence's own pages
            assert np.all(np.isnan(np.asarray(got[b, rows:owned]))), f"sequence {b}: a row past it was written"
    owned = np.unique([p for row in table for p in row if p >= 0])
    free = np.setdiff1d(np.arange(13), owned)
    for x in (paged.k, paged.v, paged.k_cmp, paged.v_cmp):
        assert np.all(np.isnan(np.asarray(x[free])))


def test_paged_append_under_jit_is_in_place_and_compiles_once():
    """With the paged cache donated the compiled step aliases every buffer to its output, and one compilation
    serves every length, every count of new tokens and every page table."""
    k, v = _tokens(8, seed=9)
    cache = _paged([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    chex.clear_trace_counter()
    step = jax.jit(chex.assert_max_traces(lambda c, k, v, n: nsa.append_to_cache(c, k, v, lens=n), n=1),
                   donate_argnums=0)
    n = jnp.asarray([3, 8], jnp.int32)
    compiled = step.lower(cache, k, v, n).compile().as_text()
    aliased = re.findall(r"\{(\d+)\}: \((\d+), \{\}, (?:may|must)-alias\)", compiled.split("entry_computation_layout")[0])
    assert sorted(aliased) == [(str(i), str(i)) for i in range(len(jax.tree_util.tree_leaves(cache)))], aliased
    for counts, table in (([3, 8], None), ([0, 5], [[12, 1, 2, 3, 4], [5, 6, 7, 8, 9]]), ([8, 0], None)):
        if table is not None:
            cache = cache.replace(page_table=jnp.asarray(table, jnp.int32))
        old = cache
        cache = step(cache, k, v, jnp.asarray(counts, jnp.int32))
        assert old.k.is_deleted()
    np.testing.assert_array_equal(np.asarray(cache.lens), [11, 13])


def test_paged_caches_and_ragged_steps_raise_clear_errors():
    k, v = _tokens(16)
    cache = _paged([[0, 1, -1, -1, -1], [2, -1, -1, -1, -1]])
    with pytest.raises(ValueError, match=r"sequence 1 writes its rows 0 ... 16 \(pages 0 ... 1 of its page_table row\), "
                                         r"but cache.page_table\[1\] holds \[2, -1\] there"):
        nsa.append_to_cache(cache, jnp.concatenate([k, k], 1)[:, :17], jnp.concatenate([v, v], 1)[:, :17])
    with pytest.raises(ValueError, match=r"page_size must be a multiple of compress_stride = 8 .*, got page_size = 12"):
        nsa.empty_paged_cache(4, 12, B, 2, H, DK, block_size=BS)
    with pytest.raises(ValueError, match=r"cache.lens must have shape \[B\] \(B from cache.page_table\) = \(2,\)"):
        nsa.append_to_cache(cache.replace(lens=jnp.zeros(3, jnp.int32)), k, v)
    with pytest.raises(ValueError, match=r"appending 16 tokens past the cache's capacity N = 80: cache.lens\[0\] = 70"):
        nsa.append_to_cache(cache.replace(lens=jnp.asarray([70, 0], jnp.int32),
                                          page_table=jnp.asarray([[0, 1, 3, 4, 5], [2, -1, -1, -1, -1]], jnp.int32)),
                            k, v)
    with pytest.raises(ValueError, match=r"lens must lie in \[0, k.shape\[1\]\] = \[0, 16\], got lens\[0\] = 17"):
        nsa.append_to_cache(cache, k, v, lens=[17, 0])
    cache = nsa.append_to_cache(cache, k, v, lens=[16, 3])
    q = jnp.zeros((B, 16, 4, DK), jnp.float32)
    with pytest.raises(ValueError, match=r"q_lens\[1\] = 4 queries must be tokens of sequence 1, which has "
                                         r"cache.lens\[1\] = 3"):
        nsa.attention(q, cache=cache, q_lens=[16, 4])
    with pytest.raises(ValueError, match=r"q_lens must lie in \[0, T = q.shape\[1\]\] = \[0, 16\], got q_lens\[0\] = 17"):
        nsa.attention(q, cache=cache, q_lens=[17, 3])
    with pytest.raises(ValueError, match=r"q_lens \(a ragged step: .*\) needs the sequences' lengths: pass cache= or "
                                         r"kv_lens="):
        nsa.attention(q, k, v, q_lens=[16, 3])
    with pytest.raises(ValueError, match=r"q_lens .* and cu_seqlens .* cannot be given together"):
        nsa.attention(q[:1], k[:1], v[:1], kv_lens=[16], cu_seqlens=[0, 16], q_lens=[16])


def test_ragged_step_gradients():
    """Gradients of a ragged chunk step (3, 0 and 7 queries of sequences of 10, 4 and 7 tokens in a cache whose
    rows past them are NaN; q of 8 rows): those of each sequence's queries and keys equal the whole sequence's,
    and none reaches the padding rows of q or the rows past each sequence."""
    x = Inputs((3, 10, 6, H, DK, DV, BS), "float32", seed=10)
    lens, q_lens, T = np.array([10, 4, 7]), np.array([3, 0, 7]), 8
    g = [gi[0] for gi in x.gates]
    pad = np.arange(10)[None, :, None, None] >= lens[:, None, None, None]
    k, v = (jnp.where(pad, jnp.nan, y) for y in (x.k, x.v))
    rows = lambda y: jnp.stack([jnp.pad(y[b, n - m:n], [(0, T - m)] + [(0, 0)] * (y.ndim - 2))
                                for b, (n, m) in enumerate(zip(lens, q_lens))])
    kw = dict(block_counts=2, block_size=BS, window_size=5)

    def loss(q, k, v, *gates):
        o = nsa.attention(q, k, v, **dict(zip(("g_cmp", "g_slc", "g_swa"), gates)), kv_lens=lens, q_lens=q_lens, **kw)
        return jnp.sum(o * rows(x.do))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(rows(x.q), k, v, *map(rows, g))
    for b, (n, m) in enumerate(zip(lens, q_lens)):
        np.testing.assert_array_equal(np.asarray(grads[0][b, m:]), 0.0)  # the padding rows of q
        np.testing.assert_array_equal(np.asarray(grads[3][b, m:]), 0.0)  # and of g_cmp
        for got in grads[1:3]:
            np.testing.assert_array_equal(np.asarray(got[b, n:]), 0.0)  # keys past the sequence
        one = lambda y: y[b:b + 1, :n]
        full_loss = lambda q, k, v: jnp.sum(nsa.attention(q, k, v, **dict(zip(("g_cmp", "g_slc", "g_swa"),
                                                                              map(one, g))), **kw)[:, n - m:]
                                            * x.do[b:b + 1, n - m:n])
        want = jax.grad(full_loss, argnums=(0, 1, 2))(one(x.q), one(x.k), one(x.v))
        assert_close(grads[0][b, :m], want[0][0, n - m:], 1e-5, f"dq[{b}]", 1e-2)
        assert_close(grads[1][b, :n], want[1][0], 1e-5, f"dk[{b}]", 1e-2)
        assert_close(grads[2][b, :n], want[2][0], 1e-5, f"dv[{b}]", 1e-2)


@pytest.mark.parametrize("l, d", [(8, 8), (16, 8)], ids=["l8-d8", "l16-d8"])
def test_a_paged_decode_step_equals_the_contiguous_one_with_its_gradients(l, d):
    """A decode step over a paged cache (pages in random order, NaN in every row no sequence wrote; one sequence
    ends mid-page, one on a page boundary) reads its window and selected blocks through the page table: its output
    equals the contiguous cache's bitwise (XLA), and so do the gradients of q, of every gate and of each
    sequence's rows of k, v, k_cmp, v_cmp (the pools' gradients read through the table); every other row of the
    pools (pages no sequence owns, rows past each sequence) gets exactly 0."""
    table = [[7, 2, 11, 0, 5], [3, 12, 9, -1, -1]]
    blocks = dict(block_size=BS, compress_block_size=l, compress_stride=d)
    lens = np.array([61, 32])
    k, v = _tokens(int(lens.max()), seed=11)
    fill = lambda cache: nsa.append_to_cache(cache, k, v, lens=lens)
    paged = fill(_paged(table, **blocks))
    contiguous = fill(nsa.empty_cache(B, N, H, DK, head_dim_v=DV, dtype=jnp.float32, **blocks))
    rng = np.random.default_rng(12)
    q, do = (jnp.asarray(rng.standard_normal((B, 1, 4, n)), jnp.float32) for n in (DK, DV))
    gates = [jnp.asarray(rng.uniform(size=(B, 1, 4)), jnp.float32) for _ in range(3)]

    def loss(q, cache, *gates):
        o = nsa.attention(q, cache=cache, **dict(zip(("g_cmp", "g_slc", "g_swa"), gates)), block_counts=3,
                          window_size=5, implementation="xla")
        return jnp.sum(o * do), o

    (_, o_paged), grads_paged = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3, 4), has_aux=True, allow_int=True))(
        q, paged, *gates)
    (_, o), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3, 4), has_aux=True, allow_int=True))(q, contiguous, *gates)
    assert np.all(np.isfinite(np.asarray(o)))
    np.testing.assert_array_equal(np.asarray(o_paged), np.asarray(o))
    for i in (0, 2, 3, 4):  # q and the gates
        np.testing.assert_array_equal(np.asarray(grads_paged[i]), np.asarray(grads[i]))
    dpaged, dcontiguous = grads_paged[1].replace(page_table=paged.page_table), grads[1]  # its table: float0
    pools = (dpaged.k, dpaged.v, dpaged.k_cmp, dpaged.v_cmp)
    for pool, got, want, per_row in zip(pools, sequences(dpaged), sequences(dcontiguous), (1, 1, d, d)):
        owned = np.zeros(pool.shape[0] * pool.shape[1], bool)  # the pool's rows some sequence wrote
        for b, n in enumerate(lens):
            rows = -(-n // per_row)
            np.testing.assert_array_equal(np.asarray(got[b, :rows]), np.asarray(want[b, :rows]))
            np.testing.assert_array_equal(np.asarray(want[b, rows:]), 0.0)
            page_rows = PAGE // per_row
            owned[(np.asarray(table[b])[:, None] * page_rows + np.arange(page_rows)).reshape(-1)[:rows]] = True
        np.testing.assert_array_equal(np.asarray(pool).reshape(-1, *pool.shape[2:])[~owned], 0.0)


def test_under_jit_an_append_counts_only_the_tokens_it_writes():
    """Under jit nothing can refuse a token without a row: a contiguous cache drops the tokens past its capacity,
    a paged cache those from the first row on no page of the pool (-1, a negative id, an id past it) on, even where
    a later entry has a page. Each returns the tokens written (its lengths grow by as much), writes nothing else
    (every other row keeps its NaN) and completes only the windows of tokens it wrote."""
    k, v = _tokens(20, seed=14)
    step = jax.jit(lambda cache, n: nsa.append_to_cache(cache, k, v, lens=n, return_written=True))
    contiguous = nsa.empty_cache(B, 24, H, DK, head_dim_v=DV, block_size=BS, dtype=jnp.float32)
    contiguous, written = step(contiguous.replace(lens=jnp.asarray([10, 0], jnp.int32)), jnp.asarray([20, 20]))
    np.testing.assert_array_equal(np.asarray(written), [14, 20])
    np.testing.assert_array_equal(np.asarray(contiguous.lens), [24, 20])
    table = [[0, 1, 2, 3, 4], [5, -1, 6, -3, 13]]  # sequence 1: a page, then none (-1), then page 6
    paged, written = step(_paged(table).replace(lens=jnp.asarray([10, 8], jnp.int32)), jnp.asarray([20, 20]))
    np.testing.assert_array_equal(np.asarray(written), [20, 8])
    np.testing.assert_array_equal(np.asarray(paged.lens), [30, 16])
    held = sequences(paged)
    for b, (start, n) in enumerate(((10, 20), (8, 8))):
        np.testing.assert_array_equal(np.asarray(held[0][b, start:start + n]), np.asarray(k[b, :n]))
    np.testing.assert_array_equal(np.asarray(held[0][1, :8]), np.nan)  # not written: rows before the append,
    np.testing.assert_array_equal(np.isnan(np.asarray(paged.k[6])), True)  # and the page after the hole
    np.testing.assert_array_equal(np.isnan(np.asarray(paged.k_cmp[5, 1])), False)  # tokens 8 ... 15: complete
    np.testing.assert_array_equal(np.isnan(np.asarray(paged.k_cmp[6])), True)


def test_gathered_pages_read_zeros_where_the_table_has_no_page():
    """Each sequence's rows gathered through the page table (the XLA paths' reads) are zeros on an entry with no
    page of the pool (-1, a negative id, an id past it), never the rows of the page such an id would clip to."""
    cache = _paged([[0, -1, 12, -7, 13], [12, 1, 2, 3, 4]])
    cache = cache.replace(k=jnp.ones_like(cache.k), v=jnp.ones_like(cache.v))
    k, v, k_cmp, _ = sequences(cache)
    rows = np.repeat(np.asarray([[1, 0, 1, 0, 0], [1, 1, 1, 1, 1]], bool), PAGE, axis=1)
    np.testing.assert_array_equal(np.asarray(k[..., 0, 0]), rows.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(v[..., 0, 0]), rows.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(np.asarray(k_cmp[..., 0, 0])), rows[:, ::BS])


def test_concrete_tables_are_checked_by_attention_and_append():
    """With concrete lengths and page table, nsa.attention refuses lengths that reach an entry with no page of the
    pool (under jit it reads nothing through it: the shared base's test_rows_without_a_page_are_never_read), and
    append_to_cache refuses two sequences writing one page, and a write to a page another sequence holds: its
    tokens' rows, or the compressed row of a window that starts on a shared page (l > d)."""
    k, v = _tokens(16, seed=15)
    q = jnp.zeros((B, 1, 4, DK), jnp.float32)
    cache = nsa.append_to_cache(_paged([[0, 1, -1, 3, 4], [5, 6, 7, 8, 9]]), k, v)
    with pytest.raises(ValueError, match=r"cache.lens\[0\] = 40 tokens reach entry 2 of cache.page_table\[0\] \(its "
                                         r"rows 32 ... 47\), which holds -1: no page of the pool \(0 <= id < P = 13\)"):
        nsa.attention(q, cache=cache.replace(lens=jnp.asarray([40, 16], jnp.int32)))
    with pytest.raises(ValueError, match=r"cache.page_table\[1\] \(its rows 16 ... 31\), which holds 13"):
        nsa.attention(q, cache=cache.replace(page_table=cache.page_table.at[1, 1].set(13),
                                             lens=jnp.asarray([16, 17], jnp.int32)))
    one = lambda table: _paged(table).replace(lens=jnp.asarray([16, 16], jnp.int32))
    with pytest.raises(ValueError, match=r"sequence 0 writes page 2 .*, which sequence 1 holds too \(its page_table row "
                                         r"maps page 2 below its length 17\)"):
        nsa.append_to_cache(one([[0, 2, -1, -1, -1], [1, 2, -1, -1, -1]]), k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match=r"sequence 1 writes page 0 .*, which sequence 0 holds too"):
        nsa.append_to_cache(one([[0, 2, -1, -1, -1], [1, 0, -1, -1, -1]]), k[:, :1], v[:, :1], lens=[0, 1])
    # a shared prefix page is read by both; with windows of 16 every 8 the window of tokens 8 ... 23 is stored in
    # the page of token 8, the shared one, which an append that completes it would write
    shared = [[0, 1, -1, -1, -1], [0, 2, -1, -1, -1]]
    blocks = dict(block_size=BS, compress_block_size=16, compress_stride=8)
    cache = _paged(shared, **blocks).replace(lens=jnp.asarray([16, 16], jnp.int32))
    nsa.append_to_cache(cache, k[:, :7], v[:, :7])  # tokens 16 ... 22: their own pages, no window complete
    with pytest.raises(ValueError, match=r"sequence 0 writes page 0 \(a token's row, or the compressed row of a window "
                                         r"whose first token lies there\), which sequence 1 holds too"):
        nsa.append_to_cache(cache, k[:, :8], v[:, :8])


def _phi(l, D, seed):
    """A learned compression of windows of l tokens (the example's phi, one layer): a position embedding of the
    window's slots, then tanh of a linear map of the flattened window [l * D] -> [D]; windows [B, R, l, H, D] ->
    [B, R, H, D]. Nothing like the windows' mean."""
    rng = np.random.default_rng(seed)
    position = jnp.asarray(rng.standard_normal((l, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((l * D, D)) / np.sqrt(l), jnp.float32)

    def phi(windows):
        x = jnp.moveaxis(windows + position[:, None], 2, 3)  # [B, R, H, l, D]
        return jnp.tanh(x.reshape(*x.shape[:3], l * D) @ w).astype(windows.dtype)

    return phi


# ragged steps after ragged prompts: decode (one token, or none for an idle sequence) and chunks that complete
# several windows at once
PROMPTS, STEPS = np.array([29, 3]), np.array([[1, 1], [1, 0], [1, 1], [13, 5], [0, 1], [1, 9]])


def _prompted(paged, k, v, phi, **blocks):
    """A cache holding the prompts, the first PROMPTS[b] tokens of k[b], v[b], compressed by phi: prefill_cache's,
    or a paged cache (pages in random order, NaN everywhere) they were appended to."""
    if paged:
        cache = _paged([[7, 2, 11, 0, 5], [3, 12, 9, 1, -1]], **blocks)
        return nsa.append_to_cache(cache, k[:, :PROMPTS.max()], v[:, :PROMPTS.max()], lens=PROMPTS, phi=phi)
    return nsa.prefill_cache(k[:, :PROMPTS.max()], v[:, :PROMPTS.max()], capacity=N, lens=PROMPTS, phi=phi, **blocks)


def _step_rows(y, done, n):
    """Sequence b's next n[b] rows of y [B, T, ...] (those after its first done[b]), right-padded to max(n)."""
    pad = [(0, 0)] * (y.ndim - 2)
    return jnp.stack([jnp.pad(y[b, done[b]:done[b] + n[b]], [(0, max(n) - n[b])] + pad) for b in range(B)])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("l, d", [(8, 8), (8, 4)], ids=["l8-d8", "l8-d4"])
def test_a_learned_phi_writes_its_rows_of_the_windows_each_append_completes(paged, l, d):
    """prefill_cache and append_to_cache with phi (a pair: Dk != Dv): after the prompts and each ragged step under
    jit, sequence b's compressed rows of its complete windows equal phi applied to nsa.compression_windows of its
    tokens (to float32 rounding: phi runs on other batch shapes), and the rows of windows not yet complete are
    untouched (empty_cache's zeros, the paged cache's NaN)."""
    blocks = dict(block_size=8, compress_block_size=l, compress_stride=d)
    phis = (_phi(l, DK, seed=20), _phi(l, DV, seed=21))
    k, v = _tokens(PROMPTS.max() + STEPS.sum(0).max(), seed=22)
    step = jax.jit(lambda c, k, v, n: nsa.append_to_cache(c, k, v, lens=n, phi=phis), donate_argnums=0)
    cache, done = _prompted(paged, k, v, phis, **blocks), PROMPTS
    for n in [None] + list(STEPS):
        if n is not None:
            cache = step(cache, _step_rows(k, done, n), _step_rows(v, done, n), jnp.asarray(n, jnp.int32))
            done = done + n
        k_cmp, v_cmp = sequences(cache)[2:]
        for b, length in enumerate(done):
            rows = _complete(length, l, d)
            for x_cmp, x, phi in ((k_cmp, k, phis[0]), (v_cmp, v, phis[1])):
                want = phi(nsa.compression_windows(x[b:b + 1, :length], block_size=l, stride=d)[0])[0, :rows]
                assert_close(x_cmp[b, :rows], want, 1e-6, f"sequence {b}'s compressed rows after {length} tokens")
                begun = np.asarray(x_cmp[b, rows:-(-length // d)])  # the rows of windows begun, not complete
                assert np.all(np.isnan(begun)) if paged else np.all(begun == 0)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_phi_trained_model_decodes_through_the_cache(paged):
    """A model trained with a learned phi (attention given k_cmp, v_cmp = phi of nsa.compression_windows), served
    through a cache filled with the same phi (prompts, then ragged decode steps and chunks under jit, the cache
    donated; windows of 8 tokens every 4, selection blocks of 16): each step's outputs equal the whole sequences'
    (the XLA implementation), whose compressed branch and block selection both read phi's rows; the means' outputs
    are far from them (the cache mean-pooled before phi could be passed)."""
    l, d, sel = 8, 4, 16
    blocks = dict(block_size=sel, compress_block_size=l, compress_stride=d)
    kw = dict(block_counts=2, window_size=6, implementation="xla")
    phis = (_phi(l, DK, seed=23), _phi(l, DV, seed=24))
    x = Inputs((B, PROMPTS.max() + STEPS.sum(0).max(), 4, H, DK, DV, sel), "float32", seed=25)
    gates = dict(zip(("g_cmp", "g_slc", "g_swa"), (g[0] for g in x.gates)))
    windows = lambda y: nsa.compression_windows(y, block_size=l, stride=d)[0]
    # each row of x one sequence (causal: a token's output is that of its sequence up to it)
    whole = jax.jit(lambda q, k, v, gates: nsa.attention(q, k, v, k_cmp=phis[0](windows(k)),
                                                         v_cmp=phis[1](windows(v)), **gates, **blocks, **kw))
    want, means = whole(x.q, x.k, x.v, gates), nsa.attention(x.q, x.k, x.v, **gates, **blocks, **kw)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, q, k, v, gates, n):
        cache = nsa.append_to_cache(cache, k, v, lens=n, phi=phis)
        return cache, nsa.attention(q, cache=cache, q_lens=n, **gates, **kw)

    cache, done = _prompted(paged, x.k, x.v, phis, **blocks), PROMPTS
    for n in STEPS:
        rows = functools.partial(_step_rows, done=done, n=n)
        cache, o = step(cache, rows(x.q), rows(x.k), rows(x.v), {name: rows(g) for name, g in gates.items()},
                        jnp.asarray(n, jnp.int32))
        for b in range(B):
            assert_close(o[b, :n[b]], rows(want)[b, :n[b]], TOLERANCE["float32"], f"step {done}: sequence {b}")
            np.testing.assert_array_equal(np.asarray(o[b, n[b]:]), 0.0)
        done = done + n
    assert max(float(jnp.max(jnp.abs(want[b, :n] - means[b, :n]))) for b, n in enumerate(done)) > 0.1


def test_a_bad_phi_raises_naming_it():
    """phi neither a callable nor a pair of them, rows of another shape or dtype than the cache's: errors that
    name phi (and the keys or values); k_cmp given with cache= points at phi."""
    k, v = _tokens(8)
    cache = nsa.empty_cache(B, N, H, DK, head_dim_v=DV, block_size=BS, dtype=jnp.float32)
    slots = lambda w: jnp.mean(w, axis=2)  # any D: one phi for both
    with pytest.raises(TypeError, match=r"phi must be None .* or a pair \(phi_k, phi_v\) of them, got 3"):
        nsa.append_to_cache(cache, k, v, phi=3)
    with pytest.raises(TypeError, match=r"phi must be None .*, got \(<function"):
        nsa.prefill_cache(k, v, block_size=BS, capacity=N, phi=(slots,))
    with pytest.raises(ValueError, match=r"phi \(for the values\)'s rows must have shape \[B, R, H, D\] \(windows "
                                         r"\[B, R, l, H, D\] = \(2, 1, 8, 2, 8\)\) = \(2, 1, 2, 8\), got "
                                         r"\(2, 1, 2, 16\)"):
        nsa.append_to_cache(cache, k, v, phi=(slots, lambda w: jnp.zeros(w.shape[:2] + w.shape[3:4] + (DK,))))
    with pytest.raises(TypeError, match=r"phi \(for the keys\) must return the cache's dtype float32 .*, got bfloat16"):
        nsa.append_to_cache(cache, k, v, phi=lambda w: slots(w).astype(jnp.bfloat16))
    with pytest.raises(TypeError, match=r"phi \(for the keys\) must return an array, .* got tuple"):
        nsa.append_to_cache(cache, k, v, phi=lambda w: (slots(w),))
    cache = nsa.append_to_cache(cache, k, v, phi=slots)  # one phi for the keys and the values: here the means
    for x_cmp, x in ((cache.k_cmp, k), (cache.v_cmp, v)):
        assert_close(x_cmp[:, 0], nsa.compress(x, block_size=BS)[:, 0], 1e-6, "the means as phi")
    with pytest.raises(ValueError, match=r"pass k_cmp and v_cmp or cache, not both \(a learned compression's rows go "
                                         r"into the cache: `append_to_cache\(..., phi=...\)`"):
        nsa.attention(jnp.zeros((B, 1, 4, DK)), cache=cache, k_cmp=cache.k_cmp, v_cmp=cache.v_cmp)
