"""Training kernels on a TPU, each beside splash attention in the same run (issue 52): selected attention's resident
kernels (nsa.pallas.tpu.selected, the default where they fit) against its union kernels (an explicit Config), on
random selections and on selections shared by each 64-token block; the window branch's flash kernels against splash
attention with a local mask; dense causal splash; and the fixed cost of one grid step. Each result agrees (relative
error) with what it replaces. Standard shape: B = 1, HQ = 64, H = 4, D = 128, bf16, blocks of 64, 16 selected,
window 512. Part resident-long (not in the default parts): the resident kernels alone at --long-lens (32k, 64k) on
random selections, their plan (the backward in one pass or two), and where one pass fits, the two-pass backward
forced (its time, and its gradients bitwise those of one pass). Part union (not in the default parts): the resident
kernels' union tiles (forward and backward: nsa.pallas.tpu.selected.UNION_TILES) on and off, fwd and fwd+bwd times,
the forward's useful TFLOP/s and the fraction of union tiles that took the union path, on random selections, the
probe's shared ones, and select_blocks' choice on inputs with locality along T (benchmarks.common.smooth_inputs); o
and the gradients of the two agree (relative error).

    python3 scripts/tpu_train_probe.py [--seq-lens 8192 16384] [--iters 5] [--out DIR] [--parts ... resident-long union]

Off a TPU it runs at T = 256 with HQ = 16 in interpret mode (--smoke) to prove that it runs.
"""

import argparse
import functools
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import (STANDARD, jax_inputs, random_block_indices, selection_of, smooth_inputs,  # noqa: E402
                               time_jax, useful_flops)
from nsa.pallas.tpu import selected, window  # noqa: E402

ROWS = []


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


def record(name, T, fn):
    """fn() -> dict of fields; recorded with its name, or its error."""
    row = dict(name=name, T=T)
    try:
        row.update(fn())
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        traceback.print_exc(limit=2)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def selected_fns(config, bs, S, interpret):
    """(fwd, fwd_bwd) of selected attention by its kernels: the resident ones (config None, where they fit) or the
    union ones (a Config)."""
    kw = dict(block_size=bs, scale=STANDARD.D ** -0.5, interpret=interpret, config=config)

    def fwd(q, k, v, idx):
        return selected.forward(q, k, v, idx, S, None, None, **kw)[0]

    def fwd_bwd(q, k, v, idx, do):
        o, res = selected.forward(q, k, v, idx, S, None, None, **kw)
        return selected.backward(res, do, **kw)[:3]

    return jax.jit(fwd), jax.jit(fwd_bwd)


def resident_fwd_bwd(passes, bs, S, interpret):
    """fwd_bwd of selected attention by the resident kernels, the backward in `passes` (selected.BACKWARD_PLANS)."""
    scale = STANDARD.D ** -0.5

    def fwd_bwd(q, k, v, idx, do):
        o, res = selected.forward(q, k, v, idx, S, None, None, block_size=bs, scale=scale, interpret=interpret)
        counts = jnp.full(idx.shape[:3], S, jnp.int32)
        return selected._resident_backward(q, k, v, idx, counts, None, o, res[-1], do, passes=passes, block_size=bs,
                                           scale=scale, interpret=interpret)

    return jax.jit(fwd_bwd)


def resident_long(T, hq, bs, S, iters, interpret):
    """Part resident-long at T tokens: the resident kernels' fwd and fwd+bwd times and plan on random selections;
    where the backward's one pass fits, the two-pass backward forced: its fwd+bwd time and whether its gradients
    are bitwise those of one pass."""
    q, k, v, _, do = jax_inputs(T, hq=hq)
    idx = random_block_indices(T, shape=STANDARD._replace(HQ=hq))
    plans = dict(forward=selected.resident(q, k, v, idx, bs, None, None, None, False),
                 backward=selected.resident(q, k, v, idx, bs, None, None, None, True))
    rf, rfb = selected_fns(None, bs, S, interpret)
    record("selected random resident (long)", T,
           lambda: dict(timed(rf, rfb, (q, k, v, idx), (q, k, v, idx, do), iters), plans=plans))
    one, two = selected.BACKWARD_PLANS
    if plans["backward"] == one:
        two_fb = resident_fwd_bwd(two, bs, S, interpret)

        def forced():
            g_one, g_two = rfb(q, k, v, idx, do), two_fb(q, k, v, idx, do)
            return dict(fwd_bwd_ms=1e3 * time_jax(two_fb, (q, k, v, idx, do), iters),
                        bitwise_one_pass=bool(all(np.array_equal(a, b) for a, b in zip(g_one, g_two))))

        record("selected random resident, two backward passes forced", T, forced)


