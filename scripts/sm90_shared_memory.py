"""Compiles every Triton launch of nsa for sm_90 (H100 / H200) on any machine, no GPU needed, and
checks its shared memory against an H200 block's (nsa._device.TABLE: 227 KiB).

    python scripts/sm90_shared_memory.py            # bf16 / fp16 configs (a few minutes)
    python scripts/sm90_shared_memory.py --float32  # also the float32 ones (FMA dots: slow to compile)
    python scripts/sm90_shared_memory.py --ptx-dir DIR  # also writes each launch's PTX (debug lines
                                                        # dropped), to diff two versions of a kernel

A kernel whose pipelined tiles do not fit compiles here but fails at launch on the GPU, and only for
the shapes that reach it (wide heads, large groups, float32): this finds them without device time.
It runs nsa.attention forward and backward with implementation="triton" on the CPU, with the kernel
launch (nsa.triton._launch._call) replaced by a compile for sm_90 that records the launch's shared
memory and returns zeros, so every launch uses the library's own heuristics (tiles, warps, stages), planned
for the H200's facts (nsa._device.facts replaced by its row of the table); select_blocks also at T = 256
blocks, where its launch pipelines.
Needs triton (its bundled ptxas); exits 1 if a launch needs more than the limit.
"""

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # kernels must be JIT functions to be compiled

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nsa  # noqa: E402
from nsa import _device  # noqa: E402
from nsa.triton import _launch, _splits, decode, select  # noqa: E402
from triton_launches import compile_sm90, ptx_code  # noqa: E402

DEVICE = _device.TABLE["NVIDIA H200"]  # the heuristics plan for it; sm_90 is its architecture
LIMIT = DEVICE.shared_memory  # a block's shared memory

# (G, dtype, Dk, Dv, block_size): the widest tiles of the contract, and the benchmarked shape
CONFIGS = [
    (16, "bfloat16", 128, 128, 64),
    (64, "bfloat16", 256, 256, 128),
    (16, "float16", 256, 16, 128),
    (1, "bfloat16", 16, 256, 16),
]
FLOAT32_CONFIGS = [
    (64, "float32", 256, 256, 128),
    (16, "float32", 64, 256, 128),
    (64, "float32", 128, 128, 128),
]


def compile_launch(records):
    """A stand-in for jax_triton.triton_call that compiles the launch for sm_90 and returns zeros."""

    def call(*args, kernel, out_shape, grid, num_warps, num_stages, **constexprs):
        outs = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]
        compiled = compile_sm90(kernel, [*args, *outs], num_warps, num_stages, constexprs)
        name = f"{kernel.fn.__module__.rsplit('.', 1)[-1]}.{kernel.fn.__name__}"
        records.append((name, compiled.metadata.shared, num_warps, num_stages, ptx_code(compiled.asm["ptx"])))
        zeros = [jnp.zeros(o.shape, o.dtype) for o in outs]
        return zeros if isinstance(out_shape, (list, tuple)) else zeros[0]

    return call


def check(config, records):
    """Forward and backward of the whole nsa.attention (every kernel) on one config."""
    G, dtype, dk, dv, bs = config
    B, T, H = 1, 1024, 2
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((B, T, H * G, dk), (B, T, H, dk), (B, T, H, dv)))
    gates = [jnp.ones((B, T, H * G), dtype)] * 3

    def loss(q, k, v, *g):
        o = nsa.attention(q, k, v, g_cmp=g[0], g_slc=g[1], g_swa=g[2], block_counts=16, block_size=bs,
                          window_size=512, implementation="triton")
        return jnp.sum(o.astype(jnp.float32))

    jax.grad(loss, argnums=(0, 1, 2))(q, k, v, *gates)


