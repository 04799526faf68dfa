"""Every Triton kernel (or with --pallas every Mosaic GPU kernel, on bfloat16) on hostile inputs, against the XLA
reference: run it under compute-sanitizer.

    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS=--xla_gpu_autotune_level=0 \
        compute-sanitizer --tool memcheck --error-exitcode 99 python3 scripts/gpu_hostile.py

(`scripts/gpu.sh sanitize` does that, with --quick: float32 only, fewer cases, and only nsa's kernels
instrumented; --cache runs only the KV-cache cases, --paged the paged cache's ragged steps, --overlap those of overlapping compression, --resident
those at G = 16 that a TPU's resident training kernels take, --window a few
whose window's dk/dv splits its query heads, --default implementation=None (the families mixed by its claims); XLA's GPU compiles crawl under the sanitizer, so it
first runs once without it to fill the compilation caches, and the reference runs on the CPU). The platform
allocator gives each buffer its own allocation, so a read past an array is a memcheck error, not a read of
its neighbour. The cases: block indices of -1,
past t // block_size, 2^30 and -2^31, repeated, with counts from 0 to past S; odd groups (G = 3, 5),
Dv != Dk, T not a multiple of the block, packed sequences with empty ones (concrete and traced
cu_seqlens), a traced cu_seqlens that asks for more compressed rows than k_cmp holds, k_cmp of no
rows, window sizes 0, 1 and past T, empty inputs (B = 0, T = 0), and a KV cache: decode (T = 1) and
chunked prefill over a ragged batch (lengths T, mid-block and the whole cache, traced), every key past a
sequence's length NaN, the compressed keys from the cache, hostile block indices. Each output and gradient must
match the reference (relative RMS error against the quantity's natural size); exits 1 on a mismatch.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import nsa  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # the float32 reference, not TF32
TOL = {"float32": 2e-5, "bfloat16": 2e-2}
# the kernels under test (Mosaic GPU: 16-bit inputs only); --default: implementation=None, whose claims mix the two
# families in one call (bfloat16, e.g. Triton's forward residuals into Mosaic GPU's window backward)
IMPL = "pallas" if "--pallas" in sys.argv else None if "--default" in sys.argv else "triton"
failures = []


def tag(dtype):
    return "bf16" if dtype == jnp.bfloat16 else "f32"


def _rms(x):
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.mean(x ** 2))) if x.size else 0.0


def check(name, got, want, scale):
    """Relative RMS error of got against want, floored at the natural size `scale`, finite everywhere."""
    for i, (a, b) in enumerate(zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        finite = np.isfinite(b)
        ok = a.shape == b.shape and np.array_equal(np.isfinite(a), finite)
        err = _rms(np.where(finite, a - b, 0.0)) / max(_rms(np.where(finite, b, 0.0)), scale, 1e-30) if ok else np.inf
        tol = TOL["bfloat16" if "bf16" in name else "float32"]
        status = "ok" if err <= tol else "MISMATCH"
        print(f"{status:8} {name} output {i}: relative error {err:.2e}", flush=True)
        if status != "ok":
            failures.append(f"{name} output {i}")


def reference(run):
    """run("xla") on the host's CPU: the reference needs no GPU, and under the sanitizer every XLA GPU
    compile crawls."""
    with jax.default_device(jax.devices("cpu")[0]):
        return run("xla")


def inputs(B, T, HQ, H, Dk, Dv, dtype, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s) for s in ((B, T, HQ, Dk), (B, T, H, Dk), (B, T, H, Dv), (B, T, HQ, Dv))]
    return [jnp.asarray(a, dtype) for a in arrays]


def hostile_indices(B, T, H, S, bs, seed=1):
    """-1, past t // bs, 2^30, -2^31 and repeated entries; the first slot a visible block."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(-2, T // bs + 3, (B, T, H, S)).astype(np.int64)
    idx[..., 0] = (rng.integers(0, 1 << 20, (T,)) % (np.arange(T) // bs + 1))[None, :, None]
    idx[:, ::3, :, -1] = 2 ** 30
    idx[:, 1::5, :, -1] = -2 ** 31
    idx[:, 1::4, :, 1 % S] = idx[:, 1::4, :, 0]
    return jnp.asarray(idx.astype(np.int32))


def grads(f, args, ct):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(ct)


def case_selected(dtype, B, T, HQ, H, Dk, Dv, bs, cu):
    q, k, v, do = inputs(B, T, HQ, H, Dk, Dv, dtype)
    idx = hostile_indices(B, T, H, 5, bs)
    counts = jnp.asarray(np.random.default_rng(2).integers(0, 8, (B, T, H)), jnp.int32)
    run = lambda impl: jax.jit(lambda q, k, v, do, cu: grads(
        lambda q, k, v: nsa.selected_attention(q, k, v, idx, block_counts=counts, block_size=bs, cu_seqlens=cu,
                                               implementation=impl), (q, k, v), do))(q, k, v, do, cu)
    check(f"selected {tag(dtype)} G={HQ // H} T={T} Dk={Dk} Dv={Dv} bs={bs} cu={cu is not None}", run(IMPL),
          reference(run), _rms(v) * _rms(do))


def case_attention(dtype, B, T, HQ, H, Dk, Dv, bs, window, cu, l=None, d=None):
    """nsa.attention and its gradients; (l, d): the compression's windows and stride (None: bs)."""
    q, k, v, do = inputs(B, T, HQ, H, Dk, Dv, dtype)
    g = jax.nn.sigmoid(q[..., :3].astype(jnp.float32)).astype(dtype)

    def run(impl):
        def f(q, k, v, g):
            return nsa.attention(q, k, v, g_cmp=g[..., 0], g_slc=g[..., 1], g_swa=g[..., 2], block_counts=4,
                                 block_size=bs, window_size=window, cu_seqlens=cu, implementation=impl,
                                 compress_block_size=l, compress_stride=d)
        return jax.jit(lambda q, k, v, g, do: grads(f, (q, k, v, g), do))(q, k, v, g, do)

    check(f"attention {tag(dtype)} G={HQ // H} T={T} Dk={Dk} Dv={Dv} bs={bs} l={l} d={d} w={window} "
          f"cu={cu is not None}", run(IMPL), reference(run), _rms(v) * _rms(do))


def case_short_k_cmp(dtype):
    """A traced cu_seqlens that asks for rows k_cmp does not hold (only the first sequence's are there),
    and k_cmp of no rows at T < block_size: nothing past k_cmp may be read."""
    T, HQ, H, D, bs = 200, 6, 2, 32, 16
    q, k, v, do = inputs(1, T, HQ, H, D, D, dtype)
    cu = jnp.asarray([0, 100, 100, 200], jnp.int32)
    k_cmp, v_cmp = k[:, :7 * bs:bs], v[:, :7 * bs:bs]  # 7 rows: the first sequence's; 14 in all

    def run(impl):
        def f(q, kc, vc, cu):
            o, lse = nsa.compressed_attention(q, kc, vc, block_size=bs, cu_seqlens=cu, implementation=impl)
            idx = nsa.select_blocks(q, kc, block_counts=5, block_size=bs, cu_seqlens=cu, implementation=impl)
            return o, jnp.where(jnp.isfinite(lse), lse, 0.0), idx.astype(jnp.float32)

        out, vjp = jax.vjp(lambda q, kc, vc: jax.jit(f)(q, kc, vc, cu), q, k_cmp, v_cmp)
        return out, vjp((do, jnp.ones(q.shape[:3]), jnp.zeros(q.shape[:2] + (H, 5))))

    check(f"compressed + select {tag(dtype)}, traced cu_seqlens past k_cmp", run(IMPL), reference(run),
          _rms(v) * _rms(do))
    q0 = q[:, :10]
    for impl in (IMPL, "xla"):
        o, lse = nsa.compressed_attention(q0, k_cmp[:, :0], v_cmp[:, :0], block_size=bs, implementation=impl)
        idx = nsa.select_blocks(q0, k_cmp[:, :0], block_counts=2, block_size=bs, implementation=impl)
        ok = not np.any(np.asarray(o)) and np.all(np.isneginf(np.asarray(lse))) and np.all(
            np.asarray(idx) == np.array([0, -1]))
        print(f"{'ok' if ok else 'MISMATCH':8} k_cmp of no rows ({impl})", flush=True)
        if not ok:
            failures.append(f"k_cmp of no rows ({impl})")


def case_cache(dtype, TQ, B, TK, HQ, H, Dk, Dv, bs, l=None, d=None):
    """Queries at the end of a padded cache (kv_lens traced), NaN past each sequence (so too each compressed
    row whose window is not complete): attention with the selection made inside (alone: the fused decode
    kernels when TQ is small; and with its gradients: the ops), and selected attention on hostile indices;
    (l, d): the compression's windows and stride (None: bs)."""
    q, k, v, do = inputs(B, TK, HQ, H, Dk, Dv, dtype)
    lens = np.array([TQ, TK - bs // 2 - 3, TK][:B])
    pad = np.arange(TK)[None, :, None, None] >= lens[:, None, None, None]
    k, v = (jnp.where(pad, jnp.nan, x).astype(dtype) for x in (k, v))
    k_cmp, v_cmp = (nsa.compress(x, block_size=l or bs, stride=d) for x in (k, v))
    last = lambda x: jnp.stack([x[b, n - TQ:n] for b, n in enumerate(lens)])
    q, do = last(q), last(do)
    g = jax.nn.sigmoid(q[..., :3].astype(jnp.float32)).astype(dtype)
    idx = last(hostile_indices(B, TK, H, 5, bs))
    lens = jnp.asarray(lens, jnp.int32)

    def run(impl):
        def f(q, k, v, k_cmp, v_cmp, g, lens):
            return nsa.attention(q, k, v, g_cmp=g[..., 0], g_slc=g[..., 1], g_swa=g[..., 2], block_counts=4,
                                 block_size=bs, window_size=2 * bs + 1, k_cmp=k_cmp, v_cmp=v_cmp, kv_lens=lens,
                                 implementation=impl, compress_block_size=l, compress_stride=d)

        def s(q, k, v, lens):
            return nsa.selected_attention(q, k, v, idx, block_size=bs, kv_lens=lens, implementation=impl)

        return jax.jit(lambda *a: (f(*a),  # no gradient: a decode step runs the fused kernels
                                   grads(lambda q, k, v, kc, vc, g: f(q, k, v, kc, vc, g, a[-1]), a[:6], do),
                                   grads(lambda q, k, v: s(q, k, v, a[-1]), a[:3], do)))(
            q, k, v, k_cmp, v_cmp, g, lens)

    check(f"cache {tag(dtype)} TQ={TQ} B={B} TK={TK} G={HQ // H} Dk={Dk} Dv={Dv} bs={bs} l={l} d={d}", run(IMPL),
          reference(run), _rms(v[jnp.isfinite(v)]) * _rms(do))


def case_paged(dtype, TN, l=None, d=None, S=32, heads=(64, 32)):
    """A ragged step over a paged cache: 4 sequences (an idle empty one, one that the step fills to its capacity,
    one mid-page, one shorter than the step's TN rows) whose pages lie in random order in a NaN pool, the page
    table with unused (-1) and repeated entries (other sequences' pages past each one's length); the step's
    appends, then attention with the selection made inside (alone: the fused decode kernels when TN is small, or
    on a TPU with heads of 128 the selected kernel's copies through the page table; and the gradients of q and the
    gates: the ops). (l, d): the compression's windows and stride (None: 32); S: the page size (16: a selection
    block of 32 spans two pages); heads: (Dk, Dv)."""
    MP, B, HQ, H, bs = 128 // S, 4, 6, 2, 32
    Dk, Dv = heads
    N = MP * S
    prompt = np.array([0, N - TN, 45, 2])
    n = np.array([0, TN, min(TN, 9), min(TN, 3)])  # each sequence's new tokens
    table = jnp.asarray([[-1, -1, -1, -1], [3, 8, 1, 10], [6, 0, 3, -1], [9, 8, -1, 1]], jnp.int32)
    if MP == 8:  # pages of 16: each page of 32 above split in two (a pool of 24), the same pattern
        table = jnp.stack([2 * table, 2 * table + 1], -1).reshape(B, MP)
        table = jnp.where(table < 0, -1, table)
    q, k, v, do = inputs(B, N, HQ, H, Dk, Dv, dtype)
    new = lambda x: jnp.stack([jnp.pad(x[b, p:p + m], [(0, TN - m)] + [(0, 0)] * (x.ndim - 2))
                               for b, (p, m) in enumerate(zip(prompt, n))])
    q, k_new, v_new, do = new(q), new(k), new(v), new(do)
    g = jax.nn.sigmoid(q[..., :3].astype(jnp.float32)).astype(dtype)
    blocks = dict(block_size=bs, compress_block_size=l, compress_stride=d)

    def run(impl):
        def f(q, k, v, k_new, v_new, g, table):
            cache = nsa.empty_paged_cache(3 * MP, S, B, MP, H, Dk, head_dim_v=Dv, dtype=dtype, **blocks)
            nan = lambda x: jnp.full_like(x, jnp.nan)
            cache = cache.replace(k=nan(cache.k), v=nan(cache.v), k_cmp=nan(cache.k_cmp), v_cmp=nan(cache.v_cmp),
                                  page_table=table)
            cache = nsa.append_to_cache(cache, k[:, :N - TN], v[:, :N - TN], lens=prompt)
            cache = nsa.append_to_cache(cache, k_new, v_new, lens=n)
            step = lambda q, g: nsa.attention(q, cache=cache, g_cmp=g[..., 0], g_slc=g[..., 1], g_swa=g[..., 2],
                                              q_lens=n, block_counts=4, window_size=2 * bs + 1, implementation=impl)
            return step(q, g), grads(step, (q, g), do)

        return jax.jit(f)(q, k, v, k_new, v_new, g, table)

    check(f"paged {tag(dtype)} TN={TN} l={l} d={d} S={S} D={Dk}", run(IMPL), reference(run), _rms(v) * _rms(do))


def case_empty(dtype):
    for B, T in ((0, 64), (1, 0)):
        q, k, v, do = inputs(B, T, 4, 2, 32, 16, dtype)
        f = lambda q, k, v: nsa.attention(q, k, v, g_cmp=q[..., 0], block_counts=3, block_size=16, window_size=8,
                                          implementation=IMPL)
        out, g = grads(f, (q, k, v), do)
        ok = out.shape == (B, T, 4, 16) and all(x.shape == y.shape for x, y in zip(g, (q, k, v)))
        print(f"{'ok' if ok else 'MISMATCH':8} empty input B={B} T={T}", flush=True)
        if not ok:
            failures.append(f"empty B={B} T={T}")


def main():
    quick = "--quick" in sys.argv
    dtypes = (jnp.bfloat16,) if IMPL in ("pallas", None) else (jnp.float32,) if quick else (jnp.float32, jnp.bfloat16)
    if "--cache" in sys.argv:  # only the KV-cache cases
        for TQ, B, TK, bs in ((1, 3, 300, 32), (37, 3, 300, 32), (1, 2, 2000, 16)):
            case_cache(dtypes[0], TQ, B, TK, 6, 2, 64, 32, bs)
        case_cache(dtypes[0], 1, 3, 512, 8, 4, 128, 128, 64)  # heads of 128, TK a multiple of the block: read as is
        return report()
    if "--paged" in sys.argv:  # only the paged and ragged cases
        for dtype in dtypes:
            for TN in (1, 13):
                case_paged(dtype, TN)
            case_paged(dtype, 13, l=32, d=16)
            case_paged(dtype, 1, heads=(128, 128))  # heads of 128: a TPU copies the blocks through the table
            case_paged(dtype, 1, l=16, d=16, S=16, heads=(128, 128))  # and each block from two pages
        return report()
    if "--overlap" in sys.argv:  # only the cases of overlapping compression (windows of l every d)
        return overlap(dtypes) or report()
    if "--resident" in sys.argv:  # only cases a TPU's resident kernels take (window, selected; G = 16 in bfloat16)
        packed = jnp.asarray([0, 37, 37, 300, 300, 517], jnp.int32)
        for dtype in dtypes:
            case_attention(dtype, 1, 517, 32, 2, 64, 32, 32, 100, packed)  # packed, empty sequences, Dv != Dk
            case_attention(dtype, 2, 300, 32, 2, 64, 64, 64, 1, None, l=32, d=16)  # the paper's overlap, window 1
            case_attention(dtype, 1, 300, 32, 2, 64, 64, 16, 5000, None)  # window past T
        return report()
    if "--window" in sys.argv:  # only cases whose window's dk/dv splits the query heads (G of them on a GPU here)
        for dtype in dtypes:
            case_attention(dtype, 1, 517, 6, 2, 64, 32, 32, 100, jnp.asarray([0, 37, 37, 300, 300, 517], jnp.int32))
            case_attention(dtype, 1, 300, 32, 2, 64, 64, 16, 77, None)  # G = 16
            case_attention(dtype, 1, 300, 6, 2, 32, 32, 64, 5000, None)  # window past T
            case_cache(dtype, 37, 3, 300, 6, 2, 64, 32, 32)  # chunked prefill over a ragged cache
        return report()
    packed = jnp.asarray([0, 37, 37, 300, 300, 517], jnp.int32)  # empty sequences, partial blocks
    for dtype in dtypes:
        case_selected(dtype, 1, 517, 5, 1, 32, 64, 64, packed)  # G = 5, Dv != Dk, ragged T
        case_attention(dtype, 1, 517, 6, 2, 64, 32, 32, 100, packed)  # G = 3
        if not quick:
            case_selected(dtype, 2, 517, 6, 2, 64, 32, 32, None)  # G = 3
            case_selected(dtype, 1, 300, 32, 2, 64, 64, 16, None)  # G = 16, the one-token slot loop
            case_attention(dtype, 2, 300, 4, 4, 32, 32, 16, 1, None)  # G = 1, window 1
            case_attention(dtype, 1, 300, 6, 2, 32, 32, 64, 5000, None)  # window past T
        for TQ in (1, 37):
            case_cache(dtype, TQ, 3, 300, 6, 2, 64, 32, 32)  # G = 3, Dv != Dk, ragged lengths
        case_cache(dtype, 1, 2, 2000, 6, 2, 64, 32, 16)  # 125 compressed rows: the decode select's splits merged
        if not quick:
            case_cache(dtype, 1, 2, 1000, 64, 4, 128, 128, 64)  # the standard heads, a decode step
    overlap(dtypes)
    case_short_k_cmp(dtypes[0])
    case_empty(dtypes[0])
    return report()


def overlap(dtypes):
    """The cases of overlapping compression: the paper's (32, 16, 64), (16, 8, 32) at G = 3 and G = 1, and a cache
    whose rows past the complete windows are NaN."""
    packed = jnp.asarray([0, 37, 37, 300, 300, 517], jnp.int32)
    for dtype in dtypes:
        case_attention(dtype, 1, 517, 6, 2, 64, 32, 64, 100, packed, l=32, d=16)  # G = 3, packed, empty sequences
        case_attention(dtype, 2, 300, 4, 4, 32, 32, 32, 1, None, l=16, d=8)  # G = 1, ragged T
        for TQ in (1, 37):
            case_cache(dtype, TQ, 3, 300, 6, 2, 64, 32, 32, l=16, d=8)
        case_cache(dtype, 1, 2, 1000, 64, 4, 128, 128, 64, l=32, d=16)  # the paper's heads and blocks, a decode step


def report():
    print(f"{len(failures)} mismatches" + (f": {failures}" if failures else ""), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
