"""Self-tests of the NumPy NSA oracle on tiny, hand-computable cases."""

import numpy as np
import pytest

try:  # works whether or not tests/ becomes a package
    from tests import oracle
except ImportError:  # pragma: no cover
    import oracle


def _rng(seed=0):
    return np.random.default_rng(seed)


def _qkv(B=1, T=8, HQ=2, H=1, Dk=4, Dv=4, seed=0):
    r = _rng(seed)
    return (r.standard_normal((B, T, HQ, Dk)), r.standard_normal((B, T, H, Dk)),
            r.standard_normal((B, T, H, Dv)))


def _dense_causal(q, k, v, scale, window=None):
    """Independent vectorised causal (optionally banded) attention."""
    B, T, HQ, _ = q.shape
    G = HQ // k.shape[2]
    kk, vv = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    s = scale * np.einsum("bthd,bshd->bhts", q, kk)
    mask = np.tril(np.ones((T, T), bool))
    if window is not None:
        mask &= np.triu(np.ones((T, T), bool), -(window - 1))
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, vv)


# ----------------------------------------------------------------- compress
def test_compress_partial_block_mean():
    x = np.arange(5.0).reshape(1, 5, 1, 1)
    out = oracle.compress(x, block_size=2)
    assert out.shape == (1, 3, 1, 1)
    np.testing.assert_array_equal(out[0, :, 0, 0], [0.5, 2.5, 4.0])


def test_compress_cu_seqlens_packing():
    x = np.arange(5.0).reshape(1, 5, 1, 1)
    # sequences [0,1,2] and [3,4]; an empty sequence in between changes nothing
    for cu in ([0, 3, 5], [0, 3, 3, 5]):
        out = oracle.compress(x, block_size=2, cu_seqlens=np.array(cu))
        assert out.shape == (1, 3, 1, 1)
        np.testing.assert_array_equal(out[0, :, 0, 0], [0.5, 2.0, 3.5])


# ----------------------------------------------------- compressed attention
def test_compressed_attention_hand():
    bs, T = 4, 8
    q, _, _ = _qkv(T=T, HQ=3, H=1, Dk=4)
    r = _rng(1)
    k_cmp, v_cmp = r.standard_normal((1, 2, 1, 4)), r.standard_normal((1, 2, 1, 3))
    o, lse = oracle.compressed_attention(q, k_cmp, v_cmp, block_size=bs, scale=0.5)
    assert o.shape == (1, T, 3, 3) and lse.shape == (1, T, 3)
    # t = 0..2: nothing complete yet
    np.testing.assert_array_equal(o[0, :3], 0.0)
    assert np.all(np.isneginf(lse[0, :3]))
    # t = 3..6: exactly block 0
    for t in range(3, 7):
        for j in range(3):
            np.testing.assert_allclose(o[0, t, j], v_cmp[0, 0, 0])
            np.testing.assert_allclose(lse[0, t, j], 0.5 * q[0, t, j] @ k_cmp[0, 0, 0])
    # t = 7: blocks 0 and 1
    for j in range(3):
        s = 0.5 * k_cmp[0, :, 0] @ q[0, 7, j]
        p = np.exp(s) / np.exp(s).sum()
        np.testing.assert_allclose(o[0, 7, j], p @ v_cmp[0, :, 0])
        np.testing.assert_allclose(lse[0, 7, j], np.log(np.exp(s).sum()))


def test_compressed_attention_padding_rows_unread():
    q, k, v = _qkv(T=8, HQ=2, H=1)
    kc, vc = oracle.compress(k, block_size=4), oracle.compress(v, block_size=4)
    pad = lambda a: np.concatenate([a, 1e6 * np.ones_like(a)], axis=1)
    o1, l1 = oracle.compressed_attention(q, kc, vc, block_size=4)
    o2, l2 = oracle.compressed_attention(q, pad(kc), pad(vc), block_size=4)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)


def test_compressed_attention_block_size_one_is_causal_attention():
    q, k, v = _qkv(B=2, T=7, HQ=6, H=2, Dk=4, Dv=3)
    o, lse = oracle.compressed_attention(q, oracle.compress(k, block_size=1),
                                         oracle.compress(v, block_size=1), block_size=1)
    np.testing.assert_allclose(o, _dense_causal(q, k, v, 0.5), atol=1e-12)
    assert np.all(np.isfinite(lse))


