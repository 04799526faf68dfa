"""Where the time of nsa.attention goes: each op of the full NSA pipeline timed alone on the GPU.

    python -m benchmarks.ops --out DIR [--seq-lens 65536] [--impl triton] [--sweep flash selected]
        [--q-heads 64] [--shared-selection] [--ops selected ...] [--compression 32 16]

Standard shape of benchmarks/gpu.py (B=1, HQ=64, H=4, D=128, bf16, block 64, 16 blocks, window 512);
--q-heads changes HQ (the group size G = HQ / 4: small groups take another path in selected attention).
selected_attention runs on the blocks select_blocks picks for the (random) inputs, or, with
--shared-selection, on those of the last token of each 64-token block for every token of that block
(what neighbouring queries of a trained model come closer to: they share most of their blocks).
For each T it times, forward and forward+backward (median over --iters after warm-up): compress of k
(and the same for v), compressed_attention, select_blocks (forward only), selected_attention on the
selected blocks, sliding_window_attention, and the whole nsa.attention. --compression L D compresses windows
of L tokens every D (the paper's: 32 16; selection blocks stay 64). Writes
ops-<seq lens>[-hq<HQ>][-shared][-<impl> unless triton][-l<L>-d<D>].json into --out.

--sweep also times the flash kernels (window, compressed) and the selected-attention kernels under a
few tile / warp / stage candidates: each kernel module's forward and backward entry point takes a
Config (nsa.triton._flash.Config, nsa.triton.selected.Config), and the sweep passes candidates to it
instead of the default one. A tuning aid: the library's heuristics are not changed by it.
"""

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp

import nsa
from benchmarks.gpu import BS, HQ, S, WINDOW, implementation_of, jax_inputs, time_jax


def _grad_fn(fn, argnums):
    def loss(*args):
        out = fn(*args)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out.astype(jnp.float32) * args[-1].astype(jnp.float32))

    return jax.jit(jax.grad(lambda *a: loss(*a), argnums=argnums))


