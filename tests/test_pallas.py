"""The shared test base on the Pallas TPU kernels (implementation="pallas"), run on the CPU in Pallas's TPU
interpret mode with its race detector on; and nsa.attention lowered for TPU.

The export (`jax.export(..., platforms=["tpu"])` on this CPU machine) lowers every kernel through
Pallas's Mosaic lowering, which catches the layout and tiling errors that interpret mode lets through,
and shows that the choice between Mosaic and interpret mode is made at lowering (platform_dependent):
the exported module calls the Mosaic kernel of every op, forward and backward; so does a serving step on
a KV cache (decode and chunked prefill, kv_lens traced).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa._config import Shapes
from nsa._device import facts
from nsa.pallas.tpu import select as pallas_select
from tests.base import GRAD_TOLERANCE, SHAPES, TOLERANCE, Inputs, NSATestBase, assert_close


@pytest.mark.interpreted
class TestPallasInterpreted(NSATestBase):
    implementation = "pallas"
    dtypes = ("float32", "bfloat16", "float16")
    interpreted = True

    @pytest.fixture(autouse=True)
    def _race_detector(self, pallas_races):
        pass

    def test_gradient_under_checkpoint(self):
        """Interpret mode runs each kernel's memory operations as ordered host callbacks, effects that
        jax.checkpoint cannot partially evaluate (a limit of Pallas's TPU interpret mode, which
        implementation="pallas" runs on a CPU: NotImplementedError). The Mosaic kernels have no effects:
        with implementation=None the checkpointed gradient of nsa.attention lowers for TPU, to the same
        kernels as without checkpoint."""
        x = Inputs(SHAPES["G2"], "float32")
        _, loss = self._loss(x)
        with pytest.raises(NotImplementedError, match="Effects not supported in (partial-eval|AD) of `checkpoint`"):
            jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))(x.q, x.k, x.v)
        self.implementation = None
        _, loss = self._loss(x)
        kernels = [_mosaic_kernels(jax.export.export(jax.jit(jax.grad(f, argnums=(0, 1, 2))), platforms=["tpu"])(
            x.q, x.k, x.v).mlir_module()) for f in (loss, jax.checkpoint(loss))]
        assert set(kernels[1]) == set(kernels[0]) == training_kernels(backward=True)


# The Mosaic kernels of each op, by the name they carry in the exported module: with a KV cache (the union kernels of
# selected attention, the window's flash kernels), and in training (`training_kernels`).
FORWARD_KERNELS = {"compressed_forward", "select", "selected_forward", "window_forward"}
BACKWARD_KERNELS = {"compressed_dq", "compressed_dkdv", "selected_dq", "selected_dkdv", "selected_dkdv_reduce",
                    "window_dq", "window_dkdv"}


def training_kernels(backward, resident=True, splash=False, ranges=False):
    """The kernels of nsa.attention without a KV cache: selected attention's resident kernels where they fit (else
    its union kernels), the window's and compressed attention's resident kernels where they take them (`ranges`: G a
    multiple of the sublanes), else those two by splash attention where it takes them (heads of 128 lanes in bf16 or
    float32; forward with its residuals, backward its dq and dk/dv kernels from them: no forward again) or by the
    flash kernels."""
    names = {"select"}
    if resident:
        names |= {"selected_resident_forward"} | ({"selected_resident_backward"} if backward else set())
    else:
        names |= {"selected_forward"} | (
            {"selected_dq", "selected_dkdv", "selected_dkdv_reduce"} if backward else set())
    if ranges:
        for branch in ("compressed", "window"):
            names |= {f"{branch}_resident_forward"} | ({f"{branch}_resident_backward"} if backward else set())
    elif splash:
        names |= {SPLASH_FORWARD} | ({"splash_mha_dq_no_residuals", "splash_mha_dkv_no_residuals"}
                                     if backward else set())
    else:
        for branch in ("compressed", "window"):
            names |= {f"{branch}_forward"} | ({f"{branch}_dq", f"{branch}_dkdv"} if backward else set())
    return names


SPLASH_FORWARD = "splash_mha_fwd_residuals"  # splash's forward kernel, once for each of compressed and window


def _mosaic_kernels(module):
    """The kernel names of the Mosaic calls (tpu_custom_call) in an exported module's text."""
    return re.findall(r'kernel_name = "(\w+)"', module)