# ------------------------------------------------------------ select_blocks
def test_select_forced_blocks_and_ties():
    bs, T = 2, 12
    q, _, _ = _qkv(T=T, HQ=2, H=1)
    k_cmp = np.ones((1, 6, 1, 4))  # identical keys -> all scores tie
    idx = oracle.select_blocks(q, k_cmp, block_counts=8, block_size=bs)
    assert idx.dtype == np.int32 and idx.shape == (1, T, 1, 6)  # 8 slots capped at the 6 blocks of T = 12
    row = lambda t: idx[0, t, 0].tolist()
    assert row(0) == [0] + [-1] * 5                   # cur = 0
    assert row(2) == [1, 0] + [-1] * 4                # cur = 1: 1, 0
    assert row(4) == [2, 1, 0] + [-1] * 3             # cur = 2: 2, 1, 0
    assert row(10) == [5, 4, 0, 1, 2, 3]              # ties -> lower id first
    assert row(11) == [5, 4, 0, 1, 2, 3]
    # block_counts < 3: forced rank cur, cur - 1, 0
    for S, want in [(1, [5]), (2, [5, 4]), (3, [5, 4, 0])]:
        got = oracle.select_blocks(q, k_cmp, block_counts=S, block_size=bs)
        assert got[0, 10, 0].tolist() == want
    assert oracle.select_blocks(q, k_cmp, block_counts=1, block_size=bs)[0, 2, 0].tolist() == [1]


def test_select_score_order():
    bs, T = 1, 8
    q = np.ones((1, T, 1, 1))
    # t = 7: cur = 7, forced 7, 6, 0; rest 1..5 ranked by k value
    vals = [0.0, 0.3, 0.1, 0.9, 0.5, 0.1, 0.0, 0.0]
    k_cmp = np.array(vals).reshape(1, T, 1, 1)
    idx = oracle.select_blocks(q, k_cmp, block_counts=8, block_size=bs, scale=1.0)
    assert idx[0, 7, 0].tolist() == [7, 6, 0, 3, 4, 1, 2, 5]   # 2 and 5 tie
    idx = oracle.select_blocks(q, k_cmp, block_counts=5, block_size=bs, scale=1.0)
    assert idx[0, 7, 0].tolist() == [7, 6, 0, 3, 4]


def test_select_group_mean_of_probabilities():
    # G = 2; block 1 = A, 2 = B, 3 = C; blocks 0, 4 forced/visible at t = 10.
    # mean of logits would rank A > B > C; mean of softmax probs ranks B > C > A.
    bs = 2
    q = np.zeros((1, 12, 2, 2))
    q[..., 0, :] = [1.0, 0.0]
    q[..., 1, :] = [0.0, 1.0]
    k_cmp = np.zeros((1, 6, 1, 2))
    k_cmp[0, 1, 0] = [2.5, 2.5]
    k_cmp[0, 2, 0] = [4.0, 0.0]
    k_cmp[0, 3, 0] = [0.0, 3.9]
    # hand-computed scores (visible blocks 0..4):
    z0 = np.exp(2.5) + np.exp(4.0) + 1 + 2
    z1 = np.exp(2.5) + 1 + np.exp(3.9) + 2
    sA = (np.exp(2.5) / z0 + np.exp(2.5) / z1) / 2
    sB = (np.exp(4.0) / z0 + 1 / z1) / 2
    sC = (1 / z0 + np.exp(3.9) / z1) / 2
    assert sB > sC > sA
    idx = oracle.select_blocks(q, k_cmp, block_counts=6, block_size=bs, scale=1.0)
    assert idx[0, 10, 0].tolist() == [5, 4, 0, 2, 3, 1]


# ------------------------------------------------------- selected attention
def test_selected_attention_single_key_and_ignored():
    bs, T = 4, 8
    q, k, v = _qkv(T=T, HQ=3, H=1, Dv=5)
    bi = np.full((1, T, 1, 3), -1, dtype=np.int32)
    bi[0, 4, 0] = [-1, 1, 2]            # block 2 > cur = 1 -> ignored; only key 4
    bi[0, 5, 0] = [3, -1, 2]            # nothing valid -> 0
    o = oracle.selected_attention(q, k, v, bi, block_size=bs)
    for j in range(3):
        np.testing.assert_allclose(o[0, 4, j], v[0, 4, 0])
    np.testing.assert_array_equal(o[0, 5], 0.0)
    np.testing.assert_array_equal(o[0, :4], 0.0)


