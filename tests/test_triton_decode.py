"""The flash-decoding forward kernels (nsa/triton/decode.py) against the reference forwards with kv_lens.

q holds the last TQ tokens of B = 2 sequences in a padded cache of TK = 80 rows, with ragged lengths: one
shorter than a block (TQ + 2 tokens) and one ending mid-block, 3 rows before the cache's end (77). Keys and
values past each length are NaN, and so are the compressed rows no query sees: a kernel that loads one
gives a non-finite result. Each op runs with its default Config and with one that takes the other path
(several splits and the combine, or one split that stores o and lse itself), at G = 1, 3 and 16
(TQ * G up to 80 rows), TQ = 1 and 5 and Dv != Dk; o and lse are compared with the reference forward
run in float64 on the same rounded inputs (NaN rows zeroed), with tests/base.py's relative RMS
tolerances. On the CPU the kernels run in Triton's interpreter (float32, float16); on a GPU
(ON_GPU, pytest -m gpu) the same tests compile them, also in bfloat16, and a standard serving shape
runs too.
"""

import contextlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
import nsa.triton
from nsa._config import Shapes
from nsa._device import TABLE
from nsa.reference import compressed as ref_compressed
from nsa.reference import selected as ref_selected
from nsa.reference import window as ref_window
from nsa.triton import _splits, decode
from tests.base import TOLERANCE, assert_close
from tests.conftest import ON_GPU

# on a GPU, scripts/gpu.sh (pytest -m gpu) runs them; on the CPU they run in Triton's interpreter
pytestmark = [pytest.mark.gpu] if ON_GPU else [pytest.mark.interpreted]

DTYPES = ["float32", "float16"] + (["bfloat16"] if ON_GPU else [])  # the interpreter has no bfloat16
B, TK, BS = 2, 80, 16
# group name -> (HQ, H, Dk, Dv)
GROUPS = {"G1": (2, 2, 16, 24), "G3": (3, 1, 16, 8), "G16": (16, 1, 16, 32)}
SPLIT = decode.Config(block_n=16, splits=3, num_warps=4, num_stages=2)  # more splits than some rows have tiles
ONE = decode.Config(block_n=16, splits=1, num_warps=4, num_stages=2)  # no combine
FUSED = decode.attention


@pytest.fixture(autouse=True)
def kernels():
    """On the CPU the kernels run in Triton's interpreter; on a GPU they compile (jax-triton)."""
    from nsa.triton import interpreter

    with contextlib.nullcontext() if ON_GPU else interpreter.interpreted():
        yield
    jax.clear_caches()  # an interpreted kernel compiles to a large program


