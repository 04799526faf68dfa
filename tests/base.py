"""The one test base that every implementation of nsa runs.

Subclass `NSATestBase` and set its capability flags: `implementation` (None, "xla", "triton",
"pallas"), the `dtypes` it takes (the first runs the tests that do not depend on the dtype) and
`interpreted` (its kernels run in an interpreter on the CPU, every grid step on the host: the tests
then run on a smaller set of cases, `INTERPRETED_CASES`, which still covers G = 1, 3 and 16, Dv != Dk,
a batch of 2, T not a multiple of the block and T < block). Every test below then runs against it:
forward results against the NumPy float64 oracle (tests/oracle.py) on the same rounded inputs,
gradients against jax.grad of the dense float64 formulation (tests/dense.py), varlen against each
sequence alone, edge cases and transformations. The (shape, dtype) cases of a test marked
`@cases(kind)` are made for each subclass from its flags (tests/conftest.py), so a subclass runs only
cases it supports and nothing is skipped.
"""

import contextlib
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nsa
from nsa import pallas
from tests import dense, oracle

# Relative RMS error allowed against float64 on the same rounded inputs: forward, then gradients.
TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 5e-3, "float16": 1e-3}
GRAD_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 1e-2, "float16": 2e-3}
ALL_DTYPES = ["float32", "float64", "bfloat16", "float16"]
# whether this jax lowers the Mosaic GPU kernels (for CUDA, also on a CPU machine: jax.export)
MOSAIC_GPU_LOWERS = jax.__version_info__[:2] >= pallas.MOSAIC_GPU_JAX

# (B, T, HQ, H, Dk, Dv, block_size): group sizes 1, 2, 3, 4, 16; Dv != Dk; T not a multiple of
# block_size; T < block_size.
SHAPES = {
    "G2": (2, 100, 4, 2, 16, 16, 16),
    "G3-dv8": (1, 96, 3, 1, 16, 8, 16),
    "G16": (1, 64, 16, 1, 8, 8, 16),
    "G1-dv32-bs8": (2, 40, 4, 4, 16, 32, 8),
    "G4-bs32": (1, 70, 8, 2, 16, 16, 32),
    "T<bs": (1, 10, 2, 1, 8, 8, 16),
}
# kind -> (shape name, dtype) cases: "forward" results, "attention" (the whole pipeline), "shapes" (the
# tests that take the implementation's first dtype), "gradients".
CASES = {
    # every shape in float32; float64 and the half-precision dtypes on two shapes (the same program in another
    # dtype: rounding is what they add)
    "forward": [(name, dtype) for name in SHAPES for dtype in ALL_DTYPES
                if dtype == "float32" or name in ("G2", "G3-dv8")],
    "shapes": [(name, None) for name in SHAPES],
    "gradients": [("G2", "float32"), ("G3-dv8", "float32"), ("T<bs", "float32"), ("G2", "float64"),
                  ("G2", "bfloat16"), ("G3-dv8", "float16")],
}
# the whole pipeline: every shape in float32 (the ops' own forward cases cover the other dtypes on every shape),
# each other dtype on one shape
CASES["attention"] = [(name, "float32") for name in SHAPES] + [("G2", "float64"), ("G3-dv8", "bfloat16"),
                                                              ("G2", "float16")]
# In an interpreter each kernel compiles for seconds: each shape once, in the dtype named or (where the
# implementation does not take it) its first dtype. Still G = 1, 3, 16; Dv != Dk; B = 2; block 8 and 16;
# T < block; every dtype.
INTERPRETED_CASES = {
    "forward": [("G3-dv8", "float32"), ("G16", "bfloat16"), ("G1-dv32-bs8", "float16"), ("T<bs", "float32")],
    "attention": [("G3-dv8", "bfloat16"), ("G1-dv32-bs8", "float32")],
    "shapes": [(name, None) for name in ("G3-dv8", "G1-dv32-bs8", "T<bs")],
    "gradients": [("G3-dv8", "float32"), ("G1-dv32-bs8", "bfloat16"), ("G16", "float16")],
}

# The transformation tests (jit, checkpoint, vmap, shard_map) on interpreted kernels: the shapes of the same names
# with fewer tokens and narrower heads (the transformations are under test, not the kernels' tiling).
INTERPRETED_TRANSFORM_SHAPES = {"G2": (2, 40, 4, 2, 8, 8, 8), "G3-dv8": (1, 40, 3, 1, 8, 4, 8)}


# The ops of the gradient and varlen tests. Interpreted, each branch's gradient runs on the first gradient case
# and the whole pipeline ("attention", every kernel forward and backward) on each; the varlen tests run the
# pipeline (every kernel packed: a packed selection that went wrong changes its output), for gradients too; each
# kernel's own packed gradients against the reference are its test file's (test_pallas_selected.py's G2-varlen,
# test_triton_selected.py, test_pallas_gpu_selected.py), where a mistake is not diluted by the other branches.
GRADIENT_OPS = ["compressed", "selected", "window", "attention"]
VARLEN_OPS = {"varlen": (["compressed", "select", "selected", "window", "attention"], ["attention"]),
              "varlen_gradients": (GRADIENT_OPS, ["attention"])}

# The ops of the KV-cache tests (test_cached_queries_equal_full_sequence). Interpreted kernels run the two
# nsa.attention cases, which call every op's kernel (compressed, select, selected, window); each kernel's
# own cache cases are in its test file.
CACHED_OPS = ["compressed_attention", "select_blocks", "selected_attention", "sliding_window_attention", "attention",
              "attention-given-blocks"]
INTERPRETED_CACHED_OPS = ["attention", "attention-given-blocks"]
# The ragged serving steps (test_ragged_steps_over_a_paged_cache_equal_full_recompute): tokens each of 3 sequences
# appends and queries per step: a chunk of prefill (13 tokens) beside an idle slot and a sequence shorter than the
# chunk, then decode with an idle slot, then a chunk beside decode (both chunks 13 rows of q, padded).
RAGGED_STEPS = [[13, 0, 5], [1, 1, 0], [3, 6, 1]]
# Their blocks (l, d, l'): windows that do not overlap (those of the Triton decode step), and that do as the paper's;
# interpreted kernels run the first.
RAGGED_BLOCKS = {"l8-d8-s8": (8, 8, 8), "l16-d8-s16": (16, 8, 16)}
BLOCK_ARGS = ("block_size", "compress_block_size", "compress_stride")
# The tokens a step appends in the test of page tables with no page (test_rows_without_a_page_are_never_read):
# decode (the paged kernels' own reads through the table) and a chunk (the pools gathered); interpreted, decode.
PAGELESS_STEPS = {"decode": 1, "chunk": 3}


# Compression windows of l tokens every d with selection blocks of l' (the paper's NSA: 32, 16, 64), as
# (shape (B, T, HQ, H, Dk, Dv), (l, d, l')): several selection blocks per sequence, partial ones at the end,
# G = 2, 1 and 3, B = 2, Dv != Dk. Interpreted kernels run the overlapping ones: both for the ops, the paper's for
# the pipeline and its gradients, G = 3 packed (without the traced cu_seqlens, the same kernels). Triton's
# interpreter, slower per program, runs SMALL_BLOCK_CASES instead: Eq. 9 at (16, 8, 32), whose overlaps are the
# paper's at half the tokens ([1, 2, 2, 2, 1] strides), on one KV head and fewer tokens, still with a choice of
# blocks past the three forced ones; G = 3 packed too.
BLOCK_CASES = {
    "l64-d64-s64": ((1, 330, 4, 2, 16, 16), (64, 64, 64)),
    "l32-d16-s64": ((1, 330, 4, 2, 16, 16), (32, 16, 64)),
    "l16-d8-s32": ((2, 300, 4, 4, 16, 8), (16, 8, 32)),
    "G3-l16-d8-s32": ((1, 300, 3, 1, 16, 16), (16, 8, 32)),
}
SMALL_BLOCK_CASES = {
    "l16-d8-s32-H1": ((1, 200, 2, 1, 16, 16), (16, 8, 32)),
    "G3-l16-d8-s32-T200": ((1, 200, 3, 1, 16, 16), (16, 8, 32)),
}
INTERPRETED_BLOCK_CASES = {"blocks": ["l32-d16-s64", "G3-l16-d8-s32"], "blocks_attention": ["l32-d16-s64"],
                           "blocks_varlen": ["G3-l16-d8-s32"]}