def union_part(T, hq, bs, S, iters, interpret):
    """Part union at T tokens: the resident kernels with their union tiles on and off (UNION_TILES, read
    when a call is traced: each setting its own jitted functions), per selection."""
    q, k, v, _, do = jax_inputs(T, hq=hq)
    sq, sk, sv, _, sdo = smooth_inputs(T, hq=hq)
    idx_random = random_block_indices(T, shape=STANDARD._replace(HQ=hq))
    cases = (("random", (q, k, v, do), idx_random), ("shared", (q, k, v, do), shared(idx_random, bs)),
             ("local", (sq, sk, sv, sdo), selection_of("selection_local", T, sq, sk, STANDARD._replace(HQ=hq))))
    useful = useful_flops("selection", T, STANDARD._replace(HQ=hq))
    for sel_name, (q_, k_, v_, do_), idx in cases:
        idx = jnp.asarray(idx, jnp.int32)
        takes = np.asarray(selected.union_tiles(q_, k_, v_, idx, S, None, block_size=bs))
        runs = {on: union_tiles_run(on, bs, S, interpret, (q_, k_, v_, idx), do_) for on in (True, False)}
        for on, (f, fb, _, _) in runs.items():
            def timing():
                t = timed(f, fb, (q_, k_, v_, idx), (q_, k_, v_, idx, do_), iters)
                return dict(t, fwd_useful_tflops=useful / t["fwd_ms"] / 1e9,
                            union_fraction=float(takes.mean()) if on else 0.0)

            record(f"selected {sel_name} resident, union tiles {'on' if on else 'off'}", T, timing)
        (_, _, o_on, g_on), (_, _, o_off, g_off) = runs[True], runs[False]
        record(f"selected {sel_name}: union tiles on vs off (agreement)", T,
               lambda: dict(rel_o=rel(o_on, o_off), rel_grads=[rel(a, b) for a, b in zip(g_on, g_off)]))


def union_tiles_run(on, bs, S, interpret, args, do):
    """(fwd, fwd_bwd, o, grads): the resident kernels' jitted functions traced (by their first call, on args) with
    selected.UNION_TILES = on, which their later calls keep; UNION_TILES set back to True."""
    selected.UNION_TILES = on
    try:
        f, fb = selected_fns(None, bs, S, interpret)
        return f, fb, f(*args), fb(*args, do)
    finally:
        selected.UNION_TILES = True


