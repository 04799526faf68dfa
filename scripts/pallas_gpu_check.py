"""Quick checks of the Mosaic GPU kernels (implementation="pallas") on an NVIDIA GPU, op by op, before the test base.

    python3 scripts/pallas_gpu_check.py [window|compressed|selected|attention|checkpoint|time]...

Each case prints one line: the relative RMS error of the output and of each gradient against the XLA reference
in float32 on the same rounded inputs (bfloat16 tolerances: 5e-3 forward, 1e-2 gradients), or the exception's
last line; a case never stops the next. `time` prints the forward and forward+backward times of Pallas and
Triton on the standard shape (B = 1, HQ = 64, H = 4, D = 128, bf16, block 64, 16 blocks, window 512) at 8k
and 16k. scripts/gpu.sh pallas runs each op in its own process (a kernel fault ends only its own).
"""

import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import nsa

DT = jnp.bfloat16


def rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("nan")
    return float(np.sqrt(np.mean((x - ref) ** 2)) / max(np.sqrt(np.mean(ref ** 2)), 1e-30))


def inputs(B, T, TK, HQ, H, Dk, Dv, seed=0, lens=None):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, HQ, Dk)), DT)
    k = np.asarray(rng.standard_normal((B, TK, H, Dk)), np.float32)
    v = np.asarray(rng.standard_normal((B, TK, H, Dv)), np.float32)
    if lens is not None:  # a KV cache: NaN past each sequence
        for b, n in enumerate(lens):
            k[b, n:], v[b, n:] = np.nan, np.nan
    return q, jnp.asarray(k, DT), jnp.asarray(v, DT), rng