SMALL_INTERPRETED_BLOCK_CASES = {"blocks": list(SMALL_BLOCK_CASES), "blocks_attention": ["l16-d8-s32-H1"],
                                 "blocks_varlen": ["G3-l16-d8-s32-T200"]}
# packed sequences for the blocks' varlen test: an empty one, partial windows and blocks everywhere (interpreted:
# 300 tokens, the first sequence long enough to choose among its blocks)
BLOCK_CU_SEQLENS = np.array([0, 260, 260, 560, 600], np.int32)
SMALL_BLOCK_CU_SEQLENS = np.array([0, 200, 200, 260, 300], np.int32)


def cases(kind, **variants):
    """Marks a test of the base to run over the cases of `kind` its subclass takes (`NSATestBase.case_params`), and
    with one keyword argument {argname: values}, over those variants too: on every case where the subclass is
    `exhaustive` (compiled kernels), else all of them on the first case and the first one on the others (the
    variants exercise an op's arguments, which neither shape nor dtype changes)."""
    return pytest.mark.cases(kind, **variants)


# Packed sequences of lengths 23, 0, 47, 30 (T = 100): an empty one, partial blocks everywhere.
CU_SEQLENS = np.array([0, 23, 23, 70, 100], np.int32)
VARLEN_SHAPE = (1, 100, 4, 2, 16, 16, 16)


def rms(x):
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.mean(x ** 2))) if x.size else 0.0


def rel_rms(x, ref, scale=0.0):
    """RMS(x - ref) / max(RMS(ref), scale): the error relative to the size of the quantity."""
    return rms(np.asarray(x, np.float64) - np.asarray(ref, np.float64)) / max(rms(ref), scale, 1e-30)


def assert_close(x, ref, tol, what, scale=0.0):
    """x against ref: RMS(x - ref) <= tol * max(RMS(ref), scale).

    `scale` is the natural size of the quantity on these inputs (`gradient_scales`). Where ref is
    mathematically zero, or nearly so through cancellation (dq and dk when each query sees one key), ref
    holds only roundoff, which differs between machines: the error is then measured against the scale,
    never against that roundoff.
    """
    x = np.asarray(x, np.float64)
    assert x.shape == np.shape(ref), f"{what}: shape {x.shape} != {np.shape(ref)}"
    assert np.all(np.isfinite(x)), f"{what}: not finite"
    if x.size == 0:
        return
    err = rel_rms(x, ref, scale)
    assert err <= tol, f"{what}: relative RMS error {err:.3g} > {tol:.3g}"


def gradient_scales(q, k, v, do, scale, num_gates=0):
    """The natural size of each gradient of an attention o = softmax(scale q k^T) v with output cotangent
    do, whatever the mask: dq ~ scale RMS(do) RMS(v) RMS(k), dk ~ scale RMS(do) RMS(v) RMS(q),
    dv ~ RMS(do), and a gate's ~ RMS(do) RMS(v). Returns them in the order (q, k, v, gates...)."""
    dp = rms(do) * rms(v)  # the size of do . v, the gradient of a probability
    return [scale * dp * rms(k), scale * dp * rms(q), rms(do)] + [dp] * num_gates


def largest_intermediate(jaxpr):
    """Bytes of the largest array any equation (also inside scan/cond/custom_vjp bodies) produces."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "shape"):
                largest = max(largest, int(np.prod(aval.shape)) * aval.dtype.itemsize)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    largest = max(largest, largest_intermediate(inner))
    return largest


def assert_same_blocks(idx, ref):
    """Equal selections, up to the order inside each row."""
    np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(np.asarray(ref), -1))


def precision(dtype):
    """float64 arrays need jax's x64 mode; every other dtype runs in the test's mode (`NSATestBase.x64`)."""
    return jax.enable_x64(True) if jnp.dtype(dtype) == jnp.float64 else contextlib.nullcontext()


def rounded(x, dtype):
    """x as a jax array of `dtype`, and the float64 NumPy copy of its rounded values."""
    x = jnp.asarray(x, dtype)
    return x, np.asarray(x.astype(jnp.float64) if x.dtype == jnp.float64 else x.astype(jnp.float32), np.float64)


class Inputs:
    """Random q, k, v, gates and output cotangent in `dtype`, with float64 copies (suffix 64)."""

    def __init__(self, shape, dtype, seed=0):
        B, T, HQ, H, Dk, Dv, self.block_size = shape
        self.shape, self.dtype = shape, dtype
        rng = np.random.default_rng(seed)
        self.q, self.q64 = rounded(rng.standard_normal((B, T, HQ, Dk)), dtype)
        self.k, self.k64 = rounded(rng.standard_normal((B, T, H, Dk)), dtype)
        self.v, self.v64 = rounded(rng.standard_normal((B, T, H, Dv)), dtype)
        self.do, self.do64 = rounded(rng.standard_normal((B, T, HQ, Dv)), dtype)
        self.gates = [rounded(rng.uniform(0, 1, (B, T, HQ)), dtype) for _ in range(3)]

    def compressed(self, cu_seqlens=None):
        """(k_cmp, v_cmp) in the dtype and their float64 copies, compressed by the oracle."""
        kw = dict(block_size=self.block_size, cu_seqlens=cu_seqlens)
        return (*rounded(oracle.compress(self.k64, **kw), self.dtype),
                *rounded(oracle.compress(self.v64, **kw), self.dtype))

    def block_indices(self, num_slots, seed=1):
        """Random block ids with -1, out-of-range (also far beyond the sequence) and repeated entries."""
        B, T, _, H = self.shape[:4]
        rng = np.random.default_rng(seed)
        idx = rng.integers(-2, T // self.block_size + 3, (B, T, H, num_slots))
        idx[..., 0] = (rng.integers(0, 1 << 20, (T,)) % (np.arange(T) // self.block_size + 1))[None, :, None]
        idx[:, ::3, :, -1] = 2 ** 30
        idx[:, 1::4, :, 1 % num_slots] = idx[:, 1::4, :, 0]
        return idx.astype(np.int32)


def jitted(fn, *args, **kwargs):
    """fn(*args, **kwargs) under one jax.jit: its floating-point jax arrays traced, everything else (ints, None, lists,
    NumPy arrays, integer jax arrays: block ids, cu_seqlens, kv_lens) closed over, as concrete as in a call outside
    jit. One compile per call instead of an eager dispatch of every op and primitive: on interpreted kernels that
    was 2.6x the time (24.8 against 9.4 s for nsa.attention's first call in Pallas's TPU interpret mode). Inside a
    transformation (an argument is a tracer) fn runs as it is."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return fn(*args, **kwargs)
    traced = [i for i, leaf in enumerate(leaves)
              if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating)]

    def run(*arrays):
        filled = list(leaves)
        for i, array in zip(traced, arrays):
            filled[i] = array
        args, kwargs = jax.tree_util.tree_unflatten(tree, filled)
        return fn(*args, **kwargs)

    return jax.jit(run)(*(leaves[i] for i in traced))


