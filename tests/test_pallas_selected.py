"""The Pallas TPU kernels of selected attention (nsa/pallas/tpu/selected.py).

On the CPU they run in Pallas's TPU interpret mode (race detection on) against the XLA reference
(nsa.reference.selected) on float32 copies of the same rounded inputs: o, lse, dq, dk and dv, on G = 1, 3
and 16, Dv != Dk, head dims that are not a multiple of 128 lanes, T not a multiple of the tile, block
sizes 8 to 64 (bf16 at 8: the copied rows pass the block), random selections with -1, out-of-range and
repeated entries and per-token counts, packed sequences with an empty one (cu_seqlens traced under jit),
rows that see nothing, keys that must never be read (NaN: invalid entries, the rows a copy takes past a
block or past a sequence's end), lists split into many dk/dv segments, queries at the end of a KV cache's
ragged sequences over several tiles and segments, and bitwise repeatable gradients; the resident backward in
two passes (a VMEM budget too small for one) bitwise its one pass, with union tiles too; the resident kernels'
union tiles (local selections; forward and backward) beside tiles token by token in one call, and never reading the
next sequence; no data race between two simulated cores.
Forward and backward are also exported for TPU (jax.export, platforms=["tpu"]), which lowers them through Mosaic's
Pallas lowering, at the standard shape and an odd one, and the resident kernels at 32k and 64k tokens; and the
VMEM of a grid step is bounded up to heads of 256 in float32.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # the race detector's state
from jax.experimental.pallas import tpu as pltpu

from nsa._config import Shapes
from nsa._device import facts
from nsa._varlen import tokens
from nsa.pallas.tpu import selected
from nsa.reference import selected as reference
from tests.base import GRAD_TOLERANCE, TOLERANCE, Inputs, assert_close, gradient_scales

# Two simulated TensorCores share the parallel grid dimensions, as on a megacore chip; the race detector
# flags any two accesses to one buffer without a happens-before order (checked after every test);
# uninitialized VMEM reads as NaN and out-of-bounds reads raise (the interpreter's defaults).
INTERPRET = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)


@pytest.fixture(autouse=True)
def no_races(monkeypatch):
    """Fails a test in which the race detector flagged any kernel (it keeps one state per kernel call)."""
    states = []
    new_state = interpret_pallas_call.RaceDetectionState

    def recorded(*args, **kwargs):
        states.append(new_state(*args, **kwargs))
        return states[-1]

    monkeypatch.setattr(interpret_pallas_call, "RaceDetectionState", recorded)
    yield
    assert not any(state.races_found for state in states), "the race detector found a data race"
CU = np.array([0, 37, 37, 150, 200], np.int32)  # lengths 37, 0, 113, 50 (T = 200)
SHORT_CU = np.array([0, 13, 13, 40, 60], np.int32)  # lengths 13, 0, 27, 20 (T = 60)

# (B, T, HQ, H, Dk, Dv, block_size), dtype, block_counts, cu_seqlens
CASES = {
    "G1-dv32-bs8-B2": ((2, 40, 1, 1, 16, 32, 8), "float32", "int", None),  # (H = 2: "G3-bf16-bs8")
    "G3-T70": ((1, 70, 3, 1, 32, 16, 16), "float32", "array", None),  # one partial tile of 128 tokens
    "G16-bs32": ((1, 50, 16, 1, 16, 24, 32), "float32", "array", None),  # 7 tiles of 8 tokens, the last partial
    "G3-bf16-bs8": ((1, 60, 6, 2, 64, 48, 8), "bfloat16", "array", None),  # 16 rows copied per block of 8
    "G2-varlen": ((1, 200, 2, 1, 32, 32, 16), "float32", "array", CU),
    "T<bs-bs64": ((1, 40, 2, 1, 16, 24, 64), "float32", "all", None),
}


def _counts(kind, B, T, H, S):
    counts = {"all": np.full((B, T, H), S), "int": np.full((B, T, H), 3),
              "array": np.random.default_rng(2).integers(0, S + 2, (B, T, H))}[kind]  # 0 to past S
    return jnp.asarray(counts, jnp.int32)


def _kernels(x, idx, counts, cu, *, config=None, kv_lens=None):
    """(o, lse, (dq, dk, dv)) of the kernels in interpret mode, jitted (a cu_seqlens or kv_lens is traced)."""
    bs, scale = x.block_size, x.shape[4] ** -0.5

    @jax.jit
    def run(q, k, v, do, idx, counts, cu, kv_lens):
        o, res = selected.forward(q, k, v, idx, counts, cu, kv_lens, block_size=bs, scale=scale,
                                  interpret=INTERPRET, config=config)
        assert len(res) == 9 and res[-2] is o
        grads = selected.backward(res, do, block_size=bs, scale=scale, interpret=INTERPRET, config=config)
        assert grads[3:] == (None,) * 4
        return o, res[-1], grads[:3]

    return run(x.q, x.k, x.v, x.do, jnp.asarray(idx), counts, None if cu is None else jnp.asarray(cu),
               None if kv_lens is None else jnp.asarray(kv_lens))


def _reference(x, idx, counts, cu, k=None, v=None, kv_lens=None):
    """(o, lse, (dq, dk, dv)) of the XLA reference on float32 copies."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    kw = dict(block_size=x.block_size, scale=x.shape[4] ** -0.5)
    cu = None if cu is None else jnp.asarray(cu)
    kv_lens = None if kv_lens is None else jnp.asarray(kv_lens)
    o, res = reference.forward(f32(x.q), f32(x.k if k is None else k), f32(x.v if v is None else v),
                               jnp.asarray(idx), counts, cu, kv_lens, **kw)
    return o, res[-1], reference.backward(res, f32(x.do), **kw)[:3]