def compare(name, f, args, grad_argnums):
    """f(*args, impl) -> output (or a tuple whose first is the output): pallas against xla (float32 inputs)."""
    try:
        f32 = [a.astype(jnp.float32) if a.dtype == DT else a for a in args]
        out = lambda impl, xs: (lambda o: o[0] if isinstance(o, tuple) else o)(f(*xs, impl))
        o = out("pallas", args)
        ref = out("xla", f32)
        do = jnp.asarray(np.random.default_rng(1).standard_normal(o.shape), jnp.float32)
        loss = lambda impl, *xs: jnp.sum(jnp.where(jnp.isfinite(ref), out(impl, xs).astype(jnp.float32), 0) * do)
        g = jax.grad(lambda *xs: loss("pallas", *xs), argnums=grad_argnums)(*args)
        g_ref = jax.grad(lambda *xs: loss("xla", *xs), argnums=grad_argnums)(*f32)
        finite = np.isfinite(np.asarray(ref, np.float32))
        errs = [rel(np.where(finite, np.asarray(o, np.float32), 0), np.where(finite, ref, 0))]
        for a, b in zip(g, g_ref):
            b = np.asarray(b, np.float64)
            ok = np.isfinite(b)
            errs.append(rel(np.where(ok, np.asarray(a, np.float64), 0), np.where(ok, b, 0)))
        good = errs[0] <= 5e-3 and all(e <= 1e-2 for e in errs[1:])
        print(f"{'ok  ' if good else 'FAIL'} {name}: o {errs[0]:.2e}, grads " + ", ".join(f"{e:.2e}" for e in errs[1:]),
              flush=True)
    except Exception as e:  # noqa: BLE001 (a report, not a test)
        print(f"ERR  {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        print("     " + " | ".join(l.strip() for l in traceback.format_exc().splitlines() if "/nsa/" in l)[-600:])


SHAPES = {  # name: (B, T, TK, HQ, H, Dk, Dv, block_size, kv_lens)
    "G8-300": (2, 300, 300, 16, 2, 64, 64, 16, None),
    "G3-dv8": (1, 96, 96, 3, 1, 16, 8, 16, None),
    "G16-D128": (1, 512, 512, 64, 4, 128, 128, 64, None),
    "G1-dv32-bs8": (2, 40, 40, 4, 4, 16, 32, 8, None),
    "cache-decode": (2, 3, 300, 32, 2, 128, 128, 64, (300, 131)),
    "cache-chunk": (2, 70, 300, 16, 2, 64, 64, 16, (300, 131)),
}


def check(op):
    for name, (B, T, TK, HQ, H, Dk, Dv, bs, lens) in SHAPES.items():
        q, k, v, rng = inputs(B, T, TK, HQ, H, Dk, Dv, lens=lens)
        kv = None if lens is None else jnp.asarray(lens, jnp.int32)
        if op == "window":
            compare(f"window {name}", lambda q, k, v, impl: nsa.sliding_window_attention(
                q, k, v, window_size=64, kv_lens=kv, implementation=impl), (q, k, v), (0, 1, 2))
        elif op == "compressed":
            kc, vc = k[:, ::bs], v[:, ::bs]  # cdiv(TK, bs) rows: they cover the cache
            compare(f"compressed {name}", lambda q, kc, vc, impl: nsa.compressed_attention(
                q, kc, vc, block_size=bs, kv_lens=kv, implementation=impl), (q, kc, vc), (0, 1, 2))
        elif op == "selected":
            S = 4
            pos = (np.arange(T) if lens is None else np.asarray(lens)[:, None] - T + np.arange(T))
            pos = np.broadcast_to(pos, (B, T))
            idx = (rng.random((B, T, H, S)) * (pos[..., None, None] // bs + 1)).astype(np.int32)
            idx[..., 0] = pos[..., None] // bs
            idx[..., 1] = idx[..., 2]  # a block listed twice
            idx[:, ::7, :, 3] = -1
            compare(f"selected {name}", lambda q, k, v, impl: nsa.selected_attention(
                q, k, v, jnp.asarray(idx), block_size=bs, kv_lens=kv, implementation=impl), (q, k, v), (0, 1, 2))
        elif op == "attention" and lens is None:
            compare(f"attention {name}", lambda q, k, v, impl: nsa.attention(
                q, k, v, g_cmp=q[..., 0], block_counts=4, block_size=bs, window_size=32, implementation=impl),
                (q, k, v), (0, 1, 2))
    if op == "selected":  # packed sequences
        q, k, v, rng = inputs(1, 100, 100, 4, 2, 16, 16)
        cu = jnp.asarray([0, 23, 23, 70, 100], jnp.int32)
        idx = jnp.asarray((rng.random((1, 100, 2, 3)) * 2).astype(np.int32))
        compare("selected cu_seqlens", lambda q, k, v, impl: nsa.selected_attention(
            q, k, v, idx, block_size=16, cu_seqlens=cu, implementation=impl), (q, k, v), (0, 1, 2))


def checkpointed():
    """Gradients with and without jax.checkpoint, op by op (the shared base's G2 case in bfloat16): the largest
    difference of each gradient and where it is, and of two runs without checkpoint."""
    B, T, HQ, H, D, bs = 2, 100, 4, 2, 16, 16
    q, k, v, rng = inputs(B, T, T, HQ, H, D, D)
    g = jnp.asarray(rng.random((B, T, HQ)), DT)
    idx = jnp.asarray((rng.random((B, T, H, 3)) * (np.arange(T)[None, :, None, None] // bs + 1)).astype(np.int32))
    do = jnp.asarray(rng.standard_normal((B, T, HQ, D)), jnp.float32)
    ops = {
        "window": lambda q, k, v: nsa.sliding_window_attention(q, k, v, window_size=9, implementation="pallas"),
        "compressed": lambda q, k, v: nsa.compressed_attention(q, nsa.compress(k, block_size=bs),
                                                               nsa.compress(v, block_size=bs), block_size=bs,
                                                               implementation="pallas")[0],
        "selected": lambda q, k, v: nsa.selected_attention(q, k, v, idx, block_size=bs, implementation="pallas"),
        "attention": lambda q, k, v: nsa.attention(q, k, v, g_cmp=g, g_slc=g, g_swa=g, block_counts=3, block_size=bs,
                                                   window_size=9, implementation="pallas"),
    }
    for name, f in ops.items():
        try:
            loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do)
            g1 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
            g1b = jax.jit(jax.grad(lambda *a: loss(*a) * 1.0, argnums=(0, 1, 2)))(q, k, v)
            g2 = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v)
            report = []
            for n, a, b, c in zip("qkv", g1, g2, g1b):
                a, b, c = (np.asarray(x, np.float32) for x in (a, b, c))
                d = np.abs(a - b)
                report.append(f"d{n}: ckpt {d.max():.2e} at {np.unravel_index(d.argmax(), d.shape)} "
                              f"({np.mean(d > 1e-3 * np.abs(a).max()):.1%} off), rerun {np.abs(a - c).max():.2e}")
            print(f"{'ok  ' if all('ckpt 0.00e+00' in r for r in report) else 'DIFF'} checkpoint {name}: "
                  + "; ".join(report), flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"ERR  checkpoint {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)


def timed(f, *args, n=10):
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / n * 1e3


def times():
    for T in (8192, 16384):
        q, k, v, rng = inputs(1, T, T, 64, 4, 128, 128)
        idx = (rng.random((1, T, 4, 16)) * (np.arange(T)[None, :, None, None] // 64 + 1)).astype(np.int32)
        idx[..., 0] = (np.arange(T) // 64)[None, :, None]
        idx = jnp.asarray(idx)
        ops = {
            "selected": lambda q, k, v, impl: nsa.selected_attention(q, k, v, idx, block_size=64, implementation=impl),
            "window": lambda q, k, v, impl: nsa.sliding_window_attention(q, k, v, window_size=512, implementation=impl),
            "attention": lambda q, k, v, impl: nsa.attention(q, k, v, g_cmp=q[..., 0], g_slc=q[..., 1],
                                                             g_swa=q[..., 2], block_counts=16, block_size=64,
                                                             window_size=512, implementation=impl),
        }
        for name, f in ops.items():
            row = []
            for impl in ("pallas", "triton"):
                try:
                    fwd = jax.jit(lambda q, k, v: f(q, k, v, impl))
                    bwd = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, impl).astype(jnp.float32)),
                                           argnums=(0, 1, 2)))
                    row.append(f"{impl} {timed(fwd, q, k, v):.2f} / {timed(bwd, q, k, v):.2f} ms")
                except Exception as e:  # noqa: BLE001
                    row.append(f"{impl} ERR {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            print(f"T={T} {name}: " + "; ".join(row), flush=True)


if __name__ == "__main__":
    print("jax", jax.__version__, jax.devices(), flush=True)
    for what in sys.argv[1:]:
        {"time": times, "checkpoint": checkpointed}.get(what, lambda: check(what))()