class NSATestBase:
    implementation = None
    dtypes = ("float32", "bfloat16", "float16")
    interpreted = False
    exhaustive = False  # every variant of a test on every case (`cases`): compiled kernels, where tests are cheap
    x64 = False  # jax_enable_x64 on for every test, whatever its inputs' dtype (tests/test_x64.py)
    interpreted_block_cases = INTERPRETED_BLOCK_CASES  # the block tests' cases when interpreted

    @classmethod
    def case_params(cls, kind, **variants):
        """(argnames, pytest params) of a test marked @cases(kind, **variants): its (shape, dtype) cases in the
        dtypes this implementation takes, (for "gradients") the ops with them, or (for "shapes") its shapes; the
        ops of the "cached" and varlen tests; with `variants`, crossed with them as `cases` says."""
        names, params = cls._case_params(kind)
        if not variants:
            return names, params
        [(argname, values)] = variants.items()
        return f"{names}, {argname}", [
            pytest.param(*case.values, value, id=f"{case.id}-{value}") for i, case in enumerate(params)
            for value in values if cls.exhaustive or i == 0 or value == values[0]]

    @classmethod
    def _case_params(cls, kind):
        """(argnames, pytest params) of `kind` without variants: as `case_params` describes them."""
        if kind == "cached":
            return "name", INTERPRETED_CACHED_OPS if cls.interpreted else CACHED_OPS
        if kind == "ragged":
            names = list(RAGGED_BLOCKS)[:1] if cls.interpreted else list(RAGGED_BLOCKS)
            return "blocks", [pytest.param(RAGGED_BLOCKS[name], id=name) for name in names]
        if kind == "pageless":
            names = list(PAGELESS_STEPS)[:1] if cls.interpreted else list(PAGELESS_STEPS)
            return "tn", [pytest.param(PAGELESS_STEPS[name], id=name) for name in names]
        if kind in INTERPRETED_BLOCK_CASES:
            return "name", cls.interpreted_block_cases[kind] if cls.interpreted else list(BLOCK_CASES)
        if kind in VARLEN_OPS:
            return "name", VARLEN_OPS[kind][cls.interpreted]
        if kind == "shapes":
            table = (INTERPRETED_CASES if cls.interpreted else CASES)[kind]
            return "shape", [pytest.param(SHAPES[name], id=name) for name, _ in table]
        params = [pytest.param(SHAPES[name], dtype, id=f"{name}-{dtype}") for name, dtype in cls._shape_dtypes(kind)]
        if kind != "gradients":
            return "shape, dtype", params
        return "name, shape, dtype", [pytest.param(name, *case.values, id=f"{case.id}-{name}")
                                      for i, case in enumerate(params) for name in GRADIENT_OPS
                                      if not cls.interpreted or i == 0 or name == "attention"]

    @classmethod
    def _shape_dtypes(cls, kind):
        """The (shape name, dtype) cases of `kind` in the dtypes this implementation takes."""
        if cls.interpreted:
            return list(dict.fromkeys((name, dtype if dtype in cls.dtypes else cls.dtypes[0])
                                      for name, dtype in INTERPRETED_CASES[kind]))
        return [(name, dtype) for name, dtype in CASES[kind] if dtype in cls.dtypes]

    @pytest.fixture(autouse=True)
    def _x64_mode(self):
        """Each test in jax's x64 mode iff `x64` (float64 inputs turn it on for their own part: `precision`)."""
        with jax.enable_x64(self.x64):
            yield

    @pytest.fixture(autouse=True)
    def _free_compiled_programs(self):
        """An interpreted kernel compiles to a large program: after each test its executables are dropped
        (jax.clear_caches), so that a worker process running many such tests stays small."""
        yield
        if self.interpreted:
            jax.clear_caches()

    def op(self, name):
        """A public op of nsa with this implementation bound, run as `jitted` runs it."""
        return functools.partial(jitted, functools.partial(getattr(nsa, name), implementation=self.implementation))

    # ------------------------------------------------------------------- forward against the oracle

    @cases("forward")
    def test_compressed_attention(self, shape, dtype):
        with precision(dtype):
            x = Inputs(shape, dtype)
            k_cmp, k_cmp64, v_cmp, v_cmp64 = x.compressed()
            o, lse = self.op("compressed_attention")(x.q, k_cmp, v_cmp, block_size=x.block_size)
            o_ref, lse_ref = oracle.compressed_attention(x.q64, k_cmp64, v_cmp64, block_size=x.block_size)
            assert o.dtype == x.q.dtype
            assert lse.dtype == jnp.promote_types(dtype, jnp.float32)
            assert_close(o, o_ref, TOLERANCE[dtype], "o")
            lse = np.asarray(lse, np.float64)
            np.testing.assert_array_equal(lse == -np.inf, lse_ref == -np.inf)
            seen = np.isfinite(lse_ref)
            assert_close(lse[seen], lse_ref[seen], TOLERANCE[dtype], "lse")

    @cases("shapes", block_counts=[3, 1, 2, 5, 40])
    def test_select_blocks(self, shape, block_counts):
        dtype = self.dtypes[0]
        with precision(dtype):
            x = Inputs(shape, dtype)
            k_cmp, k_cmp64, _, _ = x.compressed()
            idx = self.op("select_blocks")(x.q, k_cmp, block_counts=block_counts, block_size=x.block_size)
            ref = oracle.select_blocks(x.q64, k_cmp64, block_counts=block_counts, block_size=x.block_size)
            assert idx.dtype == jnp.int32 and idx.shape == ref.shape
            assert_same_blocks(idx, ref)

    @cases("shapes")
    def test_select_blocks_reusing_compressed_lse(self, shape):
        """nsa.attention hands compressed attention's lse to the selection: the same blocks come out."""
        dtype = self.dtypes[0]
        with precision(dtype):
            x = Inputs(shape, dtype)
            k_cmp, k_cmp64, v_cmp, _ = x.compressed()
            _, lse = self.op("compressed_attention")(x.q, k_cmp, v_cmp, block_size=x.block_size)
            ref = oracle.select_blocks(x.q64, k_cmp64, block_counts=3, block_size=x.block_size)
            slots = ref.shape[-1]  # 3, capped at the blocks of T tokens as nsa.attention caps them
            idx = nsa.api._select(x.q, k_cmp, lse, slots, x.block_size, (x.block_size,) * 2, None, None, None,
                                  self.implementation)
            assert_same_blocks(idx, ref)

    @pytest.mark.parametrize("block_counts", [1, 2, 4])
    def test_select_ties_go_to_lower_ids(self, block_counts):
        """With equal compressed keys every visible block scores the same. q holds multiples of 1/8, so each
        logit q . k_cmp is exact whatever order a kernel's dot sums in (a CPU's BLAS, the interpreter's
        matmul, may sum the columns of one product in different orders)."""
        dtype = self.dtypes[0]
        B, T, HQ, H, D, bs = 1, 130, 4, 2, 8, 8
        with precision(dtype):
            q = jnp.asarray(np.round(8 * np.random.default_rng(0).standard_normal((B, T, HQ, D))) / 8, dtype)
            k_cmp = jnp.ones((B, -(-T // bs), H, D), dtype)
            idx = np.asarray(self.op("select_blocks")(q, k_cmp, block_counts=block_counts, block_size=bs))
        for t in range(T):
            cur = t // bs
            forced = [c for c in (cur, cur - 1, 0) if c >= 0]
            forced = list(dict.fromkeys(forced))  # cur == 0 or cur - 1 == 0 collapse
            rest = [c for c in range(cur + 1) if c not in forced]
            expected = (forced + rest)[:block_counts]
            expected += [-1] * (block_counts - len(expected))
            for h in range(H):
                assert sorted(idx[0, t, h]) == sorted(expected), (t, h)

    @cases("forward", counts=["all", "int", "array"])
    def test_selected_attention(self, shape, dtype, counts):
        with precision(dtype):
            x = Inputs(shape, dtype)
            idx = x.block_indices(5)
            B, T, _, H = shape[:4]
            block_counts = {"all": None, "int": 3,
                            "array": np.random.default_rng(2).integers(0, 7, (B, T, H)).astype(np.int32)}[counts]
            o = self.op("selected_attention")(x.q, x.k, x.v, idx, block_counts=block_counts, block_size=x.block_size)
            ref = oracle.selected_attention(x.q64, x.k64, x.v64, idx, block_counts=block_counts, block_size=x.block_size)
            assert o.dtype == x.q.dtype
            assert_close(o, ref, TOLERANCE[dtype], "o")

    @cases("forward", window_size=[7, 1, 1000])
    def test_sliding_window_attention(self, shape, dtype, window_size):
        with precision(dtype):
            x = Inputs(shape, dtype)
            o = self.op("sliding_window_attention")(x.q, x.k, x.v, window_size=window_size)
            ref = oracle.sliding_window_attention(x.q64, x.k64, x.v64, window_size=window_size)
            assert o.dtype == x.q.dtype
            assert_close(o, ref, TOLERANCE[dtype], "o")

    @cases("attention", variant=["all-gates", "no-cmp", "given-indices", "default-gates"])
    def test_attention(self, shape, dtype, variant):
        with precision(dtype):
            x = Inputs(shape, dtype)
            (g_cmp, g_cmp64), (g_slc, g_slc64), (g_swa, g_swa64) = x.gates
            kw = dict(block_counts=3, block_size=x.block_size, window_size=9)
            if variant == "no-cmp":
                gates, gates64 = dict(g_slc=g_slc, g_swa=g_swa), dict(g_slc=g_slc64, g_swa=g_swa64)
            elif variant == "default-gates":
                gates, gates64 = dict(g_cmp=g_cmp), dict(g_cmp=g_cmp64)
            else:
                gates = dict(g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa)
                gates64 = dict(g_cmp=g_cmp64, g_slc=g_slc64, g_swa=g_swa64)
            if variant == "given-indices":  # the window off, so without its gate (which would raise)
                kw.update(block_indices=x.block_indices(4), block_counts=None, window_size=0)
                del gates["g_swa"], gates64["g_swa"]
            o = self.op("attention")(x.q, x.k, x.v, **gates, **kw)
            ref = oracle.attention(x.q64, x.k64, x.v64, **gates64, **kw)
            assert o.dtype == x.q.dtype
            assert_close(o, ref, TOLERANCE[dtype], "o")

    def test_explicit_scale(self):
        """Every op with scale=0.3 instead of the default Dk ** -0.5."""
        dtype, scale = self.dtypes[0], 0.3
        with precision(dtype):
            x = Inputs(SHAPES["G3-dv8"], dtype)
            bs = x.block_size
            k_cmp, k_cmp64, v_cmp, v_cmp64 = x.compressed()
            idx = x.block_indices(4)
            g = [gi[0] for gi in x.gates]
            g64 = [gi[1] for gi in x.gates]
            o, lse = self.op("compressed_attention")(x.q, k_cmp, v_cmp, block_size=bs, scale=scale)
            o_ref, lse_ref = oracle.compressed_attention(x.q64, k_cmp64, v_cmp64, block_size=bs, scale=scale)
            assert_close(o, o_ref, TOLERANCE[dtype], "compressed o")
            seen = np.isfinite(lse_ref)
            assert_close(np.asarray(lse)[seen], lse_ref[seen], TOLERANCE[dtype], "compressed lse")
            assert_same_blocks(self.op("select_blocks")(x.q, k_cmp, block_counts=3, block_size=bs, scale=scale),
                               oracle.select_blocks(x.q64, k_cmp64, block_counts=3, block_size=bs, scale=scale))
            assert_close(self.op("selected_attention")(x.q, x.k, x.v, idx, block_size=bs, scale=scale),
                         oracle.selected_attention(x.q64, x.k64, x.v64, idx, block_size=bs, scale=scale),
                         TOLERANCE[dtype], "selected o")
            assert_close(self.op("sliding_window_attention")(x.q, x.k, x.v, window_size=7, scale=scale),
                         oracle.sliding_window_attention(x.q64, x.k64, x.v64, window_size=7, scale=scale),
                         TOLERANCE[dtype], "window o")
            kw = dict(block_counts=3, block_size=bs, window_size=7, scale=scale)
            assert_close(self.op("attention")(x.q, x.k, x.v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], **kw),
                         oracle.attention(x.q64, x.k64, x.v64, g_cmp=g64[0], g_slc=g64[1], g_swa=g64[2], **kw),
                         TOLERANCE[dtype], "attention o")

    # ------------------------------------------------------------------------- packed sequences

    def _varlen_call(self, name, bs):
        """Op `name` as a function of (q, k, v, gates, block_indices, cu_seqlens) -> a tuple of outputs."""

        def compressed(q, k, v, g, idx, cu):
            k_cmp, v_cmp = nsa.compress(k, block_size=bs, cu_seqlens=cu), nsa.compress(v, block_size=bs, cu_seqlens=cu)
            return self.op("compressed_attention")(q, k_cmp, v_cmp, block_size=bs, cu_seqlens=cu)

        def select(q, k, v, g, idx, cu):
            k_cmp = nsa.compress(k, block_size=bs, cu_seqlens=cu)
            return (self.op("select_blocks")(q, k_cmp, block_counts=4, block_size=bs, cu_seqlens=cu),)

        def selected(q, k, v, g, idx, cu):
            return (self.op("selected_attention")(q, k, v, idx, block_size=bs, cu_seqlens=cu),)

        def window(q, k, v, g, idx, cu):
            return (self.op("sliding_window_attention")(q, k, v, window_size=13, cu_seqlens=cu),)

        def attention(q, k, v, g, idx, cu):
            return (self.op("attention")(q, k, v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], block_counts=3,
                                         block_size=bs, window_size=13, cu_seqlens=cu),)

        return locals()[name]

    @cases("varlen")
    def test_varlen_equals_each_sequence_alone(self, name):
        """Packed sequences give each sequence's result alone, with a concrete and a traced cu_seqlens (interpreted
        kernels: the two packed runs only, each alone run a compile of its own; test_varlen_against_oracle checks
        their packed result, and the compiled bases run them alone)."""
        dtype = self.dtypes[0]
        with precision(dtype):
            x = Inputs(VARLEN_SHAPE, dtype)
            call = self._varlen_call(name, x.block_size)
            args = (x.q, x.k, x.v, tuple(g[0] for g in x.gates), x.block_indices(4))
            packed = call(*args, CU_SEQLENS)
            traced = jax.jit(call)(*args, CU_SEQLENS)
            for a, b in zip(packed, traced):  # a traced cu_seqlens pads k_cmp to a static bound
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
            for lo, hi in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:]) if not self.interpreted else ():
                if lo == hi:
                    continue
                alone = call(*jax.tree_util.tree_map(lambda a: a[:, lo:hi], args), None)
                for a, b in zip(packed, alone):
                    a = np.asarray(a)[:, lo:hi]
                    if name == "select":  # alone, its slots are capped at its own blocks
                        assert_same_blocks(a, oracle.with_slots(np.asarray(b), a.shape[-1]))
                    else:
                        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6)

    @cases("varlen")
    def test_varlen_against_oracle(self, name):
        dtype = self.dtypes[0]
        with precision(dtype):
            x = Inputs(VARLEN_SHAPE, dtype)
            block_idx = x.block_indices(4)
            gates = tuple(g[0] for g in x.gates)
            got = self._varlen_call(name, x.block_size)(x.q, x.k, x.v, gates, block_idx, CU_SEQLENS)
            kw = dict(block_size=x.block_size, cu_seqlens=CU_SEQLENS)
            q, k, v = x.q64, x.k64, x.v64
            if name == "compressed":
                ref = oracle.compressed_attention(q, oracle.compress(k, **kw), oracle.compress(v, **kw), **kw)
            elif name == "select":
                ref = (oracle.select_blocks(q, oracle.compress(k, **kw), block_counts=4, **kw),)
            elif name == "selected":
                ref = (oracle.selected_attention(q, k, v, block_idx, **kw),)
            elif name == "window":
                ref = (oracle.sliding_window_attention(q, k, v, window_size=13, cu_seqlens=CU_SEQLENS),)
            else:
                g = [g[1] for g in x.gates]
                ref = (oracle.attention(q, k, v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], block_counts=3,
                                        window_size=13, **kw),)
            for a, b in zip(got, ref):
                if name == "select":
                    assert_same_blocks(a, b)
                else:
                    a, b = np.asarray(a, np.float64), np.asarray(b)
                    seen = np.isfinite(b)
                    np.testing.assert_array_equal(np.isfinite(a), seen)
                    assert_close(a[seen], b[seen], TOLERANCE[dtype], name)

    # --------------------------------------------------------------------------------- gradients

    def _grad_case(self, name, x, cu_seqlens=None):
        """(f of the differentiable arrays, the same in the dense float64 formulation, arrays, arrays64)."""
        bs, B, T, HQ, H = x.block_size, *x.shape[:4]
        scale = x.shape[4] ** -0.5
        g = [gi[0] for gi in x.gates]
        g64 = [gi[1] for gi in x.gates]
        if name == "compressed":
            k_cmp, k_cmp64, v_cmp, v_cmp64 = x.compressed(cu_seqlens)
            counts = dense.compressed_counts(B, T, H, k_cmp.shape[1], bs, cu_seqlens)
            f = lambda q, kc, vc: self.op("compressed_attention")(q, kc, vc, block_size=bs, cu_seqlens=cu_seqlens)
            f64 = lambda q, kc, vc: dense.attend(q, kc, vc, counts, scale)
            return f, f64, (x.q, k_cmp, v_cmp), (x.q64, k_cmp64, v_cmp64)
        if name == "selected":
            idx = x.block_indices(4)
            counts = dense.selected_counts(idx, None, bs, cu_seqlens)
            f = lambda q, k, v: self.op("selected_attention")(q, k, v, idx, block_size=bs, cu_seqlens=cu_seqlens)
            f64 = lambda q, k, v: dense.attend(q, k, v, counts, scale)[0]
        elif name == "window":
            counts = dense.window_counts(B, T, H, 5, cu_seqlens)
            f = lambda q, k, v: self.op("sliding_window_attention")(q, k, v, window_size=5, cu_seqlens=cu_seqlens)
            f64 = lambda q, k, v: dense.attend(q, k, v, counts, scale)[0]
        else:  # attention with every branch and gate; the selection is the oracle's (no gradient)
            kw = dict(block_size=bs, cu_seqlens=cu_seqlens)
            idx = oracle.select_blocks(x.q64, oracle.compress(x.k64, **kw), block_counts=3, **kw)
            c_slc = dense.selected_counts(idx, None, bs, cu_seqlens)
            c_swa = dense.window_counts(B, T, H, 5, cu_seqlens)
            NC = oracle.compress(x.k64, **kw).shape[1]
            c_cmp = dense.compressed_counts(B, T, H, NC, bs, cu_seqlens)

            def f(q, k, v, g_cmp, g_slc, g_swa):
                return self.op("attention")(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_counts=3,
                                            window_size=5, **kw)

            def f64(q, k, v, g_cmp, g_slc, g_swa):
                k_cmp, v_cmp = dense.compress(k, bs, cu_seqlens), dense.compress(v, bs, cu_seqlens)
                return (g_cmp[..., None] * dense.attend(q, k_cmp, v_cmp, c_cmp, scale)[0]
                        + g_slc[..., None] * dense.attend(q, k, v, c_slc, scale)[0]
                        + g_swa[..., None] * dense.attend(q, k, v, c_swa, scale)[0])

            return f, f64, (x.q, x.k, x.v, *g), (x.q64, x.k64, x.v64, *g64)
        return f, f64, (x.q, x.k, x.v), (x.q64, x.k64, x.v64)

    def _check_grads(self, name, x, cu_seqlens=None):
        f, f64, args, args64 = self._grad_case(name, x, cu_seqlens)
        out, vjp = jax.vjp(jax.jit(f), *args)  # jitted: one compile, not an eager dispatch per op
        with jax.enable_x64(True):
            out64, vjp64 = jax.vjp(f64, *args64)
            if name == "compressed":  # also a cotangent on lse, where it is finite
                dlse = np.where(np.isfinite(out64[1]), np.cos(np.arange(out64[1].size)).reshape(out64[1].shape), 0)
                ct64 = (x.do64, dlse)
                ct = (x.do, jnp.asarray(dlse, out[1].dtype))
            else:
                ct64, ct = x.do64, x.do
            grads64 = vjp64(ct64)
        grads = jax.jit(vjp)(ct)
        scales = gradient_scales(*args64[:3], x.do64, x.shape[4] ** -0.5, num_gates=len(args) - 3)
        for i, (grad, grad64, arg, size) in enumerate(zip(grads, grads64, args, scales)):
            assert grad.dtype == arg.dtype, f"gradient {i}: dtype {grad.dtype} != input dtype {arg.dtype}"
            assert_close(grad, np.asarray(grad64), GRAD_TOLERANCE[x.dtype], f"{name} gradient {i}", size)

    @cases("gradients")
    def test_gradients(self, name, shape, dtype):
        with precision(dtype):
            self._check_grads(name, Inputs(shape, dtype))

    @cases("varlen_gradients")
    def test_gradients_varlen(self, name):
        dtype = self.dtypes[0]
        with precision(dtype):
            self._check_grads(name, Inputs(VARLEN_SHAPE, dtype), CU_SEQLENS)

    # ----------------------------------------------------------------------------- edge cases

    def test_nothing_visible_gives_zero_output_and_gradients(self):
        dtype = self.dtypes[0]
        B, T, HQ, H, D, bs = 1, 40, 4, 2, 16, 8
        with precision(dtype):
            x = Inputs((B, T, HQ, H, D, D, bs), dtype)
            T0 = jnp.arange(T)[None, :, None, None]
            # every entry is -1, beyond t // bs, or far beyond the sequence
            idx = jnp.broadcast_to(jnp.where(T0 % 3 == 0, -1, jnp.where(T0 % 3 == 1, T0 // bs + 1, 2 ** 30)),
                                   (B, T, H, 3)).astype(jnp.int32)
            f = lambda q, k, v: self.op("selected_attention")(q, k, v, idx, block_size=bs)
            o, vjp = jax.vjp(f, x.q, x.k, x.v)
            assert np.all(np.asarray(o) == 0)
            for grad in vjp(x.do):
                assert np.all(np.asarray(grad) == 0)
            # compressed: queries t < bs - 1 see no complete block
            k_cmp, _, v_cmp, _ = x.compressed()
            g = lambda q, kc, vc: self.op("compressed_attention")(q, kc, vc, block_size=bs)
            (o, lse), vjp = jax.vjp(g, x.q, k_cmp, v_cmp)
            assert np.all(np.asarray(o[:, :bs - 1]) == 0) and np.all(np.asarray(lse[:, :bs - 1]) == -np.inf)
            assert np.all(np.isfinite(np.asarray(lse[:, bs - 1:])))
            dq, dkc, dvc = vjp((x.do, jnp.ones_like(lse)))
            assert np.all(np.asarray(dq[:, :bs - 1]) == 0)
            assert all(np.all(np.isfinite(np.asarray(d))) for d in (dq, dkc, dvc))
            # a zero window sees nothing
            w = self.op("sliding_window_attention")(x.q, x.k, x.v, window_size=0)
            assert np.all(np.asarray(w) == 0)

    def test_block_listed_twice_is_attended_twice(self):
        dtype = self.dtypes[0]
        B, T, HQ, H, D, bs = 1, 32, 2, 1, 8, 8
        with precision(dtype):
            x = Inputs((B, T, HQ, H, D, D, bs), dtype)
            t = jnp.arange(T)[None, :, None]
            once = jnp.stack([t // bs, jnp.maximum(t // bs - 1, 0) * 0 - 1], -1).astype(jnp.int32)
            twice = jnp.stack([t // bs, t // bs], -1).astype(jnp.int32)
            prev = jnp.stack([t // bs, jnp.where(t >= bs, t // bs - 1, -1)], -1).astype(jnp.int32)
            op = self.op("selected_attention")
            o_once, o_twice = op(x.q, x.k, x.v, once, block_size=bs), op(x.q, x.k, x.v, twice, block_size=bs)
            # attending one block twice does not change the softmax over it...
            np.testing.assert_allclose(np.asarray(o_twice), np.asarray(o_once), rtol=1e-5, atol=1e-6)
            # ...but it does change the mix with another block
            both = jnp.concatenate([prev, prev[..., :1]], -1)
            o_both = op(x.q, x.k, x.v, both, block_size=bs)
            ref = oracle.selected_attention(x.q64, x.k64, x.v64, np.asarray(both), block_size=bs)
            assert_close(o_both, ref, TOLERANCE[dtype], "o")
            assert rel_rms(o_both[:, bs:], op(x.q, x.k, x.v, prev, block_size=bs)[:, bs:]) > 1e-3

    # ---------------------------------------------------------------------------- transformations

    def _attention_fn(self, x):
        g = [gi[0] for gi in x.gates]
        return lambda q, k, v: self.op("attention")(q, k, v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], block_counts=3,
                                                    block_size=x.block_size, window_size=9)

    def _loss(self, x):
        f = self._attention_fn(x)
        return f, lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * x.do.astype(jnp.float32))

    def _transform_shape(self, name):
        """A transformation test's shape: SHAPES[name], or on interpreted kernels INTERPRETED_TRANSFORM_SHAPES'."""
        return (INTERPRETED_TRANSFORM_SHAPES if self.interpreted else SHAPES)[name]

    def test_jit_grad_and_bitwise_repeatable(self):
        """Under jit the same result; gradients and outputs bitwise repeatable (compiled kernels: an interpreter
        runs a kernel's programs one after another, so its repeats cannot differ); nothing retraces."""
        dtype = self.dtypes[0]
        with precision(dtype):
            x = Inputs(self._transform_shape("G2"), dtype)
            f, loss = self._loss(x)
            eager = f(x.q, x.k, x.v)
            chex.clear_trace_counter()  # the counter is keyed by the function's hash, which a new one may reuse
            forward = jax.jit(chex.assert_max_traces(f, n=1))
            o = forward(x.q, x.k, x.v)
            assert_close(o, eager, 1e-6, "o under jit")
            if self.interpreted:  # an interpreter's repeats cannot differ; the gradient's one trace is the dispatch's
                return            # (the same custom_vjp), checked by the compiled families (CI time: minutes here)
            grad = jax.jit(chex.assert_max_traces(lambda *args: jax.grad(loss, argnums=(0, 1, 2))(*args), n=1))
            grads = grad(x.q, x.k, x.v)
            np.testing.assert_array_equal(np.asarray(forward(x.q, x.k, x.v)), np.asarray(o))
            for a, b in zip(grad(x.q, x.k, x.v), grads):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bitwise repeatable

    def test_gradient_under_checkpoint(self):
        dtype = self.dtypes[0]
        with precision(dtype):
            x = Inputs(self._transform_shape("G2"), dtype)
            _, loss = self._loss(x)
            g1 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x.q, x.k, x.v)
            g2 = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(x.q, x.k, x.v)
            chex.assert_trees_all_close(g2, g1, rtol=1e-5, atol=1e-5 * max(rms(g) for g in g1))

    def test_vmap_over_a_leading_axis(self):
        dtype = self.dtypes[0]
        with precision(dtype):
            xs = [Inputs(self._transform_shape("G3-dv8"), dtype, seed=s) for s in range(2 if self.interpreted else 3)]
            f = self._attention_fn(xs[0])
            q, k, v = (jnp.stack([getattr(x, n) for x in xs]) for n in "qkv")
            batched = jax.jit(jax.vmap(f))(q, k, v)  # jitted: one compile, not an eager dispatch per op
            single = jax.jit(f)
            for i, x in enumerate(xs):
                assert_close(batched[i], single(x.q, x.k, x.v), 1e-5, "o under vmap")
            loss = lambda q, k, v: jnp.sum(jax.vmap(f)(q, k, v).astype(jnp.float32) ** 2)
            dq = jax.jit(jax.grad(loss))(q, k, v)
            dq0 = jax.jit(jax.grad(lambda q: jnp.sum(f(q, xs[0].k, xs[0].v).astype(jnp.float32) ** 2)))(xs[0].q)
            assert_close(dq[0], dq0, 1e-5, "dq under vmap")

    def test_inside_shard_map(self):
        """The ops run per shard inside shard_map (batch split over a mesh of the local devices)."""
        dtype = self.dtypes[0]
        with precision(dtype):
            x = Inputs(self._transform_shape("G2"), dtype)
            f = self._attention_fn(x)
            devices = np.array(jax.local_devices()[:1])
            mesh = jax.sharding.Mesh(devices, ("b",))
            spec = jax.sharding.PartitionSpec("b")
            g = [gi[0] for gi in x.gates]

            def per_shard(q, k, v, a, b, c):
                return self.op("attention")(q, k, v, g_cmp=a, g_slc=b, g_swa=c, block_counts=3,
                                            block_size=x.block_size, window_size=9)

            sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
            assert_close(sharded(x.q, x.k, x.v, *g), jax.jit(f)(x.q, x.k, x.v), 1e-6, "o inside shard_map")
            if self.interpreted:  # the interpreted kernels' gradients inside shard_map, over 2 devices: test_context's
                return            # test_the_kernels_inside_a_context_axis (CI time: minutes here)
            loss = lambda *a: jnp.sum(sharded(*a).astype(jnp.float32) ** 2)
            dq = jax.jit(jax.grad(loss))(x.q, x.k, x.v, *g)
            dq_ref = jax.jit(jax.grad(lambda q: jnp.sum(f(q, x.k, x.v).astype(jnp.float32) ** 2)))(x.q)
            assert_close(dq, dq_ref, 1e-5, "dq inside shard_map")


    # ---------------------------------------- compression windows of l tokens every d, selection blocks of l'

    def _blocks(self, name, cu_seqlens=None, seed=0):
        """(Inputs, l, d, l', k_cmp, k_cmp64, v_cmp, v_cmp64) of BLOCK_CASES[name] (or SMALL_BLOCK_CASES'),
        compressed by the oracle."""
        shape, (l, d, sel) = {**BLOCK_CASES, **SMALL_BLOCK_CASES}[name]
        x = Inputs(shape + (sel,), self.dtypes[0], seed)
        kw = dict(block_size=l, stride=d, cu_seqlens=cu_seqlens)
        k_cmp, v_cmp = (rounded(oracle.compress(y, **kw), x.dtype) for y in (x.k64, x.v64))
        return (x, l, d, sel, *k_cmp, *v_cmp)

    @cases("blocks")
    def test_blocks_compressed_and_select(self, name):
        """compress (Eq. 7's windows, mean phi), compressed_attention (row i seen iff i * d + l <= t + 1) and
        select_blocks (Eq. 9: each row counts by its overlap with the selection block) against the oracle."""
        dtype = self.dtypes[0]
        with precision(dtype):
            x, l, d, sel, k_cmp, k_cmp64, v_cmp, v_cmp64 = self._blocks(name)
            assert_close(nsa.compress(x.k, block_size=l, stride=d), k_cmp64, TOLERANCE[dtype], "compress")
            o, lse = self.op("compressed_attention")(x.q, k_cmp, v_cmp, block_size=l, stride=d)
            o_ref, lse_ref = oracle.compressed_attention(x.q64, k_cmp64, v_cmp64, block_size=l, stride=d)
            assert_close(o, o_ref, TOLERANCE[dtype], "o")
            np.testing.assert_array_equal(np.asarray(lse) == -np.inf, lse_ref == -np.inf)
            seen = np.isfinite(lse_ref)
            assert_close(np.asarray(lse)[seen], lse_ref[seen], TOLERANCE[dtype], "lse")
            blocks = dict(block_counts=5, block_size=sel, compress_block_size=l, compress_stride=d)
            idx = self.op("select_blocks")(x.q, k_cmp, **blocks)
            assert_same_blocks(idx, oracle.select_blocks(x.q64, k_cmp64, **blocks))
            _, lse = self.op("compressed_attention")(x.q, k_cmp, v_cmp, block_size=l, stride=d)
            reused = nsa.api._select(x.q, k_cmp, lse, 5, sel, (l, d), None, None, None, self.implementation)
            assert_same_blocks(reused, idx)

    def _blocks_attention(self, x, l, d, sel, cu_seqlens=None):
        """(f, f64, args, args64, reference) of nsa.attention with every branch and gate at blocks (l, d, l'), its
        dense float64 formulation with the oracle's selection (no gradient flows through a selection), and the
        oracle's output. The oracle selects from its compressed keys rounded to x's dtype, as the kernels' own
        are: a bfloat16 k_cmp moves Eq. 9's scores by ~1e-3, enough to swap blocks whose scores nearly tie."""
        B, T, HQ, H = x.shape[:4]
        scale = x.shape[4] ** -0.5
        windows = dict(block_size=l, stride=d, cu_seqlens=cu_seqlens)
        blocks = dict(block_size=sel, compress_block_size=l, compress_stride=d)
        kw = dict(block_counts=5, window_size=20, cu_seqlens=cu_seqlens, **blocks)
        k_cmp64 = rounded(oracle.compress(x.k64, **windows), x.dtype)[1]
        idx = oracle.select_blocks(x.q64, k_cmp64, block_counts=5, cu_seqlens=cu_seqlens, **blocks)
        c_cmp = dense.compressed_counts(B, T, H, k_cmp64.shape[1], l, cu_seqlens, stride=d)
        c_slc = dense.selected_counts(idx, None, sel, cu_seqlens)
        c_swa = dense.window_counts(B, T, H, 20, cu_seqlens)

        def f(q, k, v, g_cmp, g_slc, g_swa):
            return self.op("attention")(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, **kw)

        def f64(q, k, v, g_cmp, g_slc, g_swa):
            k_cmp, v_cmp = (dense.compress(y, l, cu_seqlens, stride=d) for y in (k, v))
            return (g_cmp[..., None] * dense.attend(q, k_cmp, v_cmp, c_cmp, scale)[0]
                    + g_slc[..., None] * dense.attend(q, k, v, c_slc, scale)[0]
                    + g_swa[..., None] * dense.attend(q, k, v, c_swa, scale)[0])

        args = (x.q, x.k, x.v, *(g[0] for g in x.gates))
        args64 = (x.q64, x.k64, x.v64, *(g[1] for g in x.gates))
        gates64 = dict(zip(("g_cmp", "g_slc", "g_swa"), args64[3:]))
        reference = oracle.attention(*args64[:3], **gates64, block_indices=idx, **kw)
        return f, f64, args, args64, reference

    @cases("blocks_attention")
    def test_blocks_attention_and_gradients(self, name):
        """nsa.attention with compress_block_size, compress_stride and block_size: its output against the oracle,
        its gradients (q, k, v, every gate: through the overlapping compression too) against the dense float64
        formulation."""
        dtype = self.dtypes[0]
        with precision(dtype):
            x, l, d, sel = self._blocks(name)[:4]
            f, f64, args, args64, ref = self._blocks_attention(x, l, d, sel)
            out, vjp = jax.vjp(jax.jit(f), *args)
            assert_close(out, ref, TOLERANCE[dtype], "o")
            with jax.enable_x64(True):
                _, vjp64 = jax.vjp(f64, *args64)
                grads64 = vjp64(x.do64)
            scales = gradient_scales(*args64[:3], x.do64, x.shape[4] ** -0.5, num_gates=3)
            for i, (grad, grad64, size) in enumerate(zip(jax.jit(vjp)(x.do), grads64, scales)):
                assert_close(grad, np.asarray(grad64), GRAD_TOLERANCE[dtype], f"gradient {i}", size)

    @cases("blocks_varlen")
    def test_blocks_varlen(self, name):
        """Packed sequences (BLOCK_CU_SEQLENS, an empty one) at blocks (l, d, l'): nsa.attention against the oracle,
        with a concrete cu_seqlens and (compiled kernels: interpreted ones run the same kernels on the same
        planning, and test_varlen_equals_each_sequence_alone traces theirs) a traced one."""
        dtype = self.dtypes[0]
        shape, (l, d, sel) = {**BLOCK_CASES, **SMALL_BLOCK_CASES}[name]
        cu = SMALL_BLOCK_CU_SEQLENS if name in SMALL_BLOCK_CASES else BLOCK_CU_SEQLENS
        with precision(dtype):
            x = Inputs((1, int(cu[-1])) + shape[2:] + (sel,), dtype, seed=5)
            f, _, args, _, ref = self._blocks_attention(x, l, d, sel, cu)
            assert_close(f(*args), ref, TOLERANCE[dtype], "o")
            if self.interpreted:
                return
            blocks = dict(block_counts=5, window_size=20, block_size=sel, compress_block_size=l, compress_stride=d)
            traced = jax.jit(lambda cu, *a: self.op("attention")(*a[:3], g_cmp=a[3], g_slc=a[4], g_swa=a[5],
                                                                  cu_seqlens=cu, **blocks))
            assert_close(traced(jnp.asarray(cu), *args), ref, TOLERANCE[dtype], "o, traced cu_seqlens")

    # ------------------------------------------------- a KV cache: queries at the end of longer sequences

    def _cached_call(self, name, x, tq, lens, impl):
        """(cached, full): op `name` of implementation `impl` on queries [B, tq] that are the last tq tokens of
        sequences of lens[b] tokens in a padded cache whose keys past them are NaN (they must never be read),
        and a function of b giving the same op on sequence b alone (its first lens[b] tokens, no cache) by
        the reference, cut to its last tq queries."""
        bs, window, slots = x.block_size, 9, 3
        op = lambda n: functools.partial(getattr(nsa, n), implementation=impl)
        g = [gi[0] for gi in x.gates]
        idx = jnp.asarray(x.block_indices(slots))
        pad = np.arange(x.k.shape[1])[None, :, None, None] >= np.asarray(lens)[:, None, None, None]
        k, v = (jnp.where(pad, jnp.nan, y).astype(y.dtype) for y in (x.k, x.v))
        k_cmp, v_cmp = nsa.compress(k, block_size=bs), nsa.compress(v, block_size=bs)  # NaN past each sequence
        last = lambda y: jnp.stack([y[b, n - tq:n] for b, n in enumerate(lens)])  # [B, tq, ...]
        ref = functools.partial(getattr(nsa, name.split("-")[0]), implementation="xla")
        kw = dict(block_size=bs)
        gates = dict(g_cmp=g[0], g_slc=g[1], g_swa=g[2], block_counts=slots, window_size=window, **kw)
        cached = {
            "compressed_attention": lambda: op(name)(last(x.q), k_cmp, v_cmp, kv_lens=lens, **kw),
            "select_blocks": lambda: op(name)(last(x.q), k_cmp, block_counts=slots, kv_lens=lens, **kw),
            "selected_attention": lambda: op(name)(last(x.q), k, v, last(idx), kv_lens=lens, **kw),
            "sliding_window_attention": lambda: op(name)(last(x.q), k, v, window_size=window, kv_lens=lens),
            "attention": lambda: op(name)(last(x.q), k, v, **{n: last(y) for n, y in gates.items() if n[0] == "g"},
                                          **{n: y for n, y in gates.items() if n[0] != "g"},
                                          k_cmp=k_cmp, v_cmp=v_cmp, kv_lens=lens),
            "attention-given-blocks": lambda: op("attention")(
                last(x.q), k, v, g_slc=last(g[1]), block_indices=last(idx), block_counts=slots, kv_lens=lens, **kw),
        }[name]

        def full(b):
            n = lens[b]
            one = lambda y: y[b:b + 1, :n]
            k_b, v_b = one(x.k), one(x.v)
            cmp = lambda y: nsa.compress(y, block_size=bs)
            out = {
                "compressed_attention": lambda: ref(one(x.q), cmp(k_b), cmp(v_b), **kw),
                "select_blocks": lambda: ref(one(x.q), cmp(k_b), block_counts=slots, **kw),
                "selected_attention": lambda: ref(one(x.q), k_b, v_b, one(idx), **kw),
                "sliding_window_attention": lambda: ref(one(x.q), k_b, v_b, window_size=window),
                "attention": lambda: ref(one(x.q), k_b, v_b, **{n: one(y) if n[0] == "g" else y
                                                                  for n, y in gates.items()}),
                "attention-given-blocks": lambda: ref(one(x.q), k_b, v_b, g_slc=one(g[1]), block_indices=one(idx),
                                                      block_counts=slots, **kw),
            }[name]()
            return jax.tree_util.tree_map(lambda y: y[0, n - tq:], out)

        return cached, full


    @pytest.mark.parametrize("tq", [1, 21], ids=["decode", "chunked-prefill"])
    @cases("cached")
    def test_cached_queries_equal_full_sequence(self, name, tq):
        """op(q[:, -TQ:], cache, kv_lens) == op(q, k, v)[:, -TQ:] for every op (CACHED_OPS): decode (TQ = 1) and
        chunked prefill (TQ = 21, across block boundaries), a ragged batch (lengths 77 and 50 in a cache of 80: every
        key past a sequence's length is NaN, so reading one shows), the selection given or made inside,
        the compressed keys from the cache."""
        dtype = "float32" if "float32" in self.dtypes else self.dtypes[0]
        x = Inputs((2, 80, 6, 2, 16, 8, 8), dtype, seed=3)
        lens = [77, 50]
        cached, full = self._cached_call(name, x, tq, lens, self.implementation)
        got = jax.jit(cached)()  # jitted: one compile, not an eager dispatch per op (lens stays concrete)
        for b in range(2):
            want = jax.jit(functools.partial(full, b))()
            if name == "select_blocks":
                np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(want))
                continue
            for y, y_ref, what in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), ("o", "lse")):
                y_ref = np.asarray(y_ref, np.float64)
                seen = np.isfinite(y_ref)  # lse: -inf where a query sees no compressed block
                np.testing.assert_array_equal(np.isfinite(np.asarray(y[b], np.float64)), seen)
                assert_close(np.asarray(y[b], np.float64)[seen], y_ref[seen], TOLERANCE[dtype], f"{what}[{b}]")

    @cases("ragged")
    def test_ragged_steps_over_a_paged_cache_equal_full_recompute(self, blocks):
        """Ragged steps (`RAGGED_STEPS`: a chunk of prefill beside an idle slot and a sequence shorter than the
        chunk, then decode beside an idle slot, then both at once) over a paged cache whose pages lie in random
        order in the pool, whose page table holds unused (-1) and repeated entries past the sequences, and whose
        every row past the lengths is NaN, and over the contiguous cache the same appends fill: every query's output
        equals the reference on its whole sequence, the padding rows are 0, and on XLA the paged output equals the
        contiguous one bitwise. The steps are jitted with the lengths traced. Blocks (l, d, l'): `RAGGED_BLOCKS`."""
        dtype = "float32" if "float32" in self.dtypes else self.dtypes[0]
        l, d, bs = blocks
        B, HQ, H, Dk, Dv, S = 3, 6, 2, 16, 8, 16
        steps = np.array(RAGGED_STEPS)
        T_all = int(steps.sum(axis=0).max())
        x = Inputs((B, T_all, HQ, H, Dk, Dv, bs), dtype, seed=5)
        gates = [g[0] for g in x.gates]
        kw = dict(block_counts=3, window_size=9, implementation=self.implementation)
        made = dict(block_size=bs, compress_block_size=l, compress_stride=d, head_dim_v=Dv, dtype=x.k.dtype)
        nan = lambda y: jnp.full_like(y, jnp.nan)
        paged = nsa.empty_paged_cache(12, S, B, 3, H, Dk, **made)
        # sequences of 17, 7 and 6 tokens: pages 2 and 9; 5, then 2 (sequence 0's) and 7 unused; 0, -1, 5 (sequence
        # 1's) unused
        paged = paged.replace(k=nan(paged.k), v=nan(paged.v), k_cmp=nan(paged.k_cmp), v_cmp=nan(paged.v_cmp),
                              page_table=jnp.asarray([[2, 9, -1], [5, 2, 7], [0, -1, 5]], jnp.int32))
        contiguous = nsa.empty_cache(B, 3 * S, H, Dk, **made)

        @jax.jit
        def step(cache, q, k, v, g, n):
            cache = nsa.append_to_cache(cache, k, v, lens=n)
            return cache, nsa.attention(q, cache=cache, g_cmp=g[0], g_slc=g[1], g_swa=g[2], q_lens=n, **kw)

        full = [jax.jit(lambda q, k, v, *g: nsa.attention(  # causal: its rows are every step's queries' outputs
            q, k, v, **dict(zip(("g_cmp", "g_slc", "g_swa"), g)), **dict(kw, implementation="xla"),
            **{name: made[name] for name in BLOCK_ARGS}))(*(y[b:b + 1, :n] for y in (x.q, x.k, x.v, *gates)))[0]
            for b, n in enumerate(steps.sum(axis=0))]
        done = np.zeros(B, int)
        for n in steps:
            TN = 1 if n.max() == 1 else int(steps.max())  # decode, or a chunk of the longest step's size: 2 compiles
            rows = lambda y: jnp.stack([jnp.pad(y[b, done[b]:done[b] + n[b]], [(0, TN - n[b])] + [(0, 0)] * (y.ndim - 2))
                                        for b in range(B)])
            new = (rows(x.q), rows(x.k), rows(x.v), [rows(g) for g in gates], jnp.asarray(n, jnp.int32))
            paged, o = step(paged, *new)
            if self.implementation == "xla":
                contiguous, o_contiguous = step(contiguous, *new)
                np.testing.assert_array_equal(np.asarray(o), np.asarray(o_contiguous))
            for b in range(B):
                np.testing.assert_array_equal(np.asarray(o[b, n[b]:], np.float64), 0.0)
                want = np.asarray(full[b][done[b]:done[b] + n[b]], np.float64)
                assert_close(o[b, :n[b]], want, TOLERANCE[dtype], f"o[{b}] of step {n}")
            done += n

    @cases("pageless")
    def test_rows_without_a_page_are_never_read(self, tn):
        """A paged cache whose page tables hold -1, a negative id and ids past the pool, beside sequences that own
        the pages such ids clip to (0 and P - 1): a jitted step appends TN tokens to each sequence and attends
        with q_lens = TN. Sequences 1 and 2, whose next entry has no page, get none of the tokens written (the
        counts it returns, and their lengths, stay put); every output of theirs is finite and the same bitwise when
        every other sequence's pages hold other values or NaN. The same holds for lengths set by hand past those
        entries (under jit nothing can refuse them: the sequences end at their first entry with no page)."""
        dtype = "float32" if "float32" in self.dtypes else self.dtypes[0]
        B, HQ, H, Dk, Dv, P, S = 4, 6, 2, 16, 8, 8, 16
        blocks = dict(block_size=8, compress_block_size=8, compress_stride=8)
        table = jnp.asarray([[0, 5, 6], [2, -1, 4], [3, 12, -5], [7, 1, -1]], jnp.int32)
        others = [0, 5, 7, 1]  # the pages of sequences 0 and 3
        x = Inputs((B, 24, HQ, H, Dk, Dv, 8), dtype, seed=13)
        cache = nsa.empty_paged_cache(P, S, B, 3, H, Dk, head_dim_v=Dv, dtype=x.k.dtype, **blocks)
        cache = nsa.append_to_cache(cache.replace(page_table=table), x.k[:, :16], x.v[:, :16])  # a page each
        cache = nsa.append_to_cache(cache, x.k[:, 16:21], x.v[:, 16:21], lens=[5, 0, 0, 5])  # 0 and 3: 21 tokens
        n = jnp.full((B,), tn, jnp.int32)
        q, k, v, *g = (y[:, 21:21 + tn] for y in (x.q, x.k, x.v, *(gi[0] for gi in x.gates)))

        @jax.jit
        def step(cache):
            cache, written = nsa.append_to_cache(cache, k, v, lens=n, return_written=True)
            o = nsa.attention(q, cache=cache, g_cmp=g[0], g_slc=g[1], g_swa=g[2], q_lens=n, block_counts=2,
                              window_size=5, implementation=self.implementation)
            return cache.lens, written, o

        def others_changed(cache, value):  # every page of sequences 0 and 3 set to `value`
            return cache.replace(**{name: getattr(cache, name).at[np.asarray(others)].set(value)
                                    for name in ("k", "v", "k_cmp", "v_cmp")})

        lens, written, o = step(cache)
        np.testing.assert_array_equal(np.asarray(written), [tn, 0, 0, tn])
        np.testing.assert_array_equal(np.asarray(lens), [21 + tn, 16, 16, 21 + tn])
        for where in (cache, cache.replace(lens=jnp.asarray([21, 40, 48, 21], jnp.int32))):  # by hand: past them
            o = np.asarray(step(where)[2], np.float64)[1:3]
            assert np.all(np.isfinite(o))
            for value in (3.0, jnp.nan):
                np.testing.assert_array_equal(np.asarray(step(others_changed(where, value))[2], np.float64)[1:3], o)

    def test_cached_gradients_equal_full_sequence(self):
        """Gradients through a KV cache (chunked prefill): those of q and of each sequence's keys equal the
        full sequence's; the keys past a sequence's length (NaN) get zero gradients."""
        dtype = "float32" if "float32" in self.dtypes else self.dtypes[0]
        x = Inputs((2, 80, 6, 2, 16, 8, 8), dtype, seed=4)
        lens, tq, bs = [77, 50], 21, 8
        g = [gi[0] for gi in x.gates]
        pad = np.arange(80)[None, :, None, None] >= np.asarray(lens)[:, None, None, None]
        nan_past = lambda y: jnp.where(pad, jnp.nan, y).astype(y.dtype)
        last = lambda y: jnp.stack([y[b, n - tq:n] for b, n in enumerate(lens)])
        do = last(x.do)
        kw = dict(block_counts=3, block_size=bs, window_size=9)

        def loss(q, k, v):
            o = self.op("attention")(q, k, v, g_cmp=last(g[0]), g_slc=last(g[1]), g_swa=last(g[2]), kv_lens=lens, **kw)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(last(x.q), nan_past(x.k), nan_past(x.v))
        for b_sel, n in enumerate(lens):
            one = lambda y: y[b_sel:b_sel + 1, :n]
            full_loss = lambda q, k, v: jnp.sum(nsa.attention(
                q, k, v, g_cmp=one(g[0]), g_slc=one(g[1]), g_swa=one(g[2]), implementation="xla",
                **kw)[:, n - tq:].astype(jnp.float32) * do[b_sel:b_sel + 1].astype(jnp.float32))
            dq, dk, dv = jax.jit(jax.grad(full_loss, argnums=(0, 1, 2)))(one(x.q), one(x.k), one(x.v))
            scales = gradient_scales(x.q64, x.k64, x.v64, x.do64, x.q.shape[-1] ** -0.5)
            assert_close(grads[0][b_sel], dq[0, n - tq:], GRAD_TOLERANCE[dtype], f"dq[{b_sel}]", scales[0])
            for got, ref, what, s in ((grads[1], dk, "dk", scales[1]), (grads[2], dv, "dv", scales[2])):
                assert_close(got[b_sel, :n], ref[0], GRAD_TOLERANCE[dtype], f"{what}[{b_sel}]", s)
                np.testing.assert_array_equal(np.asarray(got[b_sel, n:], np.float64), 0.0)
