"""The index work of the Mosaic GPU selected-attention kernels (nsa/pallas/gpu/selected.py), on the CPU.

The kernels themselves need a Hopper GPU (tests/test_pallas_gpu.py runs the shared base on them; here they are
only exported for CUDA, by tests/test_pallas_gpu_export.py). Everything they read is built in XLA, and is
checked here: a float64 NumPy emulation of what each kernel computes from its tables (the tiles' unions,
`times`, `last`, the source rows of the blocks, the dk/dv token entries, segments and lists and the lse and
delta gathered into entry order, the re-laid blocks of packed sequences) must give the reference's outputs and
gradients, on hostile selections: -1 and out-of-range slots, a block listed twice, counts below S, packed
sequences with an empty one, a KV cache with NaN past each length, block sizes 8, 16 and 32, and G = 1, 3 and
16; the dk/dv tables also with segments of 5 entries (most segments then end in a step of fewer than TB tokens).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa import _plan
from nsa.pallas.gpu import selected as gpu

CU = np.array([0, 23, 23, 70, 100], np.int32)
CASES = {  # B, T, TK, HQ, H, Dk, Dv, block_size, S, cu_seqlens, kv_lens
    "G16": (1, 64, 64, 16, 1, 16, 16, 16, 4, None, None),
    "G3-dv8": (2, 50, 50, 3, 1, 16, 8, 16, 3, None, None),
    "G1-bs8": (1, 40, 40, 2, 2, 16, 32, 8, 5, None, None),
    "cu_seqlens": (1, 100, 100, 4, 2, 16, 16, 16, 3, CU, None),
    "cache": (2, 5, 90, 6, 2, 16, 16, 32, 3, None, (90, 41)),
    "S17-listed-17-times": (1, 40, 40, 3, 1, 16, 16, 16, 17, None, None),
}


def _case(name):
    B, T, TK, HQ, H, Dk, Dv, bs, S, cu, lens = CASES[name]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, HQ, Dk)).astype(np.float32)
    k = rng.standard_normal((B, TK, H, Dk)).astype(np.float32)
    v = rng.standard_normal((B, TK, H, Dv)).astype(np.float32)
    pos = np.broadcast_to(np.arange(T) if lens is None else np.asarray(lens)[:, None] - T + np.arange(T), (B, T))
    if cu is not None:
        pos = np.concatenate([np.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
    idx = (rng.random((B, T, H, S)) * (pos[..., None, None] // bs + 2)).astype(np.int32) - 1  # -1 .. past current
    idx[..., 0] = pos[..., None] // bs
    idx[:, ::3, :, 1] = idx[:, ::3, :, 0]  # a block listed twice
    idx[:, 1::4, :, -1] = 1 << 30
    counts = rng.integers(1, S + 1, (B, T, H)).astype(np.int32)
    if S >= 16:  # a token that lists its current block in all of its slots but the last, and block 0 there
        idx[:, 30], counts[:, 30] = (pos[:, 30] // bs)[:, None, None], S
        idx[:, 30, :, -1] = 0
    if lens is not None:  # a KV cache: NaN past each sequence
        for b, n in enumerate(lens):
            k[b, n:], v[b, n:] = np.nan, np.nan
    do = rng.standard_normal((B, T, HQ, Dv)).astype(np.float32)
    return (q, k, v, idx, counts, None if cu is None else jnp.asarray(cu), None if lens is None else
            jnp.asarray(lens, jnp.int32), bs, do)


def _reference(q, k, v, idx, counts, cu, lens, bs, do):
    f = lambda q, k, v: nsa.selected_attention(q, k, v, jnp.asarray(idx), block_counts=jnp.asarray(counts),
                                               block_size=bs, cu_seqlens=cu, kv_lens=lens, implementation="xla")
    with jax.enable_x64(True):
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
        o, vjp = jax.vjp(f, *args)
        return np.asarray(o), [np.asarray(g) for g in vjp(jnp.asarray(do, jnp.float64))]


def _block(rows, source, bk):
    """rows[source : source + bk] of a [R, ...] array, zero past its end (what a TMA copy reads)."""
    out = np.zeros((bk,) + rows.shape[1:])
    got = rows[source:source + bk]
    out[:len(got)] = got
    return out


def _mask(x, t0, times, rows, bk, *, gr, bits, bs):
    """The kernels' `_block_mask`, [rows, bk]: (visible, the log of the times listed; natural here, where the
    logits are, base 2 in the kernels)."""
    j = np.arange(rows)[:, None] // gr
    c = np.arange(bk)[None, :]
    m = (np.int64(times) & 0xFFFFFFFF) >> (bits * j) & ((1 << bits) - 1)
    visible = (m > 0) & (c < bs) & (x + c <= t0 + j)
    return visible, np.log(np.maximum(m, 1))


def _emulate(q, k, v, idx, counts, cu, lens, bs, do, segment):
    """What the forward and the dk/dv kernels compute from their tables, in float64: (o, dk, dv)."""
    B, T, HQ, Dk = q.shape
    qj, kj, vj = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))  # the layouts of 16-bit inputs
    L = gpu._Layout(qj, kj, vj, jnp.asarray(idx), bs, cu, lens, gpu.Config(segment=segment))
    count, t0, union, source, times, last = (np.asarray(x) for x in gpu._tables(
        jnp.asarray(idx), jnp.asarray(counts), cu, lens, L, bs))
    q_t = np.asarray(gpu._token_rows(jnp.asarray(q), L, L.dkp), np.float64)
    ks, vs = (np.asarray(gpu._keys(jnp.asarray(x), L, cu, bs, d), np.float64) for x, d in ((k, L.dkp), (v, L.dvp)))
    tile_rows = lambda x, b, i, h: x[b, i * L.tb:(i + 1) * L.tb, h].reshape((L.rows,) + x.shape[4:])
    scale = Dk ** -0.5
    o_t = np.zeros((B, L.nt * L.tb, L.H, L.gr, L.dvp))
    lse_t = np.full((B, L.nt * L.tb, L.H, L.gr), -np.inf)
    for b in range(B):
        for h in range(L.H):
            for i in range(L.nt):
                rows = tile_rows(q_t, b, i, h)
                logits, values = [], []
                for u in range(count[b, h, i]):
                    kb, vb = _block(ks[b, :, h], source[b, h, i, u], L.bk), _block(vs[b, :, h], source[b, h, i, u], L.bk)
                    vb[union[b, h, i, u] + np.arange(L.bk) > last[b, h, i, u]] = 0.0  # zero_rows_past
                    visible, log_m = _mask(union[b, h, i, u], t0[b, h, i], times[b, h, i, u], L.rows, L.bk,
                                           gr=L.gr, bits=getattr(L, "bits", 4), bs=bs)
                    with np.errstate(invalid="ignore"):
                        logits.append(np.where(visible, rows @ kb.T * scale + log_m, -np.inf))
                    values.append(vb)
                if not logits:
                    continue
                s, vals = np.concatenate(logits, 1), np.concatenate(values, 0)
                m = np.max(s, 1, keepdims=True)
                seen = np.isfinite(m[:, 0])
                p = np.where(seen[:, None], np.exp(s - np.where(seen[:, None], m, 0)), 0.0)
                l = p.sum(1)
                out = np.where(seen[:, None], p @ vals / np.where(seen, l, 1)[:, None], 0.0)
                o_t[b, i * L.tb:(i + 1) * L.tb, h] = out.reshape(L.tb, L.gr, -1)
                lse_t[b, i * L.tb:(i + 1) * L.tb, h] = np.where(seen, m[:, 0] + np.log(np.where(seen, l, 1)),
                                                                    -np.inf).reshape(L.tb, L.gr)
    o = np.asarray(gpu._from_token_rows(jnp.asarray(o_t), L, v.shape[3]))
    lse = np.asarray(gpu._from_token_rows(jnp.asarray(lse_t), L, None))

    # dk, dv: the segments of each block's list of (token, times) entries, TB entries a step, then each list's sum
    delta = np.sum(o * do, -1)
    do_t = np.asarray(gpu._token_rows(jnp.asarray(do), L, L.dvp), np.float64)
    seg, entries, lists, bh = (np.asarray(x) for x in gpu._dkdv_tables(jnp.asarray(idx), jnp.asarray(counts), cu, lens,
                                                                        L, bs))
    lse_e, delta_e = (np.asarray(gpu._entry_vector(jnp.asarray(x), jnp.asarray(entries), jnp.asarray(bh), L, fill),
                                 np.float64) for x, fill in ((lse, -np.inf), (delta, 0.0)))
    assert ((entries[:, 0] >= 0) & (entries[:, 0] < T)).all()  # any entry a step reads names a token to copy
    tb, gr = L.tb, L.gr
    row_token = np.arange(L.rows) // gr  # j of row j * GR + g
    dk_part = np.zeros((len(seg), L.bk, L.dkp))
    dv_part = np.zeros((len(seg), L.bk, L.dvp))
    for s_, (b, h, x, src, lo, hi, offset) in enumerate(seg):
        kb, vb = _block(ks[b, :, h], src, L.bk), _block(vs[b, :, h], src, L.bk)
        for first in range(lo, hi, tb):  # the kernel's step: entries first ... first + TB - 1, read whole
            token, times = entries[first:first + tb, 0], entries[first:first + tb, 1]
            stats = slice(first * gr, (first + tb) * gr)
            lse_r, delta_r = lse_e[stats], delta_e[stats]
            assert len(token) == tb and len(lse_r) == L.rows  # in bounds: the tables' padding
            qr = np.concatenate([q_t[b, t, h] for t in token])  # TB copies of [GR, Dp]
            dor = np.concatenate([do_t[b, t, h] for t in token])
            limit = np.where(first + np.arange(tb) < hi, offset + token - x, -1)[row_token]  # `_token_mask`
            c = np.arange(L.bk)[:, None]
            seen = np.isfinite(lse_r)
            visible = (c < bs) & (c <= limit[None, :]) & seen[None, :]  # [BK, rows]
            log_m = np.log(np.maximum(times, 1))[row_token][None, :]
            with np.errstate(invalid="ignore", over="ignore"):
                p_t = np.where(visible, np.exp(kb @ qr.T * scale + log_m - np.where(seen, lse_r, 0)[None]), 0.0)
                dv_part[s_] += p_t @ dor
                ds_t = np.where(visible, p_t * (vb @ dor.T - delta_r[None]), 0.0)
            dk_part[s_] += ds_t @ qr
    sums = lambda part: np.stack([part[first:first + n].sum(0) for first, n in lists])
    dk = np.asarray(_plan.per_key_row(jnp.asarray(sums(dk_part)), k.shape, cu, block_size=bs)) * scale
    dv = np.asarray(_plan.per_key_row(jnp.asarray(sums(dv_part)), v.shape, cu, block_size=bs))
    return o, dk, dv


@pytest.mark.parametrize("segment", [gpu.Config().segment, 5], ids=["segment", "segment5"])
@pytest.mark.parametrize("name", CASES)
def test_the_kernels_tables_give_the_reference(name, segment):
    """The emulated forward and dk/dv over the kernels' tables equal the reference's o, dk and dv; with segments
    of 5 entries too (not a multiple of TB: lists cut in many segments, most ending in a step of fewer than TB
    tokens)."""
    case = _case(name)
    with jax.enable_x64(True):
        o, dk, dv = _emulate(*case, segment)
    o_ref, (_, dk_ref, dv_ref) = _reference(*case)
    lens = case[6]
    if lens is not None:  # keys past a sequence get no gradient; compare the rest
        keep = np.arange(case[1].shape[1])[None, :, None, None] < np.asarray(lens)[:, None, None, None]
        dk_ref, dv_ref = np.where(keep, dk_ref, 0), np.where(keep, dv_ref, 0)
    for what, got, want in (("o", o, o_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        # float64 but for the kernels' float32 lse and delta vectors: a table's mistake moves o, dk or dv by O(1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=what)


@pytest.mark.parametrize("phase", ["forward", "dq"])
def test_packs_claims_the_selections_whose_tiles_share_blocks(phase, monkeypatch):
    """`packs` and `packs_dq`, implementation=None's run-time choice of this forward, or this dq, over Triton's
    (traced: under jit), hold where the 4 tokens of a tile (G = 16) list the same blocks and not where each lists
    its own; they rule out statically (False) a KV cache's queries, float32, more than 255 slots, blocks of more
    than 256 rows and head dims whose tiles overflow shared memory; packs_dq also calls of fewer than
    MIN_DQ_TOKENS tokens (here lowered to 1024, then to 1025)."""
    B, T, HQ, H, D, bs, S = 1, 1024, 32, 2, 64, 16, 4
    monkeypatch.setattr(gpu, "MIN_DQ_TOKENS", B * T)
    q, k = jnp.zeros((B, T, HQ, D), jnp.bfloat16), jnp.zeros((B, T, H, D), jnp.bfloat16)
    t, s = np.arange(T)[:, None], np.arange(S)[None]
    same = np.broadcast_to(s, (T, S))  # blocks 0..3 for every token
    own = (t % 4) * S + s  # token j of a tile: blocks 4j..4j+3

    def packs(idx, q=q, k=k, kv_lens=None, block_size=bs):
        args = (q, k, k, idx, jnp.full(idx.shape[:3], idx.shape[3], jnp.int32), None, kv_lens)
        if phase == "forward":
            return gpu.packs(*args, block_size=block_size, scale=1.0)
        o, lse = q, jnp.zeros(q.shape[:3], jnp.float32)  # the residuals' o and lse, as `forward` returns them
        return gpu.packs_dq(args + (o, lse), q, block_size=block_size, scale=1.0)

    same, own = (jnp.asarray(np.broadcast_to(x[None, :, None], (B, T, H, S)), jnp.int32) for x in (same, own))
    assert bool(jax.jit(packs)(same)) and not bool(jax.jit(packs)(own))
    assert packs(same, kv_lens=jnp.full((B,), T, jnp.int32)) is False
    assert packs(same, q=q.astype(jnp.float32), k=k.astype(jnp.float32)) is False
    assert packs(jnp.zeros((B, T, H, 256), jnp.int32)) is False
    assert packs(same, block_size=512) is False
    wide = jnp.zeros((B, T, HQ, 512), jnp.bfloat16)
    assert packs(same, q=wide, k=wide[:, :, :H]) is False
    monkeypatch.setattr(gpu, "MIN_DQ_TOKENS", B * T + 1)
    assert (packs(same) is False) == (phase == "dq")
