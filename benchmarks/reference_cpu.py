"""Time and peak memory of the XLA reference, forward + backward, on this machine's CPU.

    python benchmarks/reference_cpu.py [--seq-len 8192] [--dtype bfloat16] [--out results/reference_cpu.json]

Runs nsa.attention (implementation="xla") with all three branches on the standard shape (B = 1,
HQ = 64, H = 4, D = 128, block_size 64, 16 blocks, window 512), jitted, and reports the compile
time, the median of a few timed runs and the process's peak resident memory (which includes the
inputs, the outputs, the gradients and JAX itself).
"""

import argparse
import json
import platform
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import nsa


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args()

    B, T, HQ, H, D = 1, args.seq_len, 64, 4, 128
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (B, T, HQ, D), args.dtype)
    k = jax.random.normal(keys[1], (B, T, H, D), args.dtype)
    v = jax.random.normal(keys[2], (B, T, H, D), args.dtype)
    gates = [jax.nn.sigmoid(jax.random.normal(key, (B, T, HQ))).astype(args.dtype) for key in keys[3:]]

    def loss(q, k, v, g_cmp, g_slc, g_swa):
        o = nsa.attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_counts=16, block_size=64,
                          window_size=512, implementation="xla")
        return jnp.sum(o.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6))))
    start = time.perf_counter()
    jax.block_until_ready(step(q, k, v, *gates))
    compile_and_first = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v, *gates))
        times.append(time.perf_counter() - start)
    result = {
        "what": "nsa.attention forward+backward, implementation='xla', all branches",
        "shape": dict(B=B, T=T, HQ=HQ, H=H, D=D, block_size=64, block_counts=16, window_size=512, dtype=args.dtype),
        "median_s": round(statistics.median(times), 2),
        "first_call_s": round(compile_and_first, 2),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2),
        "cpu_count": jax.local_device_count() and __import__("os").cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "jax": jax.__version__, "numpy": np.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