def shared(idx, bs):
    """Every token of a block of bs tokens given the selection of the block's last token (clipped to T)."""
    T = idx.shape[1]
    src = np.minimum(np.arange(T) // bs * bs + bs - 1, T - 1)
    return idx[:, src]


def splash_window_fns(T, HQ, H, window_size, interpret, block=512):
    """(fwd, fwd_bwd) of splash attention with a local mask of window_size (key j seen by query t iff
    t - window_size < j <= t) on nsa's layout [B, T, HQ, D] (the transposes to splash's [B, HQ, T, D] inside)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    block = min(block, T)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = splash.MultiHeadMask([splash.LocalMask((T, T), (window_size - 1, 0), 0) for _ in range(HQ)])
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    heads = lambda x: jnp.transpose(x, (0, 2, 1, 3))

    def fwd(q, k, v):
        o = jax.vmap(kernel)(heads(q * q.shape[3] ** -0.5), heads(k), heads(v))
        return heads(o)

    def fwd_bwd(q, k, v, do):
        return jax.grad(lambda *a: jnp.sum(fwd(*a).astype(jnp.float32) * do.astype(jnp.float32)),
                        argnums=(0, 1, 2))(q, k, v)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def nsa_window_fns(window_size, interpret):
    kw = dict(window_size=window_size, scale=STANDARD.D ** -0.5, interpret=interpret)

    def fwd(q, k, v):
        return window.forward(q, k, v, None, None, **kw)[0]

    def fwd_bwd(q, k, v, do):
        _, res = window.forward(q, k, v, None, None, **kw)
        return window.backward(res, do, **kw)[:3]

    return jax.jit(fwd), jax.jit(fwd_bwd)


def splash_dense_fns(T, HQ, interpret, block=512):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    block = min(block, T)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = splash.MultiHeadMask([splash.CausalMask((T, T)) for _ in range(HQ)])
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    fwd = jax.jit(jax.vmap(kernel))
    fwd_bwd = jax.jit(jax.grad(lambda q, k, v, do: jnp.sum(jax.vmap(kernel)(q, k, v).astype(jnp.float32) * do),
                               argnums=(0, 1, 2)))
    return fwd, fwd_bwd


def timed(fwd, fwd_bwd, fwd_args, bwd_args, iters):
    return dict(fwd_ms=1e3 * time_jax(fwd, fwd_args, iters), fwd_bwd_ms=1e3 * time_jax(fwd_bwd, bwd_args, iters))


def grid_step_probe(steps, interpret):
    """Seconds per grid step of a kernel that copies one (8, 128) float32 block a step (BlockSpec pipelined)."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    x = jnp.zeros((steps * 8, 128), jnp.float32)
    fn = jax.jit(pl.pallas_call(kernel, grid=(steps,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                                out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                                out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret))
    return time_jax(fn, (x,), 10) / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--parts", nargs="+", default=["grid", "dense", "window", "selected"],
                        help="of grid, dense, window, selected, resident-long, union")
    parser.add_argument("--long-lens", type=int, nargs="+", default=[32768, 65536])
    args = parser.parse_args()
    on_tpu = jax.devices()[0].platform == "tpu"
    interpret = False if on_tpu else pltpu.InterpretParams()
    hq = STANDARD.HQ if on_tpu else 16
    seq_lens = args.seq_lens if on_tpu else [256]
    H, bs, S, W = STANDARD.H, STANDARD.block_size, STANDARD.blocks, STANDARD.window
    print(jax.__version__, jax.devices(), flush=True)
    if "grid" in args.parts:
        for steps in ((4096, 65536) if on_tpu else (8,)):
            record(f"grid step, {steps} steps", 0, lambda: dict(us_per_step=1e6 * grid_step_probe(steps, interpret)))
    for T in seq_lens:
        q, k, v, gates, do = jax_inputs(T, hq=hq)
        w = min(W, T)
        if "dense" in args.parts:
            heads = lambda x: jnp.transpose(x, (0, 2, 1, 3))
            f, fb = splash_dense_fns(T, hq, interpret)
            hq_args = (heads(q * STANDARD.D ** -0.5), heads(k), heads(v))
            record("dense causal splash", T, lambda: timed(f, fb, hq_args, hq_args + (heads(do),), args.iters))
        if "window" in args.parts:
            nf, nfb = nsa_window_fns(w, interpret)
            sf, sfb = splash_window_fns(T, hq, H, w, interpret)

            def check():
                got, want = sf(q, k, v), nf(q, k, v)
                gg, gw = sfb(q, k, v, do), nfb(q, k, v, do)
                return dict(rel_o=rel(got, want), rel_grads=[rel(a, b) for a, b in zip(gg, gw)])

            record("window: splash vs nsa (agreement)", T, check)
            record("window nsa flash", T, lambda: timed(nf, nfb, (q, k, v), (q, k, v, do), args.iters))
            record("window splash local", T, lambda: timed(sf, sfb, (q, k, v), (q, k, v, do), args.iters))
        if "selected" in args.parts:
            idx_random = random_block_indices(T, shape=STANDARD._replace(HQ=hq))
            shapes = selected.Shapes.of(q, k, v, block_size=bs, block_counts=S)
            union_cfg = selected.default_config(shapes, q.dtype, None)
            fits = selected.resident(q, k, v, idx_random, bs, None, None, None, True)
            for sel_name, idx in (("random", idx_random), ("shared", shared(idx_random, bs))):
                rf, rfb = selected_fns(None, bs, S, interpret)
                uf, ufb = selected_fns(union_cfg, bs, S, interpret)

                def check():
                    o_r, o_u = rf(q, k, v, idx), uf(q, k, v, idx)
                    g_r, g_u = rfb(q, k, v, idx, do), ufb(q, k, v, idx, do)
                    return dict(resident=fits, rel_o=rel(o_r, o_u), rel_grads=[rel(a, b) for a, b in zip(g_r, g_u)],
                                bitwise_repeatable=bool(all(np.array_equal(a, b) for a, b in
                                                            zip(g_r, rfb(q, k, v, idx, do)))))

                record(f"selected {sel_name}: resident vs union (agreement)", T, check)
                record(f"selected {sel_name} resident", T,
                       lambda: dict(timed(rf, rfb, (q, k, v, idx), (q, k, v, idx, do), args.iters), resident=fits))
                record(f"selected {sel_name} union", T,
                       lambda: timed(uf, ufb, (q, k, v, idx), (q, k, v, idx, do), args.iters))
    if "resident-long" in args.parts:
        for T in args.long_lens if on_tpu else [256]:
            resident_long(T, hq, bs, S, args.iters, interpret)
    if "union" in args.parts:
        for T in seq_lens:
            union_part(T, hq, bs, S, args.iters, interpret)
    with open(os.path.join(args.out, "train-probe.json"), "w") as f:
        json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0].device_kind), rows=ROWS), f, indent=1)


if __name__ == "__main__":
    main()