@pytest.mark.parametrize("shape, dtype, compression", [
    pytest.param((1, 8192, 64, 4, 128, 128), jnp.bfloat16, {}, id="standard-bf16"),  # the standard shape
    pytest.param((1, 1000, 6, 2, 64, 48), jnp.float32, {}, id="odd-G3-dv48-f32"),
    # the paper's NSA: windows of 32 tokens every 16, selection blocks of 64
    pytest.param((1, 8192, 64, 4, 128, 128), jnp.bfloat16, dict(compress_block_size=32, compress_stride=16),
                 id="paper-l32-d16-bf16"),
])
@pytest.mark.parametrize("implementation", ["pallas", None])
def test_attention_lowers_for_tpu_to_mosaic_kernels(shape, dtype, compression, implementation, monkeypatch):
    """nsa.attention (block 64, 16 blocks, window 512, all gates; compression windows of 64 tokens, or the
    paper's), jitted forward and forward+backward, exported for a TPU v5e: every op runs its Mosaic kernel, with
    implementation="pallas" and with None; selected attention its resident kernels (within the v5e's VMEM), the
    window and compressed attention their resident kernels where G is a multiple of the sublanes, else splash
    attention at heads of 128, each forward once."""
    monkeypatch.setenv("NSA_DEVICE_KIND", "TPU v5 lite")
    B, T, HQ, H, Dk, Dv = shape
    splash = Dk % 128 == Dv % 128 == 0
    ranges = (HQ // H) % (16 if dtype == jnp.bfloat16 else 8) == 0  # the window's and compressed resident kernels
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in [(B, T, HQ, Dk), (B, T, H, Dk), (B, T, H, Dv)]]
    gates = [jax.ShapeDtypeStruct((B, T, HQ), dtype)] * 3

    def forward(q, k, v, g_cmp, g_slc, g_swa):
        return nsa.attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_size=64, block_counts=16,
                             window_size=512, implementation=implementation, **compression)

    def loss(*args):
        return jnp.sum(forward(*args).astype(jnp.float32))

    for function, backward in ((forward, False), (jax.grad(loss, argnums=range(6)), True)):
        kernels = _mosaic_kernels(jax.export.export(jax.jit(function), platforms=["tpu"])(*specs, *gates).mlir_module())
        assert set(kernels) == training_kernels(backward=backward, splash=splash, ranges=ranges)
        # the backward runs no forward again: splash's forward once for compressed attention, once for the window
        assert kernels.count(SPLASH_FORWARD) == (2 if splash and not ranges else 0)
        for branch in ("compressed", "window"):  # nor do their resident kernels
            assert kernels.count(f"{branch}_resident_forward") == ranges


# Serving steps at the standard heads (HQ = 64, H = 4, D = 128, bf16; block 64, 16 blocks, window 512):
# (B, TQ queries per sequence, TK rows of cache).
SERVING = {"decode": (16, 1, 65536), "chunked-prefill": (2, 512, 8192)}