def _rounded(x, dtype):
    x = jnp.asarray(x, dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


class Cache:
    """q [B, TQ, HQ, Dk], k, v [B, TK, H, D] in `dtype` with NaN past kv_lens (and their float64 copies with
    zeros there), kv_lens = [TQ + 2, 77]."""

    def __init__(self, group, TQ, dtype, seed=0):
        HQ, H, Dk, Dv = GROUPS[group]
        rng = np.random.default_rng(seed)
        self.TQ, self.dtype, self.H, self.scale = TQ, dtype, H, Dk ** -0.5
        self.lens = np.array([TQ + 2, 77], np.int32)
        self.q, self.q64 = _rounded(rng.standard_normal((B, TQ, HQ, Dk)), dtype)
        past = np.arange(TK)[None, :, None, None] >= self.lens[:, None, None, None]
        self.k, self.k64 = self._poisoned(rng.standard_normal((B, TK, H, Dk)), past)
        self.v, self.v64 = self._poisoned(rng.standard_normal((B, TK, H, Dv)), past)
        self.rng = rng

    def _poisoned(self, x, poison):
        x, x64 = _rounded(x, self.dtype)
        return jnp.where(poison, jnp.nan, x), np.where(poison, 0.0, x64)

    def compressed(self, block_size):
        """k_cmp, v_cmp [B, TK / block_size, H, D] (random), NaN in the rows no query sees (c >= kv_lens //
        block_size), and their float64 copies with zeros there."""
        NC = TK // block_size
        unseen = np.arange(NC)[None, :, None, None] >= (self.lens // block_size)[:, None, None, None]
        k_cmp = self._poisoned(self.rng.standard_normal((B, NC, self.H, self.k.shape[3])), unseen)
        v_cmp = self._poisoned(self.rng.standard_normal((B, NC, self.H, self.v.shape[3])), unseen)
        return k_cmp, v_cmp

    def block_indices(self, block_size, num_slots=None):
        """int32 [B, TQ, H, S] and counts [B, TQ, H]: each token lists its own block, a visible block twice
        and invalid ids, cycling over the rows through -1, the next block (past p // block_size: NaN keys or
        future ones), 2^30 and a block 3 past; S = 6 slots at TQ = 1 (one more invalid id and one more
        visible block), else 4 (fewer slots to sort in the interpreter; the rows still hold every kind).
        The slots are in a random order; counts from 0 to S (all S for token 0)."""
        TQ, H = self.TQ, self.H
        S = num_slots or (6 if TQ == 1 else 4)
        p = (self.lens[:, None] - TQ + np.arange(TQ))[:, :, None]  # [B, TQ, 1]
        cur = np.broadcast_to(p // block_size, (B, TQ, H))
        seen = self.rng.integers(0, cur + 1)
        row = np.arange(B * TQ * H).reshape(B, TQ, H)
        invalid = np.stack([-np.ones_like(cur), cur + 1, np.full_like(cur, 2 ** 30), cur + 3], -1)
        pick = lambda shift: np.take_along_axis(invalid, ((row + shift) % 4)[..., None], -1)[..., 0]
        slots = np.stack([cur, seen, seen, pick(0), pick(2), self.rng.integers(0, cur + 1)], -1)[..., :S]
        order = np.argsort(self.rng.random(slots.shape), -1)
        idx = np.take_along_axis(slots, order, -1)
        counts = self.rng.integers(0, S + 1, (B, TQ, H))
        counts[:, 0] = S
        return jnp.asarray(idx, jnp.int32), jnp.asarray(counts, jnp.int32)


def _reference(forward, *arrays, **kw):
    """A reference forward in float64 (arrays: NumPy float64 and int), as (o, lse) NumPy arrays."""
    with jax.enable_x64(True):
        out, residuals = forward(*(None if a is None else jnp.asarray(a) for a in arrays), **kw)
        o, lse = out if isinstance(out, tuple) else (out, residuals[-1])
        return np.asarray(o), np.asarray(lse)


def _check(got, ref, x):
    o, lse = got
    o_ref, lse_ref = ref
    assert o.dtype == x.q.dtype and o.shape == o_ref.shape
    assert lse.dtype == jnp.float32 and lse.shape == lse_ref.shape
    assert_close(o, o_ref, TOLERANCE[x.dtype], "o")
    lse = np.asarray(lse, np.float64)
    np.testing.assert_array_equal(lse == -np.inf, lse_ref == -np.inf)
    assert np.all(np.asarray(o, np.float32)[lse == -np.inf] == 0)
    seen = np.isfinite(lse_ref)
    assert_close(lse[seen], lse_ref[seen], TOLERANCE[x.dtype], "lse")


# each group at TQ = 1 and 5, the dtypes taking turns (each group and each TQ in every dtype of the CPU's
# interpreter; on a GPU every combination): a dtype changes the loads' and stores' types, not the program
CASES = pytest.mark.parametrize("group, TQ, dtype", [
    pytest.param(g, tq, d, id=f"{g}-TQ{tq}-{d}") for i, g in enumerate(GROUPS) for j, tq in enumerate((1, 5))
    for n, d in enumerate(DTYPES) if ON_GPU or n == (i + j) % len(DTYPES)])


@CASES
@pytest.mark.parametrize("window_size", [24, 1000])  # 1000: larger than every sequence and the cache
def test_window(group, TQ, dtype, window_size):
    """Default Config (window 24: one 32-key tile, one split that stores o and lse; 1000: two 64-key tiles,
    two splits and the combine) and SPLIT (3 splits of 16-key tiles; the short sequence has fewer tiles
    than splits)."""
    x = Cache(group, TQ, dtype)
    ref = _reference(ref_window.forward, x.q64, x.k64, x.v64, None, x.lens, window_size=window_size, scale=x.scale)
    for config in (None, SPLIT):
        _check(decode.window(x.q, x.k, x.v, jnp.asarray(x.lens), window_size=window_size, scale=x.scale,
                             config=config), ref, x)


@CASES
def test_compressed(group, TQ, dtype):
    """block_size 4: 20 compressed rows (one tile by default; two tiles of 16 over 3 splits with SPLIT); the
    first sequence's first queries see none."""
    x = Cache(group, TQ, dtype)
    (k_cmp, k_cmp64), (v_cmp, v_cmp64) = x.compressed(4)
    ref = _reference(ref_compressed.forward, x.q64, k_cmp64, v_cmp64, None, x.lens, block_size=4, scale=x.scale)
    for config in (None, SPLIT):
        _check(decode.compressed(x.q, k_cmp, v_cmp, jnp.asarray(x.lens), block_size=4, stride=4, scale=x.scale,
                                 config=config),
               ref, x)


@CASES
def test_selected(group, TQ, dtype):
    """Default Config (5 splits: one per block of the cache, then the combine) and ONE (one split)."""
    x = Cache(group, TQ, dtype)
    idx, counts = x.block_indices(BS)
    ref = _reference(ref_selected.forward, x.q64, x.k64, x.v64, idx, counts, None, x.lens, block_size=BS,
                     scale=x.scale)
    for config in (None, ONE):
        _check(decode.selected(x.q, x.k, x.v, idx, counts, jnp.asarray(x.lens), block_size=BS, scale=x.scale,
                               config=config), ref, x)


def test_selected_blocks_in_chunks_and_deterministic():
    """block_size 32 loaded in two chunks of 16 keys, over two splits; two jitted runs are bitwise equal."""
    x = Cache("G3", 5, "float32", seed=3)
    idx, counts = x.block_indices(32, num_slots=4)
    cfg = decode.Config(block_n=16, splits=2, num_warps=4, num_stages=2)
    run = jax.jit(lambda q, k, v, idx, counts, lens: decode.selected(q, k, v, idx, counts, lens, block_size=32,
                                                                     scale=x.scale, config=cfg))
    first, second = (run(x.q, x.k, x.v, idx, counts, jnp.asarray(x.lens)) for _ in range(2))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ref = _reference(ref_selected.forward, x.q64, x.k64, x.v64, idx, counts, None, x.lens, block_size=32,
                     scale=x.scale)
    _check(first, ref, x)


def test_window_splits_deterministic_under_jit():
    x = Cache("G16", 1, "float32", seed=4)
    run = jax.jit(lambda q, k, v, lens: decode.window(q, k, v, lens, window_size=40, scale=x.scale, config=SPLIT))
    first, second = (run(x.q, x.k, x.v, jnp.asarray(x.lens)) for _ in range(2))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _check(first, _reference(ref_window.forward, x.q64, x.k64, x.v64, None, x.lens, window_size=40, scale=x.scale), x)


@pytest.mark.parametrize("group, TQ, gated, window_size, gradient", [
    ("G3", 1, "every", 24, True), ("G16", 1, "g_cmp", 0, False), ("G1", 5, "every", 24, False)],
    ids=["G3-3-gates", "G16-g_cmp-no-window", "G1-5-tokens-3-gates"])
def test_fused_step_equals_the_ops(group, TQ, gated, window_size, gradient, monkeypatch):
    """nsa.attention over the cache with the compressed branch on and the blocks selected runs the fused
    kernels (decode.attention: compressed and window splits in one launch, the selection reading the
    compressed partials, one combine with the gates), and returns the ops' result (run one after another by
    the same decode kernels) and the float64 reference's: G = 3, 16 and 1 (five tokens), all three gates, or
    g_cmp alone (g_slc weight 1) without a window; block 4 (20 compressed rows, so each branch has splits to
    merge); NaN past each sequence. Under jax.grad the ops run, so the gradient is theirs exactly (checked on the
    first case: the interpreted training kernels' backward takes a minute a case)."""
    x = Cache(group, TQ, "float32")
    bs, slots = 4, 3
    k_cmp, v_cmp = (nsa.compress(y, block_size=bs) for y in (x.k, x.v))  # NaN in blocks past each sequence
    gates = [jnp.asarray(x.rng.uniform(0, 1, x.q.shape[:3]), jnp.float32) for _ in range(3)]
    names = ("g_cmp", "g_slc", "g_swa") if gated == "every" else ("g_cmp",)
    lens = jnp.asarray(x.lens)

    def step(q, k_cmp, implementation="triton"):
        return nsa.attention(q, x.k, x.v, **dict(zip(names, gates)), k_cmp=k_cmp, v_cmp=v_cmp, kv_lens=lens,
                             block_counts=slots, block_size=bs, window_size=window_size,
                             implementation=implementation)

    calls = []
    monkeypatch.setattr(decode, "attention", lambda *a, **kw: calls.append(decode.Step(*a)) or FUSED(*a, **kw))
    got = step(x.q, k_cmp)
    assert calls, "the fused kernels did not run"
    assert calls[0].kv_lens is not None and (calls[0].g_swa is None) == (gated != "every")
    with monkeypatch.context() as m:
        m.setattr(nsa.triton, "fused_step", lambda q, k, static: None)  # the family has no fused step: the ops run
        ops = step(x.q, k_cmp)
        loss = lambda q, kc: jnp.sum(step(q, kc) ** 2)
        grads_ops = jax.grad(loss, (0, 1))(x.q, k_cmp) if gradient else None
    reference = step(x.q, k_cmp, "xla")
    assert got.dtype == x.q.dtype and got.shape == ops.shape
    assert_close(got, ops, 1e-6, "fused against the ops")
    assert_close(got, reference, TOLERANCE["float32"], "fused against the reference")
    if gradient:
        calls.clear()
        grads = jax.grad(loss, (0, 1))(x.q, k_cmp)
        assert not calls, "the fused kernels ran under jax.grad"
        for g, g_ops in zip(grads, grads_ops):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ops))


def _paged(x, k_cmp, v_cmp, page, rng):
    """x's contiguous cache (k, v and the compressed rows k_cmp, v_cmp of block 4) in pages of `page` tokens, as an
    nsa.PagedKVCache: the sequences' pages in a random order in a pool with spare pages, every row nobody owns NaN;
    sequence 0's table holds -1 and a page of sequence 1 past its length (rows it never reads)."""
    MP = TK // page
    P = B * MP + 3
    order = rng.permutation(P)[:B * MP].reshape(B, MP)
    table = order.copy()
    table[0, 1] = order[1, 2]  # sequence 0 has TQ + 2 <= 7 tokens: page 0 alone holds them
    table[0, 2:] = -1
    pools = []
    for seq, unit in ((x.k, 1), (x.v, 1), (k_cmp, 4), (v_cmp, 4)):
        rows = page // unit
        pool = np.full((P, rows) + seq.shape[2:], np.nan, np.float32)
        for b in range(B):
            for j in range(MP):
                if table[b, j] == order[b, j]:
                    pool[order[b, j]] = np.asarray(seq[b, j * rows:(j + 1) * rows], np.float32)
        pools.append(jnp.asarray(pool, seq.dtype))
    return nsa.PagedKVCache(*pools, page_table=jnp.asarray(table, jnp.int32), lens=jnp.asarray(x.lens),
                            block_size=4)


@pytest.mark.parametrize("group, TQ", [("G3", 1), ("G1", 5)], ids=["G3-decode", "G1-5-tokens"])
def test_fused_step_reads_a_paged_cache_through_its_table(group, TQ, monkeypatch):
    """nsa.attention over an nsa.PagedKVCache runs the fused kernels on its pools and page table (no gather of the
    cache into each sequence's order: the step's jaxpr has no gather of a cache-sized array), and its output equals
    that over the same rows in a contiguous KVCache bitwise: the same kernels read the same rows (pages of 16 tokens
    in a random order, a NaN pool, -1 and another sequence's page in the table past a sequence's length)."""
    x = Cache(group, TQ, "float32", seed=5)
    k_cmp, v_cmp = (nsa.compress(y, block_size=4) for y in (x.k, x.v))
    paged = _paged(x, k_cmp, v_cmp, 16, x.rng)
    contiguous = nsa.KVCache(x.k, x.v, k_cmp, v_cmp, jnp.asarray(x.lens), block_size=4)
    gates = [jnp.asarray(x.rng.uniform(0, 1, x.q.shape[:3]), jnp.float32) for _ in range(3)]

    def step(q, cache):
        return nsa.attention(q, cache=cache, g_cmp=gates[0], g_slc=gates[1], g_swa=gates[2], block_counts=3,
                             window_size=24, implementation="triton")

    calls = []
    monkeypatch.setattr(decode, "attention", lambda *a, **kw: calls.append(decode.Step(*a)) or FUSED(*a, **kw))
    got = step(x.q, paged)
    assert len(calls) == 1 and calls[0].page_table is not None and calls[0].k.shape == paged.k.shape
    want = step(x.q, contiguous)
    assert calls[1].page_table is None
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.all(np.isfinite(np.asarray(got)))

    def gathers(jaxpr):  # the output shapes of every gather, sub-jaxprs included
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "gather":
                yield from (v.aval.shape for v in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from gathers(sub)

    cache_rows = B * TK  # every sequence's rows [B, MP, S, H, D]: what `nsa._kvcache.gathered` makes of the pages
    shapes = list(gathers(jax.make_jaxpr(step)(x.q, paged).jaxpr))
    assert not [s for s in shapes if np.prod(s[:-2]) >= cache_rows], shapes


def test_fused_step_takes_a_ragged_steps_rows(monkeypatch):
    """A ragged step (q_lens: sequence b's queries are the first q_lens[b] of the TQ = 5 rows) runs the fused kernels
    on q_lens itself (no roll): each query equals the ops' (the rows rolled, nsa.api._ragged) and the reference's,
    and the padding rows are exactly 0 (NaN keys past each sequence, its padding rows' q and gates NaN too)."""
    x = Cache("G3", 5, "float32", seed=6)
    k_cmp, v_cmp = (nsa.compress(y, block_size=4) for y in (x.k, x.v))
    q_lens = jnp.asarray([2, 5], jnp.int32)
    padding = np.arange(5)[None, :] >= np.asarray(q_lens)[:, None]  # [B, TQ]
    poison = lambda y: jnp.where(padding.reshape(padding.shape + (1,) * (y.ndim - 2)), jnp.nan, y)
    gates = [poison(jnp.asarray(x.rng.uniform(0, 1, x.q.shape[:3]), jnp.float32)) for _ in range(3)]

    def step(implementation="triton"):
        return nsa.attention(poison(x.q), x.k, x.v, g_cmp=gates[0], g_slc=gates[1], g_swa=gates[2], k_cmp=k_cmp,
                             v_cmp=v_cmp, kv_lens=jnp.asarray(x.lens), q_lens=q_lens, block_counts=3, block_size=4,
                             window_size=24, implementation=implementation)

    calls = []
    monkeypatch.setattr(decode, "attention", lambda *a, **kw: calls.append(decode.Step(*a)) or FUSED(*a, **kw))
    got = np.asarray(step())
    assert len(calls) == 1 and calls[0].q_lens is not None and calls[0].q.shape == x.q.shape
    with monkeypatch.context() as m:
        m.setattr(nsa.triton, "fused_step", lambda q, k, static: None)  # the family has no fused step: the ops run
        ops = np.asarray(step())
    reference = np.asarray(step("xla"))
    np.testing.assert_array_equal(got[padding], 0.0)
    np.testing.assert_array_equal(reference[padding], 0.0)
    assert_close(got[~padding], ops[~padding], 1e-6, "fused against the ops")
    assert_close(got[~padding], reference[~padding], TOLERANCE["float32"], "fused against the reference")


def test_default_config_and_applies():
    """The heuristic at the standard serving shape (HQ = 64, H = 4, D = 128, bf16, block 64, 16 slots,
    window 512, TK = 65536) on an H200: 33 splits wanted at B = 1 (132 SMs / 4 heads), capped by the work
    units; one split (no combine) at B = 64; on an H100 PCIe (114 SMs) 29 at most. Stages within the device's
    shared memory. applies: TQ <= 16 and TQ * G <= 128 rows."""
    shape = lambda B, T, heads, D: jax.ShapeDtypeStruct((B, T, heads, D), jnp.bfloat16)
    h200, pcie = TABLE["NVIDIA H200"], TABLE["NVIDIA H100 PCIe"]
    for B, splits, device in ((1, (8, 16, 16), h200), (64, (1, 1, 1), h200), (1, (8, 16, 16), pcie)):
        q, k, k_cmp = shape(B, 1, 64, 128), shape(B, 65536, 4, 128), shape(B, 65536 // 64, 4, 128)
        window = decode.default_config(Shapes.of(q, k, window_size=512), jnp.bfloat16, device)
        compressed = decode.default_config(Shapes.of(q, k_cmp, block_size=64), jnp.bfloat16, device)
        selected = decode.default_config(Shapes.of(q, k, block_size=64, block_counts=16), jnp.bfloat16, device)
        assert (window.splits, compressed.splits, selected.splits) == splits
        assert window.block_n == compressed.block_n == selected.block_n == 64
    long = Shapes.of(shape(1, 1, 64, 128), shape(1, 524288 // 64, 4, 128), block_size=64)
    assert [decode.default_config(long, jnp.bfloat16, d).splits for d in (h200, pcie)] == [33, 29]
    # TQ = 8 (128 rows): three stages fit an H200's 227 KiB (160 KiB compiled for sm_90), two an A100's 163
    tall = Shapes.of(shape(1, 8, 64, 128), shape(1, 65536, 4, 128), window_size=512)
    stages = [decode.default_config(tall, jnp.bfloat16, TABLE[d]).num_stages for d in ("NVIDIA A100-SXM4-80GB",
                                                                                        "NVIDIA H200")]
    assert stages == [2, 3]
    k = shape(1, 65536, 4, 128)
    assert _splits.applies(shape(1, 8, 64, 128), k) and not _splits.applies(shape(1, 9, 64, 128), k)
    assert _splits.applies(shape(1, 16, 4, 128), k) and not _splits.applies(shape(1, 17, 4, 128), k)


def test_decoding_is_an_explicit_choice():
    """An op's forward runs the decode kernels where decode=None finds few queries at the end of a cache, or
    where decode=True says so; a pinned Config of the other kernels raises rather than switching decode off,
    and decode=False runs the training kernels on it. The Configs check their fields when made."""
    from nsa.triton import _flash, window

    x = Cache("G3", 1, "float32")
    lens = jnp.asarray(x.lens)
    kw = dict(window_size=24, scale=x.scale)
    training = _flash.default_config(Shapes.of(x.q, x.k, x.v, window_size=24), x.q.dtype, TABLE["NVIDIA H200"])
    with pytest.raises(ValueError, match="config: expected None or a nsa.triton.decode.Config.*decode=False"):
        window.forward(x.q, x.k, x.v, None, lens, config=training, **kw)
    with pytest.raises(ValueError, match="decode: expected None or False without kv_lens"):
        window.forward(x.q, x.k, x.v, None, None, decode=True, **kw)
    ref = _reference(ref_window.forward, x.q64, x.k64, x.v64, None, x.lens, **kw)
    for config, decode_arg in ((SPLIT, None), (training, False), (None, True)):
        o, res = window.forward(x.q, x.k, x.v, None, lens, config=config, decode=decode_arg, **kw)
        _check((o, res[-1]), ref, x)
    with pytest.raises(ValueError, match=r"nsa.triton.decode.Config.splits: expected a positive int, got 0"):
        SPLIT._replace(splits=0)
    with pytest.raises(ValueError, match=r"block_n: expected a power of two, got 24"):
        decode.Config(block_n=24, splits=1, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match=r"kv_lens: expected shape \[B\] = \(2,\), got \(3,\)"):
        decode.window(x.q, x.k, x.v, jnp.zeros(3, jnp.int32), **kw)


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 16])
@pytest.mark.parametrize("TQ", [1, 4])
def test_standard_shape_on_gpu(B, TQ):
    """HQ = 64, H = 4, D = 128, bf16, block 64, 16 slots, window 512, TK = 8192 with ragged lengths, each op
    against the float32 reference (the default Configs: 8 to 16 splits at B = 1, 2 to 3 at B = 16)."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU and jax-triton")
    HQ, H, D, bs, S, W, T = 64, 4, 128, 64, 16, 512, 8192
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, TQ, HQ, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, H, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, H, D), jnp.bfloat16)
    lens = jax.random.randint(keys[3], (B,), TQ, T + 1).at[0].set(T).astype(jnp.int32)
    k_cmp, v_cmp = (x.reshape(B, T // bs, bs, H, D).mean(2) for x in (k, v))
    p = lens[:, None, None, None] - TQ + jnp.arange(TQ)[None, :, None, None]
    idx = jnp.maximum(p // bs - jax.random.randint(keys[4], (B, TQ, H, S), 0, 40), -1).astype(jnp.int32)
    counts = jnp.full((B, TQ, H), S, jnp.int32)
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]
    scale = D ** -0.5
    runs = [
        (decode.window(q, k, v, lens, window_size=W, scale=scale),
         ref_window.forward(*f32(q, k, v), None, lens, window_size=W, scale=scale)),
        (decode.compressed(q, k_cmp, v_cmp, lens, block_size=bs, stride=bs, scale=scale),
         ref_compressed.forward(*f32(q, k_cmp, v_cmp), None, lens, block_size=bs, scale=scale)),
        (decode.selected(q, k, v, idx, counts, lens, block_size=bs, scale=scale),
         ref_selected.forward(*f32(q, k, v), idx, counts, None, lens, block_size=bs, scale=scale)),
    ]
    for (o, lse), (out, residuals) in runs:
        o_ref, lse_ref = out if isinstance(out, tuple) else (out, residuals[-1])
        assert_close(o, o_ref, TOLERANCE["bfloat16"], "o")
        lse, lse_ref = np.asarray(lse, np.float64), np.asarray(lse_ref, np.float64)
        np.testing.assert_array_equal(lse == -np.inf, lse_ref == -np.inf)
        assert_close(lse[np.isfinite(lse_ref)], lse_ref[np.isfinite(lse_ref)], TOLERANCE["bfloat16"], "lse")