def check_long_select(config, records):
    """select at T = 256 blocks, where its launch takes two pipeline stages (select.default_config), with and
    without compressed attention's lse: traced only (jax.eval_shape), so no T-long array is made."""
    G, dtype, dk, _, bs = config
    T = 256 * bs
    q = jax.ShapeDtypeStruct((1, T, G, dk), dtype)
    k_cmp = jax.ShapeDtypeStruct((1, T // bs, 1, dk), dtype)
    lse = jax.ShapeDtypeStruct((1, T, G), jnp.float32)
    for with_lse in (True, False):
        run = lambda q, k_cmp, lse: select.forward(q, k_cmp, lse if with_lse else None, None, block_counts=16,
                                                   block_size=bs, scale=dk ** -0.5)
        jax.eval_shape(run, q, k_cmp, lse)


def check_decode(args):
    """The decode kernels (nsa/triton/decode.py: window, compressed, selected, their split and combine
    launches, and the fused step with the decode select, nsa/triton/decode_select.py) at the standard serving
    shape (HQ = 64, H = 4, D = 128, bf16, block 64, 16 slots, window 512, TK = 65536) for B = 1 (splits and the
    combine) and B = 64 (one split), TQ = 1 and 8 (TQ * G = 128 rows, the largest tile nsa.triton._splits.applies
    takes); then each config of CONFIGS (FLOAT32_CONFIGS with --float32) at its largest such tile,
    TQ = min(16, 128 // G). Traced only (jax.eval_shape): no cache-sized array is made. Prints each launch;
    returns the largest shared memory."""
    shapes = [(B, TQ, 16, "bfloat16", 128, 128, 64) for B in (1, 64) for TQ in (1, 8)]
    for c in CONFIGS + (FLOAT32_CONFIGS if args.float32 else []):
        shapes.append((1, max(1, min(_splits.MAX_TOKENS, _splits.MAX_ROWS // c[0])), *c))
    worst = 0
    for B, TQ, G, dtype, dk, dv, bs in shapes:
        H, TK, S = 4, 65536, 16
        arg = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt)
        q, k, v = arg(B, TQ, H * G, dk), arg(B, TK, H, dk), arg(B, TK, H, dv)
        k_cmp, v_cmp = arg(B, TK // bs, H, dk), arg(B, TK // bs, H, dv)
        lens, idx, counts = arg(B, dt=jnp.int32), arg(B, TQ, H, S, dt=jnp.int32), arg(B, TQ, H, dt=jnp.int32)
        records = []
        _launch._call = compile_launch(records)
        kw = dict(scale=dk ** -0.5)
        jax.eval_shape(lambda q, k, v, lens: decode.window(q, k, v, lens, window_size=512, **kw), q, k, v, lens)
        jax.eval_shape(lambda q, k, v, lens: decode.compressed(q, k, v, lens, block_size=bs, stride=bs, **kw),
                       q, k_cmp, v_cmp, lens)
        jax.eval_shape(lambda q, k, v, idx, counts, lens: decode.selected(q, k, v, idx, counts, lens, block_size=bs,
                                                                           **kw), q, k, v, idx, counts, lens)
        gate = arg(B, TQ, H * G)
        step = decode.Step(q, k, v, k_cmp, v_cmp, g_cmp=gate, g_slc=gate, g_swa=gate, kv_lens=lens)
        jax.eval_shape(lambda *a: decode.attention(*a, block_counts=S, block_size=bs, window_size=512, **kw),
                       *step)  # the fused step, the decode select with it
        for i, (name, shared, warps, stages, ptx) in enumerate(records):
            worst = max(worst, shared)
            if args.ptx_dir:
                os.makedirs(args.ptx_dir, exist_ok=True)
                tag = "-".join(map(str, ("decode", B, TQ, G, dtype, dk, dv, bs)))
                with open(os.path.join(args.ptx_dir, f"{tag}-{i:02d}-{name}.ptx"), "w") as f:
                    f.write(ptx)
            flag = "  OVER THE LIMIT" if shared > LIMIT else ""
            print(f"B={B:<3} TQ={TQ:<3} G={G:<3} {dtype:<9} Dk={dk:<4} Dv={dv:<4} bs={bs:<4} {name:<30} warps={warps} "
                  f"stages={stages} shared={shared / 1024:6.1f} KiB{flag}", flush=True)
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--float32", action="store_true", help="also the float32 configs")
    parser.add_argument("--ptx-dir", help="write each launch's PTX here, one file per config and launch")
    args = parser.parse_args()
    _launch.jax_triton_error = lambda: None  # the kernels only compile here: no jax_triton needed
    _device.facts = lambda platform="cuda": DEVICE
    worst = 0
    for config in CONFIGS + (FLOAT32_CONFIGS if args.float32 else []):
        records = []
        _launch._call = compile_launch(records)
        check(config, records)
        check_long_select(config, records)
        for i, (name, shared, warps, stages, ptx) in enumerate(records):
            worst = max(worst, shared)
            if args.ptx_dir:
                os.makedirs(args.ptx_dir, exist_ok=True)
                tag = "-".join(map(str, config))
                with open(os.path.join(args.ptx_dir, f"{tag}-{i:02d}-{name}.ptx"), "w") as f:
                    f.write(ptx)
            flag = "  OVER THE LIMIT" if shared > LIMIT else ""
            print(f"G={config[0]:<3} {config[1]:<9} Dk={config[2]:<4} Dv={config[3]:<4} bs={config[4]:<4} "
                  f"{name:<30} warps={warps} stages={stages} shared={shared / 1024:6.1f} KiB{flag}", flush=True)
    worst = max(worst, check_decode(args))
    print(f"largest: {worst / 1024:.1f} KiB of {LIMIT / 1024:.0f} KiB")
    return 1 if worst > LIMIT else 0


if __name__ == "__main__":
    sys.exit(main())