def _serving_args(B, TQ, TK):
    """A serving step's arguments as ShapeDtypeStructs: q, k, v (the cache), kv_lens (int32 [B], traced),
    the cache's k_cmp and v_cmp, and the gates g_cmp, g_slc, g_swa."""
    HQ, H, D = 64, 4, 128
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    return [bf16(B, TQ, HQ, D), bf16(B, TK, H, D), bf16(B, TK, H, D), jax.ShapeDtypeStruct((B,), jnp.int32),
            bf16(B, TK // 64, H, D), bf16(B, TK // 64, H, D)] + [bf16(B, TQ, HQ)] * 3


@pytest.mark.parametrize("B, TQ, TK", SERVING.values(), ids=SERVING.keys())
@pytest.mark.parametrize("implementation", ["pallas", None])
def test_serving_step_lowers_for_tpu_to_mosaic_kernels(B, TQ, TK, implementation):
    """nsa.attention on a KV cache (kv_lens traced, the cache's k_cmp and v_cmp given, all gates), jitted
    forward of a decode step and of a chunked-prefill one, exported for TPU: every op runs its Mosaic
    kernel, with implementation="pallas" and with None."""
    def step(q, k, v, kv_lens, k_cmp, v_cmp, g_cmp, g_slc, g_swa):
        return nsa.attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, kv_lens=kv_lens, k_cmp=k_cmp,
                             v_cmp=v_cmp, block_size=64, block_counts=16, window_size=512,
                             implementation=implementation)

    exported = jax.export.export(jax.jit(step), platforms=["tpu"])(*_serving_args(B, TQ, TK))
    assert set(_mosaic_kernels(exported.mlir_module())) == FORWARD_KERNELS


def _cache_sized_writes(module, TK):
    """The ops of an exported module's text that produce an array with a dimension of TK or more: an O(TK)
    copy, transpose or relayout (reshapes included: on a TPU, merging k's head and feature dims changes its
    tiled layout), but a while loop's results (its carried inputs, passed through)."""
    found = []
    for line in module.splitlines():
        op = re.search(r'= "?([\w.]+)', line)
        if " = " not in line or not op or op.group(1) == "stablehlo.while":
            continue
        results = re.findall(r"tensor<([\dx]+)x\w+>", line.split("->")[-1])
        if any(int(d) >= TK for shape in results for d in shape.split("x") if d):
            found.append(line.strip())
    return found


def _paged(k, v, k_cmp, v_cmp, kv_lens, page=256):
    """A PagedKVCache of ShapeDtypeStructs holding B sequences of TK rows (k [B, TK, H, D]...) in pages of `page`
    tokens: a pool of B * TK / page pages [P, page, H, D] and a page table int32 [B, TK / page]."""
    B, TK = k.shape[:2]
    pool = lambda x, rows: jax.ShapeDtypeStruct((B * TK // page, rows, *x.shape[2:]), x.dtype)
    table = jax.ShapeDtypeStruct((B, TK // page), jnp.int32)
    return nsa.PagedKVCache(pool(k, page), pool(v, page), pool(k_cmp, page // 64), pool(v_cmp, page // 64), table,
                            kv_lens, block_size=64)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_decode_step_copies_nothing_of_the_cache_size(implementation, paged):
    """A decode step over a 64k-row cache (B = 16, TQ = 1), exported for TPU, writes no array of the cache's
    size outside the kernels: the window's rows are cut and the selected blocks gathered before any
    layout change, so it reads O(TK / block_size + S * block_size + window) rows per KV head. (Before the
    cut and the gather the Pallas step padded and transposed the whole k and v, and viewed them as
    [B, TK, H * D]: this finds each.) Over a paged cache (pages of 256 tokens) the same: the compressed rows are
    gathered through the page table (O(TK / block_size)), the window's rows and the selected blocks read through it
    (`nsa._kvcache.paged_window`, `paged_selected`); gathering the whole pools in each sequence's order, as
    before, wrote two [16, 65536, 4, 128] arrays). With implementation="pallas" the paged step's selected kernel
    takes the pools as they are and copies its blocks through the page table itself (`paged_forward`): no XLA
    gather of the blocks first."""
    B, TQ, TK = SERVING["decode"]
    q, k, v, kv_lens, k_cmp, v_cmp, g_cmp, g_slc, g_swa = _serving_args(B, TQ, TK)
    kw = dict(block_counts=16, window_size=512, implementation=implementation)

    def step(q, k, v, kv_lens, k_cmp, v_cmp, g_cmp, g_slc, g_swa):
        return nsa.attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, kv_lens=kv_lens, k_cmp=k_cmp,
                             v_cmp=v_cmp, block_size=64, **kw)

    def paged_step(q, cache, g_cmp, g_slc, g_swa):
        return nsa.attention(q, cache=cache, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, **kw)

    args = (q, _paged(k, v, k_cmp, v_cmp, kv_lens), g_cmp, g_slc, g_swa) if paged else _serving_args(B, TQ, TK)
    module = jax.export.export(jax.jit(paged_step if paged else step), platforms=["tpu"])(*args).mlir_module()
    assert _cache_sized_writes(module, TK) == []
    assert _cache_sized_writes(module, TK // 64) != []  # the scan sees arrays: k_cmp's rows are written
    if implementation == "pallas":
        assert set(_mosaic_kernels(module)) == FORWARD_KERNELS
    if implementation == "pallas" and paged:
        [call] = [line for line in module.splitlines() if 'kernel_name = "selected_forward"' in line]
        pool = "tensor<{}xbf16>".format("x".join(map(str, args[1].k.shape)))
        assert call.split(" -> ")[0].count(pool) == 2  # k's and v's pools, read through the table in the kernel


def test_a_paged_decode_step_copies_its_blocks_in_the_kernel_and_equals_the_contiguous_one(monkeypatch):
    """implementation="pallas" (interpret mode), heads of 128: a decode step over a paged cache (pages of 16 rows, so
    each selection block of 32 spans two; pages in random order; NaN in every row no sequence wrote; lengths 70, 1
    and 33) runs the selected kernel over the pools (`paged_forward`) and equals the same step over the contiguous
    cache the same appends fill, and so does its gradient (taken through the blocks gathered in XLA)."""
    from nsa.pallas.tpu import selected

    B, HQ, H, D, page, MP = 3, 2, 1, 128, 16, 6
    blocks = dict(block_size=32, compress_block_size=16, compress_stride=16)
    lens = jnp.asarray([70, 1, 33], jnp.int32)
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.standard_normal((B, 70, H, D)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, 1, HQ, D)), jnp.float32)
    gates = tuple(jnp.asarray(rng.uniform(size=(B, 1, HQ)), jnp.float32) for _ in range(3))
    nan = lambda x: jnp.full_like(x, jnp.nan)
    paged = nsa.empty_paged_cache(B * MP + 1, page, B, MP, H, D, dtype=jnp.float32, **blocks)
    paged = paged.replace(k=nan(paged.k), v=nan(paged.v), k_cmp=nan(paged.k_cmp), v_cmp=nan(paged.v_cmp),
                          page_table=jnp.asarray(rng.permutation(B * MP + 1)[:B * MP].reshape(B, MP), jnp.int32))
    caches = [nsa.append_to_cache(cache, k, v, lens=lens)
              for cache in (paged, nsa.empty_cache(B, MP * page, H, D, dtype=jnp.float32, **blocks))]
    calls, original = [], selected.paged_forward
    monkeypatch.setattr(selected, "paged_forward", lambda *a, **kw: calls.append(kw) or original(*a, **kw))

    def loss(q, cache, gates):
        o = nsa.attention(q, cache=cache, **dict(zip(("g_cmp", "g_slc", "g_swa"), gates)), block_counts=2,
                          window_size=8, implementation="pallas")
        return jnp.sum(o * o), o

    o_paged, o = (jax.jit(loss)(q, cache, gates)[1] for cache in caches)
    assert len(calls) == 1 and np.all(np.isfinite(np.asarray(o_paged)))
    assert_close(o_paged, o, TOLERANCE["float32"], "paged o")
    grads_paged, grads = (jax.jit(jax.grad(loss, (0, 2), has_aux=True))(q, cache, gates) for cache in caches)
    for got, want in zip(jax.tree_util.tree_leaves(grads_paged), jax.tree_util.tree_leaves(grads)):
        assert_close(got, want, GRAD_TOLERANCE["float32"], "paged gradient")


@pytest.mark.parametrize("B, TQ, TK", SERVING.values(), ids=SERVING.keys())
def test_serving_step_vmem_budget(B, TQ, TK):
    """Of the kernels' VMEM per grid step only select's depends on the shape (its ranks of every row of
    k_cmp: a cache's NC = TK / 64); at a serving step's, with default_config, it is within its budget. The
    flash and selected kernels' `vmem_bytes` depend on neither T nor TK (tests/test_pallas_flash.py,
    tests/test_pallas_selected.py)."""
    q, _, _, kv_lens, k_cmp = _serving_args(B, TQ, TK)[:5]
    shapes = Shapes.of(q, k_cmp, block_counts=16, block_size=64)  # TK: NC, the rows the cached tokens may see
    config = pallas_select.default_config(shapes, q.dtype, facts("tpu"))
    used = pallas_select.vmem_bytes(16, 128, 2, k_cmp.shape[1], 16, config)
    assert used <= pallas_select.vmem_budget(facts("tpu")) == 12 * 2 ** 20


def test_default_on_cpu_lowers_no_mosaic_kernel():
    """implementation=None exported for the CPU runs the reference: no TPU kernel, no interpret mode."""
    q = jax.ShapeDtypeStruct((1, 256, 4, 32), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 256, 2, 32), jnp.float32)
    f = jax.jit(lambda q, k, v: nsa.attention(q, k, v, block_size=16, block_counts=4, window_size=32))
    module = jax.export.export(f, platforms=["cpu"])(q, k, k).mlir_module()
    assert "tpu_custom_call" not in module and not _mosaic_kernels(module)