def op_cases(T, impl, hq=HQ, shared_selection=False, compression=(BS, BS)):
    """(name, forward fn, forward+backward fn or None, args) for each op of the pipeline; compression is
    (l, d): windows of l tokens every d (the paper's is (32, 16)), selection blocks of BS tokens."""
    q, k, v, gates, do = jax_inputs(T, hq=hq)
    kw = dict(implementation=implementation_of(impl))
    l, stride = compression
    blocks = dict(block_size=BS, compress_block_size=l, compress_stride=stride)
    k_cmp = nsa.compress(k, block_size=l, stride=stride)
    v_cmp = nsa.compress(v, block_size=l, stride=stride)
    select = lambda q, kc: nsa.select_blocks(q, kc, block_counts=S, **blocks, **kw)
    idx = jax.jit(select)(q, k_cmp)
    if shared_selection:
        idx = idx[:, jnp.minimum((jnp.arange(T) // BS + 1) * BS - 1, T - 1)]
    dk_cmp = jnp.zeros_like(k_cmp)

    compress = lambda x, d: nsa.compress(x, block_size=l, stride=stride)
    compressed = lambda q, kc, vc, d: nsa.compressed_attention(q, kc, vc, block_size=l, stride=stride, **kw)
    selected = lambda q, k, v, d: nsa.selected_attention(q, k, v, idx, block_size=BS, **kw)
    window = lambda q, k, v, d: nsa.sliding_window_attention(q, k, v, window_size=WINDOW, **kw)

    def full(q, k, v, g0, g1, g2, d):
        return nsa.attention(q, k, v, g_cmp=g0, g_slc=g1, g_swa=g2, block_counts=S, **blocks,
                             window_size=WINDOW, **kw)

    return [
        ("compress", jax.jit(compress), _grad_fn(compress, (0,)), (k, dk_cmp)),
        ("compressed", jax.jit(compressed), _grad_fn(compressed, (0, 1, 2)), (q, k_cmp, v_cmp, do)),
        ("select", jax.jit(select), None, (q, k_cmp)),
        ("selected", jax.jit(selected), _grad_fn(selected, (0, 1, 2)), (q, k, v, do)),
        ("window", jax.jit(window), _grad_fn(window, (0, 1, 2)), (q, k, v, do)),
        ("attention", jax.jit(full), _grad_fn(full, (0, 1, 2, 3, 4, 5)), (q, k, v, *gates, do)),
    ]


def add_compression_argument(parser):
    """--compression L D, as ops.py and trace.py take it."""
    parser.add_argument("--compression", type=int, nargs=2, default=(BS, BS), metavar=("L", "D"),
                        help="compression windows of L tokens every D (default: 64 64; the paper's: 32 16)")


def compression_suffix(compression):
    """The results file's suffix for compression (l, d): none for the default (BS, BS)."""
    return "" if tuple(compression) == (BS, BS) else "-l{}-d{}".format(*compression)


def time_ops(T, impl, iters, names=None, hq=HQ, shared_selection=False, compression=(BS, BS)):
    rows = []
    for name, fwd, fwd_bwd, args in op_cases(T, impl, hq, shared_selection, compression):
        if names and name not in names:
            continue
        row = dict(op=name, T=T, impl=impl, HQ=hq, shared_selection=shared_selection, compression=list(compression))
        try:
            row["fwd_ms"] = 1e3 * time_jax(fwd, args, iters)
            if fwd_bwd is not None:
                row["fwd_bwd_ms"] = 1e3 * time_jax(fwd_bwd, args, iters)
        except Exception as e:  # recorded, not hidden
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _entry_points(module, static, arrays, forward_config, backward_config):
    """Forward and forward+backward (the backward on the forward's residuals) of a kernel module's entry
    points with the given Configs, jitted."""
    *inputs, do = arrays

    def fwd(*inputs):
        return module.forward(*inputs, **static, config=forward_config)[0]

    def fwd_bwd(*arrays):
        *inputs, do = arrays
        out, res = module.forward(*inputs, **static, config=forward_config)
        ct = (do, jax.numpy.zeros_like(out[1])) if isinstance(out, tuple) else do
        return module.backward(res, ct, **static, config=backward_config)

    return jax.jit(fwd), jax.jit(fwd_bwd), inputs


def _time_config(name, T, iters, fwd, fwd_bwd, inputs, do, config):
    row = dict(op=name, T=T, impl="triton", config=config)
    try:
        row["fwd_ms"] = 1e3 * time_jax(fwd, inputs, iters)
        row["fwd_bwd_ms"] = 1e3 * time_jax(fwd_bwd, (*inputs, do), iters)
    except Exception as e:  # recorded, not hidden (a config past the shared memory fails to launch)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(row), flush=True)
    return row


def sweep(T, iters, what):
    """Times window / compressed ("flash") and selected ("selected") under candidate Configs."""
    from nsa import _device
    from nsa._config import Shapes
    from nsa.triton import _flash, compressed, selected, window

    q, k, v, _, do = jax_inputs(T)
    k_cmp, v_cmp = nsa.compress(k, block_size=BS), nsa.compress(v, block_size=BS)
    scale = q.shape[-1] ** -0.5
    rows = []
    flash = [("window", window, dict(window_size=WINDOW), (q, k, v, None)),
             ("compressed", compressed, dict(block_size=BS), (q, k_cmp, v_cmp, None))]
    device = _device.facts("cuda")
    for bm, bn, warps, stages in itertools.product((64, 128), (64, 128), (4, 8), (2, 3)) if "flash" in what else ():
        for name, module, static, inputs in flash:
            config = _flash.default_config(Shapes.of(*inputs[:3], **static), q.dtype, device)._replace(
                block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, bwd_block_m=min(bm, 64), bwd_block_n=bn,
                bwd_num_stages=stages)
            fwd, fwd_bwd, args = _entry_points(module, dict(static, scale=scale), (*inputs, do), config, config)
            rows.append(_time_config(name, T, iters, fwd, fwd_bwd, args, do, config._asdict()))

    idx = jax.jit(lambda q, k_cmp: nsa.select_blocks(q, k_cmp, block_counts=S, block_size=BS))(q, k_cmp)
    counts = jax.numpy.full(idx.shape[:3], S, jax.numpy.int32)
    default = selected.default_config(Shapes.of(q, k, v, block_size=BS, block_counts=S), q.dtype, device)
    for warps, stages in itertools.product((2, 4, 8), (1, 2, 3)) if "selected" in what else ():
        config = default._replace(num_warps=warps, num_stages=stages)
        fwd, fwd_bwd, args = _entry_points(selected, dict(block_size=BS, scale=scale),
                                           (q, k, v, idx, counts, None, do), config, config)
        rows.append(_time_config("selected", T, iters, fwd, fwd_bwd, args, do, config._asdict()))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[65536])
    parser.add_argument("--impl", default="triton",
                        help="triton, pallas, xla, or auto (implementation=None: the per-op choice of nsa._dispatch)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sweep", nargs="*", choices=["flash", "selected"], default=[],
                        help="kernels to sweep over candidate configs")
    parser.add_argument("--q-heads", type=int, default=HQ, help="HQ (4 KV heads): G = HQ / 4")
    parser.add_argument("--shared-selection", action="store_true",
                        help="every token of a 64-token block selects the blocks of its block's last token")
    parser.add_argument("--ops", nargs="*", default=None, help="time only these ops (default: all)")
    add_compression_argument(parser)
    args = parser.parse_args()
    result = dict(date=time.strftime("%Y-%m-%d"), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  rows=[], sweep=[])
    for T in args.seq_lens:
        result["rows"] += time_ops(T, args.impl, args.iters, args.ops, args.q_heads, args.shared_selection,
                                   tuple(args.compression))
        if args.sweep:
            result["sweep"] += sweep(T, args.iters, args.sweep)
    name = "-".join(map(str, args.seq_lens)) + (f"-hq{args.q_heads}" if args.q_heads != HQ else "")
    name += "-shared" if args.shared_selection else ""
    name += "" if args.impl == "triton" else f"-{args.impl}"
    name += compression_suffix(args.compression)
    with open(f"{args.out}/ops-{name}.json", "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