def _assert_matches(got, ref, x, dtype, what=""):
    o, lse, grads = got
    o_ref, lse_ref, grads_ref = ref
    assert o.dtype == x.q.dtype and o.shape == o_ref.shape and lse.dtype == jnp.float32
    assert_close(o, o_ref, TOLERANCE[dtype], f"{what} o")
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    seen = np.isfinite(lse_ref)
    assert_close(lse[seen], lse_ref[seen], TOLERANCE[dtype], f"{what} lse")
    sizes = gradient_scales(x.q, x.k, x.v, x.do, x.shape[4] ** -0.5)
    for name, g, g_ref, arg, size in zip(("dq", "dk", "dv"), grads, grads_ref, (x.q, x.k, x.v), sizes):
        assert g.dtype == arg.dtype and g.shape == arg.shape, name
        assert_close(g, g_ref, GRAD_TOLERANCE[dtype], f"{what} {name}", size)


@pytest.mark.parametrize("shape, dtype, counts, cu", CASES.values(), ids=CASES.keys())
def test_matches_the_reference_in_interpret_mode(shape, dtype, counts, cu):
    x = Inputs(shape, dtype)
    B, T, _, H = shape[:4]
    idx = x.block_indices(5)  # -1, -2, beyond t // bs, 2^30 and repeated entries
    counts = _counts(counts, B, T, H, 5)
    _assert_matches(_kernels(x, idx, counts, cu), _reference(x, idx, counts, cu), x, dtype)


