"""The Mosaic GPU block selection (nsa/pallas/gpu/select.py) against the XLA reference, on the H200.

    python3 scripts/gpu_check_select.py          # on the H200 (jax >= 0.11); about a minute

Each case prints one line: the fraction of (token, KV head) rows whose selected blocks equal the reference's
(each row's ids sorted, so the rank order of equal scores does not count) and whether it passes: every row on
the small cases, at least 99.9% at the standard shape (8k tokens: a float near-tie may flip one pick). The
standard case with lse is also timed (median of 20 runs after a warmup). A failing case prints its traceback's
last line (the whole one is saved under $OUT, or /tmp) and the script goes on. The reference runs on the
float32 copies of the same bfloat16 inputs, its float32 matmuls in full precision (not TF32). Exit status 1 if
any case fails.
"""

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # the reference's float32 matmuls: no TF32

from nsa._varlen import num_compressed_blocks, tokens  # noqa: E402
from nsa.pallas.gpu import select as gpu_select  # noqa: E402
from nsa.reference import select as reference  # noqa: E402
from nsa.reference.compressed import softmax_over_blocks  # noqa: E402

# name: (B, T, HQ, H, Dk, block_size, block_counts), lse given, cu_seqlens, kv_lens (a cache of 128 tokens),
# rows that must match (1.0: all), timed
CASES = {
    "B1-T300-G16-dk64-bs16": ((1, 300, 16, 1, 64, 16, 4), False, None, None, 1.0, False),
    "B2-T100-G2-dk16-bs16-kv_lens": ((2, 100, 4, 2, 16, 16, 4), False, None, [100, 57], 1.0, False),
    "B2-T100-G2-dk16-bs16-kv_lens-lse": ((2, 100, 4, 2, 16, 16, 4), True, None, [100, 57], 1.0, False),
    "T100-G3-dk128-bs8-cu_seqlens-lse": ((1, 100, 6, 2, 128, 8, 4), True, [0, 23, 23, 70, 100], None, 1.0, False),
    "T100-G16-dk64-bs8-cu_seqlens": ((1, 100, 16, 1, 64, 8, 5), False, [0, 23, 23, 70, 100], None, 1.0, False),
    "standard-T8192-G16-dk128-bs64-S16-lse": ((1, 8192, 64, 4, 128, 64, 16), True, None, None, 0.999, True),
    "standard-T8192-G16-dk128-bs64-S16": ((1, 8192, 64, 4, 128, 64, 16), False, None, None, 0.999, False),
}
CACHE_TOKENS = 128


def inputs(B, T, HQ, H, Dk, bs, cu, kv_lens, seed=0):
    """q, k_cmp bfloat16 random normal; with kv_lens k_cmp is a cache of CACHE_TOKENS tokens whose rows past
    each sequence's complete blocks hold NaN (no query may read them)."""
    rng = np.random.default_rng(seed)
    NC = CACHE_TOKENS // bs if kv_lens is not None else num_compressed_blocks(T, bs, cu)
    q = jnp.asarray(rng.standard_normal((B, T, HQ, Dk)), jnp.bfloat16)
    k_cmp = rng.standard_normal((B, NC, H, Dk)).astype(np.float32)
    if kv_lens is not None:
        for b, n in enumerate(kv_lens):
            k_cmp[b, n // bs:] = np.nan
    return q, jnp.asarray(k_cmp, jnp.bfloat16)


def compressed_lse(q, k_cmp, bs, cu, kv_lens, scale):
    """Compressed attention's lse [B, T, HQ] of the float32 copies (as nsa.attention hands it over)."""
    tok = tokens(q.shape[1], bs, cu, kv_lens)
    _, lse, _ = softmax_over_blocks(q.astype(jnp.float32), k_cmp.astype(jnp.float32), tok.pos, tok.cmp_start,
                                    block_size=bs, scale=scale)
    return lse.reshape(q.shape[:3])


def run_case(name, spec):
    (B, T, HQ, H, Dk, bs, S), with_lse, cu, kv_lens, need, timed = spec
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    kv_lens = None if kv_lens is None else jnp.asarray(kv_lens, jnp.int32)
    q, k_cmp = inputs(B, T, HQ, H, Dk, bs, cu, None if kv_lens is None else np.asarray(kv_lens))
    scale = Dk ** -0.5
    lse = compressed_lse(q, k_cmp, bs, cu, kv_lens, scale) if with_lse else None
    kw = dict(block_counts=S, block_size=bs, scale=scale)
    f = jax.jit(lambda q, k, lse, cu, kv: gpu_select.forward(q, k, lse, cu, kv, **kw))
    got = np.asarray(jax.block_until_ready(f(q, k_cmp, lse, cu, kv_lens)))
    ref = np.asarray(reference.forward(q.astype(jnp.float32), k_cmp.astype(jnp.float32), lse, cu, kv_lens, **kw))
    rows_equal = np.all(np.sort(got, axis=-1) == np.sort(ref, axis=-1), axis=-1)
    frac = float(np.mean(rows_equal))
    ok = frac >= need
    line = f"{'ok    ' if ok else 'FAILED'} {name}: {frac:.6f} of {rows_equal.size} rows equal (need {need})"
    if np.any(got[..., 0] != ref[..., 0]):
        line += "; first slot (the current block) differs somewhere"
    if timed:
        times = []
        for _ in range(20):
            start = time.perf_counter()
            jax.block_until_ready(f(q, k_cmp, lse, cu, kv_lens))
            times.append(time.perf_counter() - start)
        line += f"; {np.median(times) * 1e3:.3f} ms (median of 20, scores + XLA top-k)"
    print(line, flush=True)
    return ok


def main():
    print("jax", jax.__version__, jax.devices(), flush=True)
    failed = []
    for name, spec in CASES.items():
        try:
            if not run_case(name, spec):
                failed.append(name)
        except Exception:  # every case runs; the traceback's last line says what broke, the whole one is saved
            trace = traceback.format_exc()
            path = os.path.join(os.environ.get("OUT", "/tmp"), f"gpu_check_select-{name}.txt")
            with open(path, "w") as f:
                f.write(trace)
            print(f"FAILED {name}: {trace.strip().splitlines()[-1][:500]} (traceback: {path})", flush=True)
            failed.append(name)
    summary = f"{len(CASES) - len(failed)} of {len(CASES)} cases pass"
    print(summary + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
