"""What Pallas's Mosaic GPU backend does with the installed jax (issue 12's first questions), in one run.

    python scripts/mosaic_gpu_probe.py            # on the CPU machine: interpret mode and export for cuda
    python scripts/mosaic_gpu_probe.py --gpu      # on the H200 (scripts/gpu.sh probe): the kernels run

Checks, each printed as ok/FAILED with the error:
1. a `plgpu.kernel` (elementwise add) in GPU interpret mode (plgpu.InterpretGPUParams) on this machine;
2. the same kernel exported for cuda (jax.export, platforms=["cuda"]): a mosaic_gpu custom call;
3. jax's own FlashAttention-3 kernel (jax.experimental.pallas.ops.gpu.attention_mgpu: TMA copies, wgmma,
   warp specialization) exported for cuda, and in GPU interpret mode;
4. with --gpu: both kernels run on the GPU against a reference, and FA3's forward timed at B=1, T=8192,
   64 heads of 128 (float16, causal: its p is cast to float16).
"""

import argparse
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas.ops.gpu import attention_mgpu


def add(x, y, interpret=None):
    def body(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, y)


def check(name, fn):
    try:
        print(f"ok       {name}: {fn()}", flush=True)
    except Exception as e:  # a probe: every outcome is a finding
        print(f"FAILED   {name}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
        traceback.print_exc(limit=2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    print("jax", jax.__version__, jax.devices(), flush=True)
    if attention_mgpu.cuda_versions is None:  # no CUDA plugin here: FA3 asks for the runtime's version
        attention_mgpu.cuda_versions = type("CudaVersions", (), {"cuda_runtime_get_version": staticmethod(lambda: 13000)})
    x = jnp.arange(256, dtype=jnp.float32).reshape(2, 128)
    interpret = plgpu.InterpretGPUParams()
    check("add, GPU interpret mode", lambda: bool(np.array_equal(np.asarray(add(x, x, interpret)), 2 * np.asarray(x))))
    check("add, exported for cuda", lambda: "mosaic_gpu" in jax.export.export(jax.jit(add), platforms=["cuda"])(
        x, x).mlir_module())

    B, T, H, D = 1, 128, 1, 64
    q, k, v = (jax.random.normal(key, (B, T, H, D), jnp.float16) for key in jax.random.split(jax.random.PRNGKey(0), 3))
    cfg = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
    fa3 = jax.jit(lambda q, k, v: attention_mgpu.attention(q, k, v, cfg))
    check("FA3, exported for cuda", lambda: jax.export.export(fa3, platforms=["cuda"])(q, k, v).mlir_module().count(
        "mosaic_gpu_v2"))

    def interpreted():
        with plgpu.force_gpu_interpret_mode(interpret):
            out = attention_mgpu.attention(q, k, v, cfg)
        return float(jnp.max(jnp.abs(out.astype(jnp.float32) - attention_mgpu.attention_reference(q, k, v))))
    check("FA3, GPU interpret mode", interpreted)
    if not args.gpu:
        return
    check("add, on the GPU", lambda: bool(np.array_equal(np.asarray(add(x, x)), 2 * np.asarray(x))))
    check("FA3, on the GPU (max abs error, T=128)", lambda: float(jnp.max(jnp.abs(
        fa3(q, k, v).astype(jnp.float32) - attention_mgpu.attention_reference(q, k, v).astype(jnp.float32)))))

    def timed():
        B, T, H, D = 1, 8192, 64, 128
        q, k, v = (jax.random.normal(key, (B, T, H, D), jnp.float16) for key in jax.random.split(jax.random.PRNGKey(1), 3))
        cfg = attention_mgpu.TuningConfig(block_q=128, block_kv=128, max_concurrent_steps=2, causal=True)
        f = jax.jit(lambda q, k, v: attention_mgpu.attention(q, k, v, cfg))
        f(q, k, v).block_until_ready()
        start = time.perf_counter()
        for _ in range(20):
            out = f(q, k, v)
        out.block_until_ready()
        ms = (time.perf_counter() - start) / 20 * 1e3
        flops = 4 * B * H * T * T * D / 2  # causal
        return f"{ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s (causal, float16: the kernel takes no bf16, B=1 T=8192 H=64 D=128)"
    check("FA3 forward timed on the GPU", timed)


if __name__ == "__main__":
    main()