def test_selected_attention_duplicate_block_counts_twice():
    bs, T = 4, 8
    q, k, v = _qkv(T=T, HQ=1, H=1)
    bi = np.full((1, T, 1, 3), -1, dtype=np.int32)
    bi[0, 4, 0] = [0, 0, 1]             # keys 0..3 twice, key 4 once
    o = oracle.selected_attention(q, k, v, bi, block_size=bs, scale=1.0)
    s = k[0, :5, 0] @ q[0, 4, 0]
    w = np.array([2, 2, 2, 2, 1]) * np.exp(s)
    np.testing.assert_allclose(o[0, 4, 0], (w / w.sum()) @ v[0, :5, 0])


def test_selected_attention_block_counts():
    bs, T = 2, 6
    q, k, v = _qkv(T=T, HQ=2, H=1)
    bi = np.tile(np.array([2, 0, 1], dtype=np.int32), (1, T, 1, 1))
    full = oracle.selected_attention(q, k, v, bi, block_size=bs)
    only_first = oracle.selected_attention(q, k, v, bi[..., :1], block_size=bs)
    np.testing.assert_array_equal(oracle.selected_attention(q, k, v, bi, block_counts=1, block_size=bs), only_first)
    np.testing.assert_array_equal(oracle.selected_attention(q, k, v, bi, block_counts=3, block_size=bs), full)
    counts = np.array([3, 1, 3, 1, 3, 1]).reshape(1, T, 1)
    mixed = oracle.selected_attention(q, k, v, bi, block_counts=counts, block_size=bs)
    np.testing.assert_array_equal(mixed[0, 0::2], full[0, 0::2])
    np.testing.assert_array_equal(mixed[0, 1::2], only_first[0, 1::2])
    # all blocks listed -> plain causal attention
    np.testing.assert_allclose(full, _dense_causal(q, k, v, 0.5), atol=1e-12)


