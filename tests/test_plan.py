"""nsa._plan, the XLA-side index planning every kernel family consumes, against plain NumPy constructions of the
same tables (loops over the documented definitions), on small shapes: packed sequences with an empty one, a KV
cache, -1, out-of-range and repeated selections, counts below S."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nsa import _plan
from nsa._varlen import cdiv, num_compressed_blocks, tokens, window_key_range

CU = np.array([0, 7, 7, 20, 29], np.int32)  # lengths 7, 0, 13, 9 (T = 29)


def _positions(T, cu=None, kv_lens=None):
    """[R, T] in-sequence positions and [R, T] sequence starts (R = B with kv_lens, else 1), by a loop."""
    if kv_lens is not None:
        pos = np.asarray(kv_lens)[:, None] - T + np.arange(T)[None]
        return pos, np.zeros_like(pos)
    if cu is None:
        return np.arange(T)[None], np.zeros((1, T), int)
    start = np.zeros(T, int)
    for a, b in zip(cu[:-1], cu[1:]):
        start[a:b] = a
    return (np.arange(T) - start)[None], start[None]


def _block_rows(TK, bs, cu=None):
    """[TK]: the block row (among a (b, h)'s NR) of each key row: its sequence's first block row + pos // bs."""
    rows, first = np.zeros(TK, int), 0
    bounds = [(0, TK)] if cu is None else list(zip(cu[:-1], cu[1:]))
    for a, b in bounds:
        rows[a:b] = first + (np.arange(b - a) // bs)
        first += cdiv(b - a, bs)
    return rows


def _selection(B, T, H, S, bs, cu=None, kv_lens=None, seed=0):
    """block_indices [B, T, H, S] with -1, past-current and repeated entries, counts [B, T, H] below S."""
    rng = np.random.default_rng(seed)
    pos = np.broadcast_to(_positions(T, cu, kv_lens)[0], (B, T))
    idx = rng.integers(-1, pos[..., None, None] // bs + 2, (B, T, H, S)).astype(np.int32)
    idx[..., 0] = pos[..., None] // bs
    idx[:, ::3, :, 1] = idx[:, ::3, :, 0]
    return idx, rng.integers(0, S + 1, (B, T, H)).astype(np.int32)


def _names(idx, counts, bs, cu=None, kv_lens=None):
    B, T, H, S = idx.shape
    pos, start = _positions(T, cu, kv_lens)
    out = np.full(idx.shape, _plan.NONE)
    for b, t, h, s in np.ndindex(idx.shape):
        r = b if kv_lens is not None else 0
        x = idx[b, t, h, s]
        if s < counts[b, t, h] and 0 <= x <= pos[r, t] // bs:
            out[b, t, h, s] = start[r, t] + x * bs
    return out


SELECTIONS = {  # B, T, TK, H, S, block_size, cu_seqlens, kv_lens
    "batch": (2, 20, 20, 2, 3, 4, None, None),
    "packed": (1, 29, 29, 1, 4, 4, CU, None),
    "cache": (2, 6, 40, 2, 3, 8, None, np.array([40, 17], np.int32)),
}


@pytest.fixture(params=SELECTIONS, ids=SELECTIONS)
def selection(request):
    B, T, TK, H, S, bs, cu, kv_lens = SELECTIONS[request.param]
    idx, counts = _selection(B, T, H, S, bs, cu, kv_lens)
    jcu = None if cu is None else jnp.asarray(cu)
    jkv = None if kv_lens is None else jnp.asarray(kv_lens)
    names = np.asarray(_plan.block_names(jnp.asarray(idx), jnp.asarray(counts), jcu, jkv, block_size=bs))
    return dict(B=B, T=T, TK=TK, H=H, S=S, bs=bs, cu=cu, kv=kv_lens, jcu=jcu, jkv=jkv, idx=idx, counts=counts,
                names=names)


def test_padded_and_padded_ranges():
    x = np.arange(6).reshape(2, 3)
    np.testing.assert_array_equal(_plan.padded(jnp.asarray(x), 1, 5), np.pad(x, [(0, 0), (0, 2)]))
    assert _plan.padded(x, 1, 3) is x
    lo, hi = _plan.padded_ranges(jnp.asarray(x), jnp.asarray(x + 1), 5)
    np.testing.assert_array_equal(lo, np.pad(x, [(0, 0), (0, 2)], constant_values=1))
    np.testing.assert_array_equal(hi, np.pad(x + 1, [(0, 0), (0, 2)], constant_values=0))


def test_bands_and_band():
    rng = np.random.default_rng(1)
    R, N, n, tile = 2, 12, 3, 5  # 3 tiles of 4 rows, tiles of 5 on the other side
    first = rng.integers(0, 20, (R, N))
    last = first + rng.integers(-3, 8, (R, N))  # some rows see nothing (first > last)
    last[0, 4:8] = first[0, 4:8] - 1  # a tile that sees nothing
    table = np.asarray(_plan.bands(jnp.asarray(first), jnp.asarray(last), n, tile))
    for r, i in np.ndindex(R, n):
        rows = range(i * N // n, (i + 1) * N // n)
        seen = [j for j in rows if first[r, j] <= last[r, j]]
        want = (min(first[r, j] for j in seen) // tile, max(last[r, j] for j in seen) // tile) if seen else (0, -1)
        assert _plan.band(table, r, i, n) == want, (r, i)


def test_packed_heads():
    B, T, H, G, D = 2, 3, 2, 4, 5
    x = np.random.default_rng(0).standard_normal((B, T, H * G, D)).astype(np.float32)
    p = np.asarray(_plan.packed(jnp.asarray(x), G))
    for b, t, h, g in np.ndindex(B, T, H, G):
        np.testing.assert_array_equal(p[b, t * G + g, h], x[b, t, h * G + g])
    np.testing.assert_array_equal(_plan.unpacked(jnp.asarray(p), G), x)
    q, k = jnp.zeros((B, T, H * G, D)), jnp.zeros((B, T, H, D))
    assert _plan.packs(q, k, jnp.zeros((B, T))) == G and _plan.packs(q, k, jnp.zeros((T,))) == 1
    assert _plan.packs(q, q, jnp.zeros((B, T))) == 1


def test_packed_attend_runs_per_token_rows():
    """With per-row ranges the kernel sees G rows per token, each with its token's lo and hi; the results come
    back per query head, as a kernel run on the unpacked heads would give them (here, a toy kernel)."""
    B, T, H, G, D = 2, 3, 2, 3, 4
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, H * G, D)), jnp.float32)
    k = jnp.zeros((B, 8, H, D))
    lo, hi = (jnp.asarray(rng.integers(0, 8, (B, T)), jnp.int32) for _ in range(2))
    attend = lambda q, k, v, lo, hi: (q + lo[:, :, None, None], q.sum(-1) * hi[:, :, None])
    o, lse = _plan.packed_attend(attend, q, k, k, lo, hi)
    np.testing.assert_allclose(o, q + lo[:, :, None, None])
    np.testing.assert_allclose(lse, q.sum(-1) * hi[:, :, None])
    seen = {}

    def backward(q, k, v, lo, hi, o, lse, do, dlse, query_span):
        seen["span"] = query_span
        return q * 2, k, v

    dq, _, _ = _plan.packed_attend_backward(backward, q, k, k, lo, hi, o, lse, q, None, query_span=5)
    np.testing.assert_allclose(dq, q * 2)
    assert seen["span"] == 5 * G


def test_window_keys_cut_a_long_cache():
    """A decode step of T = 2 queries with a window of 4 over a 20-row cache: each batch row's k and v cut to the
    L = 5 rows its windows span (from kv_lens - L, or 0), lo and hi the window's ranges over them; window_uncut
    scatters gradients back to those rows."""
    T, TK, W = 2, 20, 4
    lens = np.array([20, 9, 3], np.int32)
    k = np.random.default_rng(0).standard_normal((3, TK, 1, 2)).astype(np.float32)
    q = jnp.zeros((3, T, 1, 2))
    kc, vc, lo, hi, span, start = _plan.window_keys(q, jnp.asarray(k), jnp.asarray(-k), None, jnp.asarray(lens), W)
    L = T + W - 1
    want_start = np.maximum(lens - L, 0)
    np.testing.assert_array_equal(start, want_start)
    assert span == W and kc.shape == (3, L, 1, 2)
    for b in range(3):
        np.testing.assert_array_equal(kc[b], k[b, want_start[b]:want_start[b] + L])
        np.testing.assert_array_equal(vc[b], -k[b, want_start[b]:want_start[b] + L])
    want_lo, want_hi = window_key_range(T, W, None, jnp.asarray(lens - want_start))
    np.testing.assert_array_equal(lo, want_lo)
    np.testing.assert_array_equal(hi, want_hi)
    dk, _ = _plan.window_uncut(jnp.asarray(k), jnp.asarray(k), jnp.ones_like(kc), jnp.ones_like(kc), start)
    for b in range(3):
        assert np.all(np.asarray(dk)[b, want_start[b]:want_start[b] + L] == 1)
        assert np.sum(np.asarray(dk)[b]) == L * 2
    short = _plan.window_keys(jnp.zeros((1, 6, 1, 2)), jnp.asarray(k[:1, :6]), jnp.asarray(k[:1, :6]), None, None, 10)
    assert short[5] is None and short[4] == 6 and short[0].shape[1] == 6  # no cache: no cut, W = min(10, TK)


def test_num_candidates_and_row_offsets():
    assert _plan.num_candidates(100, 3, 16, None) == 7
    assert _plan.num_candidates(2, 30, 16, jnp.zeros(1)) == 30
    np.testing.assert_array_equal(_plan.row_offsets(None, 5), [0])
    np.testing.assert_array_equal(_plan.row_offsets(jnp.array([9, 5]), 5), [4, 0])


def test_kernel_delta_reads_do_as_the_kernel():
    rng = np.random.default_rng(0)
    o, do = (rng.standard_normal((1, 3, 2, 8)).astype(np.float32) for _ in range(2))
    bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(_plan.rounded(jnp.asarray(o), jnp.bfloat16), bf16(o))
    np.testing.assert_array_equal(_plan.rounded(jnp.asarray(o), jnp.float32), o)
    want = np.sum(bf16(o) * bf16(do), axis=-1)
    np.testing.assert_allclose(_plan.kernel_delta(jnp.asarray(o), jnp.asarray(do), jnp.bfloat16), want, rtol=1e-6)
    lse = np.array([[[0.5, -np.inf]] * 3], np.float32)
    dlse = np.ones((1, 3, 2), np.float32)
    got = _plan.kernel_delta(jnp.asarray(o), jnp.asarray(do), jnp.float32, jnp.asarray(lse), jnp.asarray(dlse))
    np.testing.assert_allclose(got, np.sum(o * do, -1) - np.where(np.isfinite(lse), 1.0, 0.0), rtol=1e-6)


def test_check_selected_names_the_argument():
    q, k = jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="q: expected a multiple of k's 2 KV heads, got 3"):
        _plan.check_selected(q, k, jnp.zeros((1, 8, 2, 1), jnp.int32), 4)
    with pytest.raises(ValueError, match="block_indices: expected shape"):
        _plan.check_selected(k, k, jnp.zeros((1, 8, 1, 1), jnp.int32), 4)
    with pytest.raises(ValueError, match="block_size: expected a positive int, got 0"):
        _plan.check_selected(k, k, jnp.zeros((1, 8, 2, 1), jnp.int32), 0)


def test_block_names(selection):
    s = selection
    np.testing.assert_array_equal(s["names"], _names(s["idx"], s["counts"], s["bs"], s["cu"], s["kv"]))


def _tile_tables(s, tile):
    """tile_names, tile_unions, tile_starts of the selection by _plan, and the same by loops."""
    B, T, H, S = s["names"].shape
    nt = cdiv(T, tile)
    offsets = _plan.row_offsets(s["jkv"], T)
    names = np.asarray(_plan.tile_names(jnp.asarray(s["names"]), tile))
    size = min(min(T, tile) * S, num_compressed_blocks(s["TK"], s["bs"], s["jcu"]))
    union, last, count = (np.asarray(x) for x in _plan.tile_unions(jnp.asarray(names), offsets, size))
    starts = np.asarray(_plan.tile_starts(offsets, (B, H, nt), tile))
    off = np.broadcast_to(np.asarray(offsets), (B,))
    for b, h, i in np.ndindex(B, H, nt):
        tokens_ = range(i * tile, min((i + 1) * tile, T))
        want_names = np.full((tile, S), _plan.NONE)
        for j, t in enumerate(tokens_):
            want_names[j] = s["names"][b, t, h]
        np.testing.assert_array_equal(names[b, h, i], want_names)
        listed = {}
        for t in tokens_:
            for x in s["names"][b, t, h]:
                if x != _plan.NONE:
                    listed[x] = off[b] + t  # the last token listing it
        xs = sorted(listed)
        assert count[b, h, i] == len(xs) <= size
        np.testing.assert_array_equal(union[b, h, i, :len(xs)], xs)
        assert np.all(union[b, h, i, len(xs):] == _plan.PAST)
        np.testing.assert_array_equal(last[b, h, i, :len(xs)], [listed[x] for x in xs])
        assert starts[b, h, i] == off[b] + i * tile
    return union, last, count


@pytest.mark.parametrize("tile", [1, 4, 8])
def test_tile_names_unions_and_starts(selection, tile):
    _tile_tables(selection, tile)


@pytest.mark.parametrize("tile", [1, 4])
def test_union_share(selection, tile):
    """The tiles' distinct names over the names their tokens list, both summed over the tiles, by a loop; 1 where
    no two tokens of a tile share a block (tile 1 and no repeated slot)."""
    names = np.asarray(_plan.tile_names(jnp.asarray(selection["names"]), tile))
    distinct = sum(len(set(x.ravel()) - {_plan.NONE}) for x in names.reshape(-1, *names.shape[3:]))
    listed = np.sum(names != _plan.NONE)
    np.testing.assert_allclose(float(_plan.union_share(jnp.asarray(names))), distinct / listed, rtol=1e-6)
    lone = np.arange(4 * 16, dtype=np.int32).reshape(1, 1, 4, 1, 16)  # every slot its own block
    assert float(_plan.union_share(jnp.asarray(lone))) == 1.0
    shared = np.broadcast_to(lone[:, :, :1], (1, 1, 4, 1, 16)).reshape(1, 1, 1, 4, 16)  # 4 tokens, 16 blocks
    assert float(_plan.union_share(jnp.asarray(shared))) == 0.25


def test_tile_lists(selection):
    """Every (tile, union block) entry keyed by its list (b * H + h) * NR + block row, stably sorted: per list the
    tiles that list the block, in tile order, with the block's name and its last key row."""
    s, tile = selection, 4
    union, last, _ = _tile_tables(s, tile)
    B, H, nt, U = union.shape
    NR = num_compressed_blocks(s["TK"], s["bs"], s["jcu"])
    rows = _block_rows(s["TK"], s["bs"], s["cu"])
    offsets, tiles, name, lasts = (np.asarray(x) for x in _plan.tile_lists(
        jnp.asarray(union), jnp.asarray(last), s["jcu"], num_keys=s["TK"], block_size=s["bs"]))
    lists = [[] for _ in range(B * H * NR)]
    for b, h, i, u in np.ndindex(B, H, nt, U):
        x = union[b, h, i, u]
        if x != _plan.PAST:
            lists[(b * H + h) * NR + rows[x]].append((i, x, last[b, h, i, u]))
    np.testing.assert_array_equal(offsets, np.cumsum([0] + [len(entries) for entries in lists]))
    for l, entries in enumerate(lists):
        got = list(zip(tiles[offsets[l]:offsets[l + 1]], name[offsets[l]:offsets[l + 1]],
                       lasts[offsets[l]:offsets[l + 1]]))
        assert got == entries, l


def test_token_lists(selection):
    """Each token's slots naming one block merged into one entry (times: how many), keyed by list, stably sorted:
    per list the (b * H + h, token, times, name) of the tokens that list the block, in token order."""
    s = selection
    B, T, H, S = s["names"].shape
    NR = num_compressed_blocks(s["TK"], s["bs"], s["jcu"])
    rows = _block_rows(s["TK"], s["bs"], s["cu"])
    offsets, bh, token, times, name = (np.asarray(x) for x in _plan.token_lists(
        jnp.asarray(s["names"]), s["jcu"], num_keys=s["TK"], block_size=s["bs"]))
    assert token.shape == (B * T * H * min(S, NR),)
    lists = [[] for _ in range(B * H * NR)]
    for b, t, h in np.ndindex(B, T, H):
        xs, n = np.unique([x for x in s["names"][b, t, h] if x != _plan.NONE], return_counts=True)
        for x, m in zip(xs, n):
            lists[(b * H + h) * NR + rows[x]].append((b * H + h, t, m, x))
    np.testing.assert_array_equal(offsets, np.cumsum([0] + [len(entries) for entries in lists]))
    for l, entries in enumerate(lists):
        got = list(zip(*(a[offsets[l]:offsets[l + 1]] for a in (bh, token, times, name))))
        assert got == entries, l


def test_key_blocks_and_per_key_row():
    TK, bs, B, H, D = 29, 4, 1, 2, 3
    cu = jnp.asarray(CU)
    keys = tokens(TK, bs, cu)
    rows = _block_rows(TK, bs, CU)
    np.testing.assert_array_equal(_plan.key_blocks(keys, bs), rows)
    np.testing.assert_array_equal(_plan.key_blocks(keys, bs, jnp.array([[0, 8], [20, 28]])), rows[[[0, 8], [20, 28]]])
    NR = num_compressed_blocks(TK, bs, cu)
    sums = np.random.default_rng(0).standard_normal((B * H * NR, 8, 5)).astype(np.float32)
    got = np.asarray(_plan.per_key_row(jnp.asarray(sums), (B, TK, H, D), cu, block_size=bs))
    pos = _positions(TK, CU)[0][0]
    for b, r, h in np.ndindex(B, TK, H):
        np.testing.assert_array_equal(got[b, r, h], sums[(b * H + h) * NR + rows[r], pos[r] % bs, :D])


def test_segments():
    """Lists of lengths 0, 5, 1, 7 cut into segments of at most 3 entries, in list and entry order, then empty
    ones up to the static NL + ceil(E / 3)."""
    lengths = [0, 5, 1, 7]
    offsets = np.cumsum([0] + lengths).astype(np.int32)
    seg_offsets, seg_list, lo, hi = (np.asarray(x) for x in _plan.segments(jnp.asarray(offsets), 13, 3))
    want = [(l, a, min(a + 3, offsets[l + 1])) for l in range(4) for a in range(offsets[l], offsets[l + 1], 3)]
    np.testing.assert_array_equal(seg_offsets, np.cumsum([0] + [cdiv(n, 3) for n in lengths]))
    assert seg_list.shape == (4 + cdiv(13, 3),)
    assert list(zip(seg_list[:len(want)], lo[:len(want)], hi[:len(want)])) == want
    assert np.all(lo[len(want):] == hi[len(want):])


@pytest.mark.parametrize("cu", [None, CU], ids=["cache", "packed"])
def test_block_rows(cu):
    """Triton's key block rows: row r of each sequence's blocks covers [its first key, the sequence's end)."""
    TK, bs = 29, 4
    NR, start, end = (np.asarray(x) if i else x for i, x in
                      enumerate(_plan.block_rows(TK, bs, None if cu is None else jnp.asarray(cu))))
    bounds = [(0, TK)] if cu is None else list(zip(cu[:-1], cu[1:]))
    want = [(a + j * bs, b) for a, b in bounds for j in range(cdiv(b - a, bs))]
    assert NR == len(want) and list(zip(start, end)) == want


def test_query_lists():
    """Triton's inverted selections: list (b * H + h) * NR + row holds the tokens t (in order, once per slot) whose
    valid slots select that block row."""
    B, T, TK, H, S, bs, cu, _ = SELECTIONS["packed"]
    idx, counts = _selection(B, T, H, S, bs, cu)
    tok = tokens(T, bs, jnp.asarray(cu))
    NR = num_compressed_blocks(T, bs, cu)
    offsets, query_tok = (np.asarray(x) for x in _plan.query_lists(jnp.asarray(idx), jnp.asarray(counts), tok, B, T,
                                                                  H, NR, bs))
    pos, start = _positions(T, cu)
    rows = _block_rows(T, bs, cu)
    want = [[] for _ in range(B * H * NR)]
    for b, t, h, s in np.ndindex(idx.shape):
        x = idx[b, t, h, s]
        if s < counts[b, t, h] and 0 <= x <= pos[0, t] // bs:
            want[(b * H + h) * NR + rows[start[0, t]] + x].append(t)
    got = [query_tok[offsets[i]:offsets[i + 1]].tolist() for i in range(B * H * NR)]
    assert got == want


def test_under_jit_the_same():
    """The tables of a traced cu_seqlens (a static bound on the block rows) hold the same lists."""
    B, T, TK, H, S, bs, cu, _ = SELECTIONS["packed"]
    idx, counts = _selection(B, T, H, S, bs, cu)

    def lists(cu):
        names = _plan.block_names(jnp.asarray(idx), jnp.asarray(counts), cu, None, block_size=bs)
        return _plan.token_lists(names, cu, num_keys=TK, block_size=bs)

    eager, traced = lists(jnp.asarray(cu)), jax.jit(lists)(jnp.asarray(cu))
    n = int(eager[0][-1])
    assert int(traced[0][-1]) == n
    for a, b in zip(eager[1:], traced[1:]):
        np.testing.assert_array_equal(np.asarray(a)[:n], np.asarray(b)[:n])