def test_lists_split_into_segments():
    """A Config of tiles of 8 tokens and dk/dv segments of 2 tiles: block 0 of a sequence and each token's
    own block (listed twice) are in every tile's union, so their lists are cut into several segments
    that the reduce adds; packed sequences (traced), against the reference."""
    x = Inputs((1, 60, 3, 1, 16, 24, 16), "float32")
    B, T, _, H = x.shape[:4]
    pos = np.asarray(tokens(T, 16, jnp.asarray(SHORT_CU)).pos[0])
    rand = np.random.default_rng(3).integers(-1, pos // 16 + 2)  # -1, a visible block or the next (invalid)
    idx = np.stack([0 * pos, pos // 16, pos // 16, rand], -1)[None, :, None].astype(np.int32)
    counts = jnp.full((B, T, H), 4, jnp.int32)
    config = selected.Config(tokens=8, segment=2)
    _assert_matches(_kernels(x, idx, counts, SHORT_CU, config=config), _reference(x, idx, counts, SHORT_CU), x,
                    "float32", "segments")


def test_invalid_entries_are_never_read():
    """Keys and values from token 2 * bs on are NaN and no query may read them: listed as -1, as a future
    block, at 2^30, in a slot past block_counts, or as the rows a bf16 copy of 16 rows takes past a block of
    8. Every output and gradient equals the reference's on zeros there; their dk and dv are zero."""
    B, T, HQ, H, D, bs = 1, 40, 3, 1, 16, 8
    x = Inputs((B, T, HQ, H, D, D, bs), "bfloat16")
    t = np.arange(T)
    future = np.stack([t // bs, np.full(T, 2), np.full(T, -1), np.full(T, 2 ** 30)], -1)  # 2 > t // bs
    late = np.stack([np.zeros(T), np.ones(T), np.full(T, 2), np.full(T, 3)], -1)  # slots 2, 3 past the count
    idx = np.where((t < 2 * bs)[:, None], future, late).astype(np.int32)[None, :, None, :]
    counts = jnp.asarray(np.where(t < 2 * bs, 4, 2).astype(np.int32)[None, :, None])
    poison = (t >= 2 * bs)[None, :, None, None]
    k_nan, v_nan = (jnp.where(poison, jnp.nan, a).astype(a.dtype) for a in (x.k, x.v))
    k_zero, v_zero = (jnp.where(poison, 0, a).astype(a.dtype) for a in (x.k, x.v))
    x.k = k_nan
    x.v = v_nan
    got = _kernels(x, idx, counts, None)
    x.k, x.v = k_zero, v_zero
    _assert_matches(got, _reference(x, idx, counts, None), x, "bfloat16", "poisoned")
    _, _, (_, dk, dv) = got
    assert np.all(np.asarray(dk)[:, 2 * bs:] == 0) and np.all(np.asarray(dv)[:, 2 * bs:] == 0)


def test_the_next_sequence_is_never_read():
    """Packed sequences [0, 13) and [13, 24): block 1 of the first holds rows 8 to 15, of which 13 to 15 are
    the second sequence's, NaN here, and the second sequence's queries list only invalid blocks. The
    copy of block 1 takes those rows; nothing of them may reach o, lse or the gradients, in one backward pass or
    two (`test_the_two_pass_backward_is_bitwise_the_one_pass`)."""
    B, T, HQ, H, D, bs = 1, 24, 2, 1, 16, 8
    x = Inputs((B, T, HQ, H, D, D, bs), "float32")
    cu = np.array([0, 13, 24], np.int32)
    t = np.arange(T)
    own = np.stack([t // bs, np.zeros(T), np.full(T, -1)], -1)
    idx = np.where((t < 13)[:, None], own, np.full((T, 3), 5)).astype(np.int32)[None, :, None, :]
    counts = jnp.full((B, T, H), 3, jnp.int32)
    poison = (t >= 13)[None, :, None, None]
    x.k, x.v = (jnp.where(poison, jnp.nan, a) for a in (x.k, x.v))
    got = _kernels(x, idx, counts, cu)
    [two] = _resident_grads(x, idx, counts, cu, [_two_pass_budget(x, idx, cu)])  # the backward in two passes
    for name, a, b in zip(("dq", "dk", "dv"), got[2], two):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"two passes: {name}")
    x.k, x.v = (jnp.where(poison, 0.0, a) for a in (x.k, x.v))
    _assert_matches(got, _reference(x, idx, counts, cu), x, "float32", "next sequence")


def test_a_token_zeroes_the_block_it_sees_in_part(monkeypatch):
    """Token by token (no union tiles), blocks of 8, key rows 5 and 21 NaN: the tokens before each in its block list
    that block (their own, last in their lists: it sees the NaN row's place in part), no later token lists it. Each
    token's gather zeroes only its first slot after the table puts the slot it sees in part there; in the second grid
    step a token lists its own block twice (two slots seen in part), so that step zeroes every slot. Every output
    and gradient equals the reference's on zeros there."""
    monkeypatch.setattr(selected, "UNION_TILES", False)
    B, T, HQ, H, D, bs = 1, 32, 3, 1, 16, 8
    x = Inputs((B, T, HQ, H, D, D, bs), "float32")
    t = np.arange(T)
    poison = np.isin(t, [5, 21])
    own = np.where((t // bs == 0) & (t >= 5) | (t // bs == 2) & (t >= 21), -1, t // bs)  # never past a NaN row
    other = np.where(t >= 2 * bs, 1, -1)  # block 1, wholly seen from token 16 on
    idx = np.stack([other, np.full(T, -1), own], -1)
    idx[17] = [2, 1, 2]  # its own block twice
    idx = idx.astype(np.int32)[None, :, None, :]
    counts = jnp.full((B, T, H), 3, jnp.int32)
    lay = selected._resident_layout(x.q, x.k, x.v, idx, bs, None)
    table = np.asarray(selected._step_table(jnp.asarray(idx), counts, None, lay, bs))
    flag = selected._flag_at(lay.tb, selected._padded_slots(3, lay.br))
    np.testing.assert_array_equal(table[0, 0, :, 0, flag], [1, 0])  # the steps' flags
    x.k, x.v = (jnp.where(poison[None, :, None, None], jnp.nan, a) for a in (x.k, x.v))
    got = _kernels(x, idx, counts, None)
    x.k, x.v = (jnp.where(poison[None, :, None, None], 0.0, a) for a in (x.k, x.v))
    _assert_matches(got, _reference(x, idx, counts, None), x, "float32", "rows seen in part")


def test_a_kv_cache():
    """The last 24 queries of sequences of 60 and 37 tokens in a 64-row cache (kv_lens, traced): key rows
    per batch row over 3 tiles of 8 tokens, dk/dv lists cut into segments of 2 tiles, random selections
    (some reaching past a sequence's end: skipped) and keys past each length NaN (block 4 of the second
    sequence holds 3 of them: the copy takes them, nothing may read them). Against the reference with the
    same kv_lens on zeros there; their dk and dv are zero."""
    T, lens = 24, np.array([60, 37], np.int32)
    x = Inputs((2, 64, 3, 1, 16, 24, 8), "float32")
    last = lambda a: np.stack([np.asarray(a)[b, n - T:n] for b, n in enumerate(lens)])
    x.q, x.do = (jnp.asarray(last(a)) for a in (x.q, x.do))
    idx = last(x.block_indices(4))
    counts = jnp.asarray(np.random.default_rng(2).integers(1, 5, (2, T, 1)), jnp.int32)
    past = (np.arange(64)[None, :] >= lens[:, None])[..., None, None]
    keys = x.k, x.v
    x.k, x.v = (jnp.where(past, jnp.nan, a) for a in keys)
    got = _kernels(x, idx, counts, None, config=selected.Config(tokens=8, segment=2), kv_lens=lens)
    x.k, x.v = (jnp.where(past, 0.0, a) for a in keys)
    _assert_matches(got, _reference(x, idx, counts, None, kv_lens=lens), x, "float32", "cache")
    _, _, (_, dk, dv) = got
    assert np.all(np.asarray(dk)[np.broadcast_to(past, dk.shape)] == 0)
    assert np.all(np.asarray(dv)[np.broadcast_to(past, dv.shape)] == 0)


@pytest.mark.parametrize("layout", ["gathered", "direct"])
def test_a_decode_step_reads_only_its_blocks(layout):
    """T queries at the end of sequences of 3 lengths (the cache's, 131 and T) in a cache of TK rows, random
    selections of 3 slots with invalid entries, NaN past each length: the forward copies only the blocks the
    queries list (at most 3 T of 16 rows per KV head, not the cache's TK rows) and matches the reference, and so
    does the backward (on the full layout), with zero dk and dv past each length. gathered: T = 2, TK = 300, not
    a multiple of the block of 16 (the last block's copy reaches past the cache), heads of 32 and 24: the blocks
    gathered in XLA first. direct: a decode step (T = 1: a tile of one token, its G heads the rows), TK = 320,
    heads of 128, H = 3: the kernel copies each block's rows of every head from the cache as it is and takes its
    own head's (`_own_head`)."""
    T, TK, D = (2, 300, (32, 24)) if layout == "gathered" else (1, 320, (128, 128))
    lens = np.array([TK, 131, T], np.int32)
    H = 2 if layout == "gathered" else 3
    x = Inputs((3, TK, 3 * H, H) + D + (16,), "float32")
    last = lambda a: np.stack([np.asarray(a)[b, n - T:n] for b, n in enumerate(lens)])
    x.q, x.do = (jnp.asarray(last(a)) for a in (x.q, x.do))
    idx = last(x.block_indices(3))
    counts = jnp.asarray(np.random.default_rng(2).integers(0, 5, (3, T, H)), jnp.int32)
    shapes = Shapes.of(x.q, x.k, x.v, block_size=16)
    config = selected.default_config(shapes, x.q.dtype, facts("tpu"), forward=True)
    assert (config.tokens == 1) == (T == 1)
    lay = selected._Layout(x.q, x.k, x.v, idx, 16, None, lens, config)
    assert (lay.gathered, lay.direct) == (layout == "gathered", layout == "direct")
    assert lay.nt * lay.union * lay.br == 3 * T * 16
    past = (np.arange(TK)[None, :] >= lens[:, None])[..., None, None]
    keys = x.k, x.v
    x.k, x.v = (jnp.where(past, jnp.nan, a) for a in keys)
    got = _kernels(x, idx, counts, None, kv_lens=lens)
    x.k, x.v = (jnp.where(past, 0.0, a) for a in keys)
    _assert_matches(got, _reference(x, idx, counts, None, kv_lens=lens), x, "float32", "decode")
    _, _, (_, dk, dv) = got
    assert np.all(np.asarray(dk)[np.broadcast_to(past, dk.shape)] == 0)
    assert np.all(np.asarray(dv)[np.broadcast_to(past, dv.shape)] == 0)


@pytest.mark.parametrize("page", [32, 16, 8], ids=["page-of-2-blocks", "page-of-1-block", "block-of-2-pages"])
def test_a_paged_decode_step_copies_its_blocks_through_the_page_table(page):
    """`paged_forward`: a decode step over a paged cache's pools (pages in random order, a page table with a
    repeated page and unused -1 entries past the sequences, NaN in every row no sequence owns; lengths the
    capacity, 0, one ending mid-page; random selections with invalid entries and per-head counts) copies each
    block's rows from its page, or from the two pages a block spans, and equals the reference on the sequences
    gathered through the table. A page size that neither holds whole blocks nor divides one is refused."""
    B, HQ, H, D, bs, S, MP = 3, 6, 3, 128, 16, 4, 6
    TK = MP * page
    lens = np.array([TK, 0, TK // 2 + 3], np.int32)
    rng = np.random.default_rng(7)
    P = B * MP + 2
    pages_of = lambda n: -(-n // page)
    table = np.full((B, MP), -1, np.int32)
    order = rng.permutation(P)
    used = 0
    for b, n in enumerate(lens):
        table[b, :pages_of(n)] = order[used:used + pages_of(n)]
        used += pages_of(n)
    table[2, MP - 1] = table[0, 0]  # a repeated page, past sequence 2's length
    owned = np.zeros((P, page), bool)
    for b, n in enumerate(lens):
        rows = np.arange(n)
        owned[table[b, rows // page], rows % page] = True
    pool = lambda: jnp.asarray(np.where(owned[..., None, None], rng.standard_normal((P, page, H, D)), np.nan),
                               jnp.float32)
    k, v = pool(), pool()
    q = jnp.asarray(rng.standard_normal((B, 1, HQ, D)), jnp.float32)
    idx = jnp.asarray(rng.integers(-1, TK // bs + 1, (B, 1, H, S)), jnp.int32)
    counts = jnp.asarray(rng.integers(1, S + 1, (B, 1, H)), jnp.int32)
    assert selected.reads_pages(q, k, v, bs)
    o = jax.jit(lambda *a: selected.paged_forward(*a, block_size=bs, scale=0.1, interpret=INTERPRET))(
        q, k, v, idx, counts, jnp.asarray(lens), jnp.asarray(table))
    seq = lambda x: jnp.nan_to_num(x[jnp.clip(jnp.asarray(table), 0, P - 1)].reshape(B, TK, H, D))
    o_ref, _ = reference.forward(q, seq(k), seq(v), idx, counts, None, jnp.asarray(lens), block_size=bs, scale=0.1)
    assert np.all(np.asarray(o)[1] == 0)  # the empty sequence sees nothing
    assert_close(o, o_ref, TOLERANCE["float32"], f"paged o (pages of {page})")

    odd = jnp.zeros((P, 12, H, D), jnp.float32)  # pages of 12 rows: neither whole blocks of 16 nor a divisor
    assert not selected.reads_pages(q, odd, odd, bs)
    with pytest.raises(ValueError, match="page size"):
        selected.paged_forward(q, odd, odd, idx, counts, jnp.asarray(lens), jnp.asarray(table), block_size=bs,
                               scale=0.1)


def test_rows_that_see_nothing():
    """Every other token sees nothing: o = 0, lse = -inf and dq = 0 there exactly; a call where no token
    sees anything gives zeros everywhere."""
    x = Inputs((1, 32, 3, 1, 16, 32, 16), "float32")
    B, T, _, H = x.shape[:4]
    t = np.arange(T)[None, :, None, None]
    idx = np.broadcast_to(np.where(t % 2 == 0, -1, t // 16), (B, T, H, 2)).astype(np.int32)
    counts = jnp.full((B, T, H), 2, jnp.int32)
    got = _kernels(x, idx, counts, None)
    o, lse, (dq, _, _) = got
    blind = np.arange(T) % 2 == 0
    assert np.all(np.asarray(o)[:, blind] == 0) and np.all(np.asarray(dq)[:, blind] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, blind])) and np.all(np.isfinite(np.asarray(lse)[:, ~blind]))
    _assert_matches(got, _reference(x, idx, counts, None), x, "float32", "partly blind")

    o, lse, grads = _kernels(x, np.full((B, T, H, 2), -1, np.int32), counts, None)
    assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))
    for g in grads:
        assert np.all(np.asarray(g) == 0)


def _exported_for_tpu(shape, S, dtype, config):
    """The MLIR text of selected.forward and .backward, jitted, exported for a TPU v5e (jax.export)."""
    B, T, HQ, H, Dk, Dv, bs = shape
    kw = dict(block_size=bs, scale=0.1, config=config)

    def forward_backward(q, k, v, idx, counts, do):
        o, res = selected.forward(q, k, v, idx, counts, None, **kw)
        return o, selected.backward(res, do, **kw)[:3]

    args = [jax.ShapeDtypeStruct(s, d) for s, d in [
        ((B, T, HQ, Dk), dtype), ((B, T, H, Dk), dtype), ((B, T, H, Dv), dtype), ((B, T, H, S), jnp.int32),
        ((B, T, H), jnp.int32), ((B, T, HQ, Dv), dtype)]]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NSA_DEVICE_KIND", "TPU v5 lite")
        return jax.export.export(jax.jit(forward_backward), platforms=["tpu"])(*args).mlir_module()


@pytest.mark.parametrize("shape, S, dtype", [((1, 8192, 64, 4, 128, 128, 64), 16, jnp.bfloat16),  # standard
                                             ((1, 1000, 6, 2, 64, 48, 16), 5, jnp.float32)],  # G = 3, Dv != Dk
                         ids=["standard-bf16", "odd-f32"])
@pytest.mark.parametrize("resident", [False, True])
def test_lowers_for_tpu(shape, S, dtype, resident):
    """jax.export for TPU lowers the kernels through Mosaic: the union kernels, four tpu_custom_calls (forward, dq,
    dk/dv partials, their reduce), or the resident ones, two (forward, backward), by name."""
    config = None if resident else selected.Config(16 if shape[2] // shape[3] == 16 else 128, 256)
    module = _exported_for_tpu(shape, S, dtype, config)
    names = sorted(re.findall(r'kernel_name = "(\w+)"', module))
    assert module.count("tpu_custom_call") == len(names)
    assert names == (["selected_resident_backward", "selected_resident_forward"] if resident else
                     ["selected_dkdv", "selected_dkdv_reduce", "selected_dq", "selected_forward"])
    B, T, HQ, H = shape[:4]
    lane_rows = f"tensor<{B}x{H}x1x{T * HQ // H}xf32>"  # the resident backward's lse and delta (G = 16)
    assert (lane_rows in module) == (resident and HQ // H == 16)


@pytest.mark.parametrize("T, kernels", [
    (32768, {"selected_resident_forward": 28, "selected_resident_backward": 60}),
    (65536, {"selected_resident_forward": 44, "selected_resident_backward_dq_dk": 76,
             "selected_resident_backward_dv": 59})])
def test_long_resident_kernels_lower_for_tpu(T, kernels):
    """At 32k and 64k tokens of the standard shape the resident kernels lower through Mosaic (jax.export for a TPU
    v5e): the backward in one pass at 32k, two at 64k; each asks for a scoped VMEM (backend_config's
    scoped_memory_configs: `resident_bytes` + RESIDENT_MARGIN, in MiB rounded up here) within the v5e's 128 MiB."""
    module = _exported_for_tpu((1, T, 64, 4, 128, 128, 64), 16, jnp.bfloat16, None)
    names = re.findall(r'kernel_name = "(\w+)"', module)
    sizes = [int(x) for x in re.findall(r'scoped_memory_configs.{0,60}?size\\22: (\d+)', module)]
    assert len(sizes) == len(names) == module.count("tpu_custom_call")
    got = {name: math.ceil(size / 2 ** 20) for name, size in zip(names, sizes)}
    assert got == kernels
    assert max(sizes) <= 128 * 2 ** 20


@pytest.mark.parametrize("G, dk, dv, dtype, block_size", [
    (16, 128, 128, jnp.bfloat16, 64),  # the standard shape
    (16, 256, 256, jnp.float32, 128), (3, 256, 256, jnp.float32, 64), (1, 16, 256, jnp.float32, 64),
    (64, 256, 256, jnp.bfloat16, 64)])
def test_vmem_budget(G, dk, dv, dtype, block_size):
    """The default tiles hold, per grid step of the largest kernel, within the 16 MiB of scoped VMEM that
    Mosaic gives a kernel by default on v5e, v5p and v6e, up to heads of 256 in float32."""
    T, H, S = 8192, 2, 16
    q = jax.ShapeDtypeStruct((1, T, G * H, dk), dtype)
    k, v = jax.ShapeDtypeStruct((1, T, H, dk), dtype), jax.ShapeDtypeStruct((1, T, H, dv), dtype)
    config = selected.default_config(Shapes.of(q, k, v, block_size=block_size, block_counts=S), dtype, facts("tpu"))
    assert config.tokens * G % 128 == 0
    assert selected.vmem_bytes(G, dk, dv, jnp.dtype(dtype).itemsize, block_size, S, config) <= 16 * 2 ** 20


@pytest.mark.parametrize("H, dtype, block_size", [(4, jnp.bfloat16, 64), (32, jnp.bfloat16, 64),
                                                  (8, jnp.float32, 128), (16, jnp.float32, 64)])
def test_direct_decode_vmem_budget(H, dtype, block_size):
    """A decode step's direct forward (one token, G = 16 heads of 128 a KV head, its block buffers
    of every KV head's rows) holds within the 16 MiB of scoped VMEM."""
    G, D, S = 16, 128, 16
    q = jax.ShapeDtypeStruct((8, 1, G * H, D), dtype)
    k = jax.ShapeDtypeStruct((8, 65536, H, D), dtype)
    config = selected.default_config(Shapes.of(q, k, k, block_size=block_size, block_counts=S), dtype, facts("tpu"),
                                     forward=True)
    assert config.tokens == 1
    used = selected.vmem_bytes(G, D, D, jnp.dtype(dtype).itemsize, block_size, S, config, heads=H)
    assert selected.vmem_bytes(G, D, D, jnp.dtype(dtype).itemsize, block_size, S, config) < used <= 16 * 2 ** 20


def test_errors_name_the_argument():
    q, k = jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="q:"):
        selected.forward(q, k, k, jnp.zeros((1, 8, 2, 1), jnp.int32), jnp.ones((1, 8, 2), jnp.int32), None,
                         block_size=4, scale=1.0)
    with pytest.raises(ValueError, match="block_indices:"):
        selected.forward(k, k, k, jnp.zeros((1, 8, 1, 1), jnp.int32), jnp.ones((1, 8, 2), jnp.int32), None,
                         block_size=4, scale=1.0)


def test_resident_kernels_agree_with_the_union_kernels():
    """The resident kernels (the default where they fit) against the union kernels (an explicit Config) on the same
    inputs, packed, with repeated and skipped slots. (Their bitwise repeatability is the chip's to show, where a
    schedule could differ: scripts/tpu_train_probe.py; an interpreter's repeats cannot.)"""
    x = Inputs((1, 60, 4, 2, 16, 32, 16), "float32")
    idx, counts = x.block_indices(3), _counts("array", 1, 60, 2, 3)
    lay_q = Shapes.of(x.q, x.k, x.v, block_size=16, block_counts=3)
    assert selected.resident(x.q, x.k, x.v, idx, 16, SHORT_CU, None, None, True)
    got = _kernels(x, idx, counts, SHORT_CU)
    union = _kernels(x, idx, counts, SHORT_CU, config=selected.default_config(lay_q, jnp.float32, facts("tpu")))
    _assert_matches(got, union, x, "float32", "resident against union:")


def test_what_the_resident_kernels_take(monkeypatch):
    """No Config, no KV cache, blocks at multiples of the sublane tile; within 3/4 of a TPU v5e's 128 MiB of VMEM at
    the standard shape: the forward (k and v single-buffered) to 128k tokens, the backward in one pass (float32 dk
    and dv beside k and v) to 32k, in two ((dq, dk), then dv) at 64k; the scoped VMEM each pass asks for within the
    chip's."""
    monkeypatch.setenv("NSA_DEVICE_KIND", "TPU v5 lite")

    def takes(T, backward, dtype=jnp.bfloat16, block_size=64, cu=None, kv_lens=None, config=None):
        q = jax.ShapeDtypeStruct((1, T, 64, 128), dtype)
        k = jax.ShapeDtypeStruct((1, T, 4, 128), dtype)
        idx = jax.ShapeDtypeStruct((1, T, 4, 16), jnp.int32)
        passes = selected.resident(q, k, k, idx, block_size, cu, kv_lens, config, backward)
        lay = selected._resident_layout(q, k, k, idx, block_size, cu)
        for outputs in passes or ():
            assert selected.resident_bytes(lay, dtype, outputs) + selected.RESIDENT_MARGIN <= facts("tpu").vmem
        return passes

    one, two = selected.BACKWARD_PLANS
    assert takes(16384, True) == takes(32768, True) == one and takes(65536, True) == two
    assert takes(131072, True) is None
    assert takes(131072, False) == (selected.FORWARD,) and takes(262144, False) is None
    assert not takes(1024, False, config=selected.Config(16, 64))
    assert not takes(1024, False, kv_lens=jnp.array([1024]))
    assert not takes(1024, False, block_size=8) and takes(1024, False, block_size=8, cu=jnp.array([0, 1024]))
    assert takes(1024, False, dtype=jnp.float32, block_size=8)


def _two_pass_budget(x, idx, cu):
    """The VMEM budget in which `resident_plan` picks two backward passes for x's shape: that of the larger of the
    two passes; with a byte less, no plan."""
    lay = selected._resident_layout(x.q, x.k, x.v, idx, x.block_size, cu)
    need = max(selected.resident_bytes(lay, x.k.dtype, p) for p in selected.BACKWARD_PLANS[1])
    vmem = math.ceil((need + selected.RESIDENT_MARGIN) / selected.RESIDENT_SHARE)
    assert selected.resident_plan(lay, x.k.dtype, True, vmem) == selected.BACKWARD_PLANS[1]
    assert selected.resident_plan(lay, x.k.dtype, True, vmem - 2) is None
    return vmem


def _resident_grads(x, idx, counts, cu, budgets):
    """[(dq, dk, dv)] of the resident backward per VMEM budget, in the passes `resident_plan` picks within it, after
    one resident forward (interpret mode, one jit)."""
    bs, scale = x.block_size, x.shape[4] ** -0.5
    lay = selected._resident_layout(x.q, x.k, x.v, idx, bs, cu)
    plans = [selected.resident_plan(lay, x.k.dtype, True, vmem) for vmem in budgets]
    cu = None if cu is None else jnp.asarray(cu)

    @jax.jit
    def run(q, k, v, do):
        o, res = selected.forward(q, k, v, idx, counts, cu, block_size=bs, scale=scale, interpret=INTERPRET)
        return [selected._resident_backward(q, k, v, jnp.asarray(idx), counts, cu, o, res[-1], do, passes=passes,
                                            block_size=bs, scale=scale, interpret=INTERPRET) for passes in plans]

    return run(x.q, x.k, x.v, x.do)


@pytest.mark.parametrize("shape, dtype, S, cu, local", [
    ((1, 32, 1, 1, 16, 32, 32), "float32", 2, None, False),  # G = 1
    # half local, half random selections: tiles taking the union path and tiles token by token in one call
    ((1, 48, 3, 1, 32, 16, 8), "float32", 2, np.array([0, 21, 21, 48], np.int32), True),  # G = 3, Dv != Dk, packed
    ((1, 48, 16, 1, 16, 24, 16), "bfloat16", 2, None, True)],  # G = 16: union tiles of 8 tokens
    ids=["G1", "G3-packed-union", "G16-bf16-union"])
def test_the_two_pass_backward_is_bitwise_the_one_pass(shape, dtype, S, cu, local):
    """A VMEM budget too small for the one-pass resident backward runs two passes ((dq, dk), then dv, which
    recomputes p without v); each adds to its sums in the one pass's order, so dq, dk and dv are its bits: token by
    token, and (local) with union tiles taken beside tiles token by token (each pass takes the same tiles)."""
    x = Inputs(shape, dtype)
    if local:
        idx, counts = _half_local(x, S, cu)
    else:
        idx = x.block_indices(S)
        counts = _counts("array", shape[0], shape[1], shape[3], S)
    one, two = _resident_grads(x, idx, counts, cu, [2 ** 40, _two_pass_budget(x, idx, cu)])
    for name, a, b in zip(("dq", "dk", "dv"), one, two):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def _local_indices(B, T, H, S, bs, cu=None):
    """Selections as a trained model's are, neighbouring tokens listing much the same blocks: the token at in-sequence
    position p lists its own block and the S - 1 before it (those before the sequence's first: -1, skipped)."""
    starts = np.zeros(T, np.int64) if cu is None else np.asarray(cu)[np.searchsorted(cu, np.arange(T), "right") - 1]
    own = (np.arange(T) - starts) // bs
    idx = np.maximum(own[:, None] - np.arange(S), -1)
    return np.broadcast_to(idx[None, :, None, :], (B, T, H, S)).astype(np.int32)


def _half_local(x, S, cu):
    """(block_indices, block_counts): `_local_indices` in the first half of the tokens (their tiles take the union
    path), x's random ones with repeated entries in the second (token by token); asserted to take both paths."""
    B, T, _, H = x.shape[:4]
    idx = np.where((np.arange(T) < T // 2)[None, :, None, None], _local_indices(B, T, H, S, x.block_size, cu),
                   x.block_indices(S))
    counts = jnp.full((B, T, H), S, jnp.int32)
    takes = np.asarray(selected.union_tiles(x.q, x.k, x.v, jnp.asarray(idx), counts,
                                            None if cu is None else jnp.asarray(cu), block_size=x.block_size))
    assert takes.any() and not takes.all(), takes
    return idx, counts


@pytest.mark.parametrize("size", [4, 12, 40])
def test_distinct_names_in_first_occurrence_order(size):
    """`_distinct` (the union of a tile's names, by compares, without a sort) against np.unique: the distinct names
    that are not NONE, in the order of their first occurrences, NONE-padded to `size` (those past it dropped), and
    how many; rows with duplicates, NONE entries, an all-NONE row and a name 0."""
    rng = np.random.default_rng(0)
    names = rng.integers(-1, 12, (3, 5, 24)).astype(np.int32)  # -1: NONE
    names[0, 0] = selected.NONE
    names[0, 1, 3] = 0
    union, count = (np.asarray(a) for a in jax.jit(selected._distinct, static_argnums=1)(jnp.asarray(names), size))
    for row, got, n in zip(names.reshape(-1, 24), union.reshape(-1, size), count.reshape(-1)):
        seen, first = np.unique(row[row != selected.NONE], return_index=True)
        want = seen[np.argsort(first)]
        assert n == want.size
        np.testing.assert_array_equal(got, np.pad(want[:size], (0, max(0, size - want.size)), constant_values=-1))


@pytest.mark.parametrize("shape, dtype, S, cu", [
    ((1, 64, 1, 1, 16, 32, 8), "float32", 3, None),  # G = 1: union tiles of 16 tokens
    ((1, 64, 3, 1, 32, 16, 8), "float32", 2, np.array([0, 21, 21, 64], np.int32)),  # G = 3, packed, Dv != Dk
    ((1, 48, 16, 1, 16, 24, 16), "bfloat16", 2, None)], ids=["G1", "G3-packed", "G16-bf16"])  # 8 tokens a tile
def test_union_tiles_match_the_reference(shape, dtype, S, cu):
    """The resident kernels' union tiles: local selections in the first half (their tiles take the union path, in
    the forward and the backward), random ones with repeated entries in the second (token by token), one call; o,
    lse and the gradients dq, dk, dv (the backward from the forward's lse) against the reference."""
    x = Inputs(shape, dtype)
    idx, counts = _half_local(x, S, cu)
    _assert_matches(_kernels(x, idx, counts, cu), _reference(x, idx, counts, cu), x, dtype, "union tiles:")


def test_a_union_tile_never_reads_the_next_sequence():
    """Packed sequences [0, 24) and [24, 48), blocks of 16, G = 16 (union tiles of 8 tokens): tokens 16 to 23 of the
    first take the union path on its block 1, rows 16 to 31, of which 24 to 31 are the second sequence's, NaN here;
    the second's queries list only invalid blocks. Nothing of those rows may reach o, lse or the gradients (the
    backward takes the same union tiles)."""
    B, T, HQ, H, D, bs = 1, 48, 16, 1, 16, 16
    x = Inputs((B, T, HQ, H, D, D, bs), "float32")
    cu = np.array([0, 24, 48], np.int32)
    first = (np.arange(T) < 24)[None, :, None, None]
    idx = np.where(first, _local_indices(B, T, H, 2, bs, cu), 5).astype(np.int32)
    counts = jnp.full((B, T, H), 2, jnp.int32)
    takes = np.asarray(selected.union_tiles(x.q, x.k, x.v, jnp.asarray(idx), counts, jnp.asarray(cu), block_size=bs))
    assert takes[0, 0, 1, 1], takes  # tokens 16 to 23
    x.k, x.v = (jnp.where(~first, jnp.nan, a) for a in (x.k, x.v))
    got = _kernels(x, idx, counts, cu)
    x.k, x.v = (jnp.where(~first, 0.0, a) for a in (x.k, x.v))
    _assert_matches(got, _reference(x, idx, counts, cu), x, "float32", "next sequence, union tiles:")
