"""Token packing in selected attention: how many distinct blocks neighbouring queries list, and what packing
TB tokens into one tile costs or saves, on random selections and on selections with locality.

    python -m benchmarks.packing --out DIR [--seq-lens 8192 65536] [--tokens 1 2 4] [--iters 10] [--dq]

Standard shape (B = 1, HQ = 64, H = 4, D = 128, bf16, block 64, 16 blocks). Three selections:
  random          benchmarks.common.random_block_indices: distinct uniform blocks (the worst case for packing);
  select-iid      select_blocks on iid normal q and k (what the full-NSA rows of benchmarks/gpu.py select on);
  select-smooth   select_blocks on q and k that change slowly along T (benchmarks.common.smooth_inputs):
                  neighbouring queries pick much the same blocks, as a trained model's do.
For each it reports the union size (mean and max distinct blocks per tile of 4 and of 64 tokens and KV head,
against S = 16 per token) and times Triton's selected attention (forward and forward+backward, given
indices) with the forward and dq packing --tokens tokens per program (Config.tokens: TB * G rows per tile,
the union of the TB tokens' blocks loaded once), and the Mosaic GPU selected attention (4 tokens per
64-row tile), and checks o, dq, dk and dv of each against the first implementation's (max_rel_diff_vs_first: the
largest difference over the RMS of the first's). Writes packing-<T...>.json into --out. With --dq it times dq
alone instead, Triton's kernel against Mosaic GPU's over the same residuals (packing-dq-<T...>.json): the
break-even of nsa.pallas.gpu.selected.PACKED_DQ.
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

if not __package__:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nsa
from benchmarks.common import STANDARD, jax_inputs, random_block_indices, smooth_inputs, time_jax, union_sizes

B, HQ, H, D, BS, S = STANDARD[:6]


def selections(T):
    """{name: (q, k, v, do, idx [B, T, H, S])} of the three selections."""
    q, k, v, _, do = jax_inputs(T)
    qs, ks, vs, _, dos = smooth_inputs(T)
    k_cmp = lambda k: nsa.compress(k, block_size=BS)
    select = jax.jit(lambda q, kc: nsa.select_blocks(q, kc, block_counts=S, block_size=BS))
    return {"random": (q, k, v, do, jnp.asarray(random_block_indices(T))),
            "select-iid": (q, k, v, do, select(q, k_cmp(k))),
            "select-smooth": (qs, ks, vs, dos, select(qs, k_cmp(ks)))}


def triton_fns(tokens, num_warps):
    from nsa import _device
    from nsa._config import Shapes
    from nsa.triton import selected

    def config(q, k, v):
        shapes = Shapes.of(q, k, v, block_size=BS, block_counts=S)
        default = selected.default_config(shapes, q.dtype, _device.facts("cuda"))
        return default._replace(tokens=tokens, num_warps=num_warps or default.num_warps)

    def fwd(q, k, v, idx):
        counts = jnp.full(idx.shape[:3], S, jnp.int32)
        return selected.forward(q, k, v, idx, counts, None, block_size=BS, scale=D ** -0.5,
                                config=config(q, k, v))[0]

    def fwd_bwd(q, k, v, idx, do):
        counts = jnp.full(idx.shape[:3], S, jnp.int32)
        cfg = config(q, k, v)
        _, res = selected.forward(q, k, v, idx, counts, None, block_size=BS, scale=D ** -0.5, config=cfg)
        return selected.backward(res, do, block_size=BS, scale=D ** -0.5, config=cfg)[:3]

    return jax.jit(fwd), jax.jit(fwd_bwd)


def dq_fns():
    """(the residuals of Triton's forward, {impl: dq alone}): selected attention's dq of Triton's kernel and of Mosaic
    GPU's (backward(grads=(0,))) over the same residuals, the two implementation=None chooses between
    (nsa.pallas.gpu.selected.packs_dq)."""
    from nsa.pallas.gpu import selected as mosaic
    from nsa.triton import selected

    def residuals(q, k, v, idx):
        counts = jnp.full(idx.shape[:3], S, jnp.int32)
        return selected.forward(q, k, v, idx, counts, None, block_size=BS, scale=D ** -0.5)[1]

    dq = lambda module: jax.jit(lambda res, do: module.backward(res, do, block_size=BS, scale=D ** -0.5,
                                                                grads=(0,))[0])
    return jax.jit(residuals), {"triton-dq": dq(selected), "pallas-dq": dq(mosaic)}


def time_dq(T, name, q, k, v, do, idx, iters):
    """The rows of `dq_fns` on one selection: dq_ms, and dq's largest difference from Triton's over its RMS."""
    residuals, fns = dq_fns()
    res = residuals(q, k, v, idx)
    first = None
    for impl, fn in fns.items():
        row = dict(T=T, selection=name, impl=impl, dq_ms=1e3 * time_jax(fn, (res, do), iters))
        dq = fn(res, do).astype(jnp.float32)
        first = dq if first is None else first
        row["max_rel_diff_vs_first"] = float(jnp.max(jnp.abs(dq - first)) / jnp.sqrt(jnp.mean(jnp.square(first))))
        yield row


def api_fns(implementation):
    def fwd(q, k, v, idx):
        return nsa.selected_attention(q, k, v, idx, block_size=BS, implementation=implementation)

    def loss(q, k, v, idx, do):
        return jnp.sum(fwd(q, k, v, idx).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--warps", type=int, nargs="+", default=[0], help="Triton num_warps (0: the default's)")
    parser.add_argument("--no-pallas", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--dq", action="store_true", help="time dq alone, Triton's kernel against Mosaic GPU's")
    args = parser.parse_args()
    rows = []
    for T in args.seq_lens:
        for name, (q, k, v, do, idx) in selections(T).items():
            tile4, tile64 = union_sizes(idx, BS, 4), union_sizes(idx, BS, 64)
            if args.dq:
                for row in time_dq(T, name, q, k, v, do, idx, args.iters):
                    rows.append(dict(row, union4_mean=tile4[0], union64_mean=tile64[0]))
                    print(json.dumps(rows[-1]), flush=True)
                continue
            impls = [(f"triton-tb{tb}-w{w}", *triton_fns(tb, w)) for tb in args.tokens for w in args.warps]
            impls += [] if args.no_pallas else [("pallas", *api_fns("pallas"))]
            first = None
            for impl, fwd, fwd_bwd in impls:
                row = dict(T=T, selection=name, impl=impl, union4_mean=tile4[0], union4_max=tile4[1],
                           union64_mean=tile64[0], union64_max=tile64[1])
                try:
                    row["fwd_ms"] = 1e3 * time_jax(fwd, (q, k, v, idx), args.iters)
                    row["fwd_bwd_ms"] = 1e3 * time_jax(fwd_bwd, (q, k, v, idx, do), args.iters)
                    outputs = (fwd(q, k, v, idx), *fwd_bwd(q, k, v, idx, do))
                    first = first or outputs
                    row["max_rel_diff_vs_first"] = max(  # each of o, dq, dk, dv against the first impl's, by its RMS
                        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                              / jnp.sqrt(jnp.mean(jnp.square(b.astype(jnp.float32))))) for a, b in zip(outputs, first))
                except Exception as e:  # recorded, not hidden
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
    meta = dict(date=time.strftime("%Y-%m-%d"), device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    stem = "packing-dq-" if args.dq else "packing-"
    with open(os.path.join(args.out, stem + "-".join(map(str, args.seq_lens)) + ".json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