# --------------------------------------------------------- sliding window
def test_swa_window_one_and_two():
    q, k, v = _qkv(T=6, HQ=6, H=2, Dk=4, Dv=5)
    o1 = oracle.sliding_window_attention(q, k, v, window_size=1)
    for j in range(6):
        np.testing.assert_allclose(o1[0, :, j], v[0, :, j // 3])
    o2 = oracle.sliding_window_attention(q, k, v, window_size=2, scale=1.0)
    t, j = 3, 4
    s = k[0, 2:4, 1] @ q[0, t, j]
    np.testing.assert_allclose(o2[0, t, j], (np.exp(s) / np.exp(s).sum()) @ v[0, 2:4, 1])
    np.testing.assert_array_equal(oracle.sliding_window_attention(q, k, v, window_size=0), 0.0)


def test_swa_matches_dense_band():
    q, k, v = _qkv(B=2, T=9, HQ=3, H=1, Dv=2)
    for w in (3, 9, 20):
        np.testing.assert_allclose(oracle.sliding_window_attention(q, k, v, window_size=w),
                                   _dense_causal(q, k, v, 0.5, window=w), atol=1e-12)


# -------------------------------------------------------------- attention
def test_attention_combination_and_gates():
    bs, T = 2, 8
    q, k, v = _qkv(T=T, HQ=4, H=2, Dk=4, Dv=3)
    r = _rng(3)
    g1, g2, g3 = (r.uniform(size=(1, T, 4)) for _ in range(3))
    kc, vc = oracle.compress(k, block_size=bs), oracle.compress(v, block_size=bs)
    idx = oracle.select_blocks(q, kc, block_counts=2, block_size=bs)
    o_cmp, _ = oracle.compressed_attention(q, kc, vc, block_size=bs)
    o_slc = oracle.selected_attention(q, k, v, idx, block_size=bs)
    o_swa = oracle.sliding_window_attention(q, k, v, window_size=3)
    kw = dict(block_counts=2, block_size=bs)
    got = oracle.attention(q, k, v, g_cmp=g1, g_slc=g2, g_swa=g3, window_size=3, **kw)
    want = g1[..., None] * o_cmp + g2[..., None] * o_slc + g3[..., None] * o_swa
    np.testing.assert_allclose(got, want, atol=1e-14)
    # missing gates of active branches weigh 1; g_swa ignored with window 0
    np.testing.assert_allclose(oracle.attention(q, k, v, window_size=3, **kw), o_slc + o_swa)
    np.testing.assert_allclose(oracle.attention(q, k, v, g_swa=g3, **kw), o_slc)
    # explicit block_indices are used as given
    np.testing.assert_allclose(oracle.attention(q, k, v, block_indices=idx, **kw), o_slc)


def test_attention_all_blocks_is_causal():
    q, k, v = _qkv(B=2, T=10, HQ=3, H=1, Dk=4, Dv=2)
    o = oracle.attention(q, k, v, block_counts=5, block_size=2)
    np.testing.assert_allclose(o, _dense_causal(q, k, v, 0.5), atol=1e-12)


# ------------------------------------------------------------- cu_seqlens
def test_cu_seqlens_equals_each_sequence_alone():
    bs, W, S = 4, 3, 3
    lens = [5, 0, 11, 7, 1]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(cu[-1])
    q, k, v = _qkv(T=T, HQ=6, H=2, Dk=4, Dv=5, seed=7)
    r = _rng(8)
    g1, g2, g3 = (r.uniform(size=(1, T, 6)) for _ in range(3))
    bi_rand = r.integers(-1, 5, size=(1, T, 2, 4)).astype(np.int32)

    kc = oracle.compress(k, block_size=bs, cu_seqlens=cu)
    vc = oracle.compress(v, block_size=bs, cu_seqlens=cu)
    assert kc.shape[1] == sum(-(-n // bs) for n in lens)
    kc_pad = np.concatenate([kc, 9.0 * np.ones((1, 3, 2, 4))], axis=1)
    vc_pad = np.concatenate([vc, 9.0 * np.ones((1, 3, 2, 5))], axis=1)
    o_cmp, lse_cmp = oracle.compressed_attention(q, kc_pad, vc_pad, block_size=bs, cu_seqlens=cu)
    idx = oracle.select_blocks(q, kc_pad, block_counts=S, block_size=bs, cu_seqlens=cu)
    o_slc = oracle.selected_attention(q, k, v, bi_rand, block_size=bs, cu_seqlens=cu)
    o_swa = oracle.sliding_window_attention(q, k, v, window_size=W, cu_seqlens=cu)
    o_all = oracle.attention(q, k, v, g_cmp=g1, g_slc=g2, g_swa=g3, block_counts=S,
                             block_size=bs, window_size=W, cu_seqlens=cu)

    coff = 0
    for i, n in enumerate(lens):
        a, b = int(cu[i]), int(cu[i + 1])
        nc = -(-n // bs)
        sl = lambda x: x[:, a:b]
        qi, ki, vi = sl(q), sl(k), sl(v)
        kci, vci = oracle.compress(ki, block_size=bs), oracle.compress(vi, block_size=bs)
        np.testing.assert_array_equal(kc[:, coff:coff + nc], kci)
        oc, lc = oracle.compressed_attention(qi, kci, vci, block_size=bs)
        np.testing.assert_allclose(sl(o_cmp), oc, atol=1e-14)
        np.testing.assert_array_equal(sl(lse_cmp), lc)
        alone = oracle.select_blocks(qi, kci, block_counts=S, block_size=bs)  # its slots capped at its own blocks
        np.testing.assert_array_equal(sl(idx), oracle.with_slots(alone, S))
        np.testing.assert_allclose(sl(o_slc), oracle.selected_attention(qi, ki, vi, sl(bi_rand), block_size=bs), atol=1e-14)
        np.testing.assert_allclose(sl(o_swa), oracle.sliding_window_attention(qi, ki, vi, window_size=W), atol=1e-14)
        np.testing.assert_allclose(
            sl(o_all),
            oracle.attention(qi, ki, vi, g_cmp=sl(g1), g_slc=sl(g2), g_swa=sl(g3), block_counts=S,
                             block_size=bs, window_size=W), atol=1e-14)
        coff += nc


def test_cu_seqlens_requires_batch_one():
    q, k, v = _qkv(B=2, T=4)
    with pytest.raises(ValueError):
        oracle.sliding_window_attention(q, k, v, window_size=2, cu_seqlens=np.array([0, 2, 4]))
