"""Each nsa op compiled and run by its Mosaic TPU kernels on a real TPU, one at a time, against the XLA reference on
the host's CPU: forward and gradients, bfloat16, plain and packed (cu_seqlens with a sequence start off the 8-row
tile), and a decode step over a KV cache. One line per (op, case): ok with its relative error, or the first line of
the error. Run on a TPU: `python3 scripts/tpu_ops.py` (scripts/tpu_check.sh runs it)."""

import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import nsa  # noqa: E402

B, HQ, H, D, BS, S, W = 1, 16, 1, 128, 64, 4, 128
T = int(os.environ.get("T", 1024))  # a smaller T for a smoke run on the CPU (Pallas interpret mode)
TOL = 2e-2


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


def report(name, run):
    """run(implementation) -> pytree; pallas on the default device (the TPU) against xla on the CPU."""
    try:
        got = jax.block_until_ready(run("pallas"))
    except Exception as e:  # the first line of what Mosaic (or anything) said
        lines = [l for l in traceback.format_exception_only(type(e), e)[-1].splitlines() if l.strip()]
        print(f"FAILED   {name}: {lines[0][:400]}", flush=True)
        return
    with jax.default_device(jax.devices("cpu")[0]):
        want = run("xla")
    errs = [_rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))]
    status = "ok" if max(errs) <= TOL and all(np.isfinite(errs)) else "MISMATCH"
    print(f"{status:8} {name}: relative errors {', '.join(f'{e:.1e}' for e in errs)}", flush=True)


def main():
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (B, T, HQ, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, H, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, H, D), jnp.bfloat16)
    g = jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, HQ, 3), jnp.float32)).astype(jnp.bfloat16)
    do = jax.random.normal(keys[4], (B, T, HQ, D), jnp.bfloat16)
    packed = jnp.asarray([0, 37, 100, 101, T], jnp.int32)  # starts off the 8-row tile, an empty sequence
    for cu_name, cu in (("plain", None), ("packed", packed)):
        k_cmp, v_cmp = (nsa.compress(x, block_size=BS, cu_seqlens=cu) for x in (k, v))
        idx = nsa.select_blocks(q, k_cmp, block_counts=S, block_size=BS, cu_seqlens=cu, implementation="xla")
        ops = {
            "compressed_attention": lambda impl: nsa.compressed_attention(
                q, k_cmp, v_cmp, block_size=BS, cu_seqlens=cu, implementation=impl)[0],
            "select_blocks": lambda impl: nsa.select_blocks(q, k_cmp, block_counts=S, block_size=BS, cu_seqlens=cu,
                                                            implementation=impl),
            "selected_attention": lambda impl: nsa.selected_attention(q, k, v, idx, block_size=BS, cu_seqlens=cu,
                                                                      implementation=impl),
            "sliding_window_attention": lambda impl: nsa.sliding_window_attention(
                q, k, v, window_size=W, cu_seqlens=cu, implementation=impl),
        }
        for name, fwd in ops.items():
            report(f"{name} {cu_name} forward", lambda impl: fwd(impl))

        def attention(impl, q, k, v, g):
            return nsa.attention(q, k, v, g_cmp=g[..., 0], g_slc=g[..., 1], g_swa=g[..., 2], block_counts=S,
                                 block_size=BS, window_size=W, cu_seqlens=cu, implementation=impl)

        report(f"attention {cu_name} forward", lambda impl: attention(impl, q, k, v, g))
        report(f"attention {cu_name} gradients", lambda impl: jax.grad(
            lambda *a: jnp.sum(attention(impl, *a).astype(jnp.float32) * do), argnums=(0, 1, 2, 3))(q, k, v, g))
    TK = 4 * T
    lens = jnp.asarray([TK - 5], jnp.int32)
    kc = jax.random.normal(keys[5], (B, TK, H, D), jnp.bfloat16)
    cache = nsa.prefill_cache(kc, kc, block_size=BS, capacity=TK)
    report("attention decode step", lambda impl: nsa.attention(
        q[:, :1], cache=cache.replace(lens=lens), g_cmp=g[:, :1, :, 0], g_slc=g[:, :1, :, 1], g_swa=g[:, :1, :, 2],
        block_counts=S, window_size=W, implementation=impl))


if __name__ == "__main__":
    main()
