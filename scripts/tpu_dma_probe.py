"""Which DMA reads a decode step's selected blocks straight from a KV cache on a TPU: a probe, run on the chip.

A decode step (T = 1) reads, for each sequence b and KV head h, S blocks of block_size rows from the cache k
[B, TK, H, D] (bf16). Today the Pallas TPU forward gathers those rows in XLA first (one gather index a row), which
took a third of a step on a TPU v5e; a one-slice-a-block XLA gather made XLA relay out the whole cache. This
probe tries kernels that copy the blocks from the cache in HBM themselves (every copy of a step in flight at
once, then summed so that nothing is optimized away), and for each says whether Mosaic compiles it, whether it
reads the right rows, its time against the bytes it must read, and whether the compiled program copies the
cache (an XLA relayout ahead of the kernel):
  one-head   grid (B, H): k.at[b, rows, h] ([BS, D]: one head of the tiled (H, D) minor dims);
  all-heads  grid (B,): k.at[b, rows] ([BS, H, D]: whole tiles), then head h's rows in VMEM;
  lanes      grid (B, H): k reshaped (in XLA) to [B, TK, H * D], then k.at[b, rows, h * D:(h + 1) * D].
  python3 scripts/tpu_dma_probe.py [--interpret]   (interpret: the CPU, to check the probe itself)

--heads: how a kernel that holds a block's rows of every head, [BS, H, D] in VMEM, best attends one head's G query
rows to them (grid (B,), every head's S blocks copied at once, then each block's p @ v summed, p = exp(s / 100)):
  extract      head h's rows taken out of the buffer (a switch of strided loads, what selected.py's _own_head does),
               then q_h [G, D] against them;
  interleaved  the buffer read as [BS * H, D] (row c * H + j: token c, head j) and every head's query rows
               [H * G, D] against all of it, the logits of other heads' rows masked: 4x the MXU work, no
               extraction.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import time_jax  # noqa: E402

STEPS = 20  # calls per timed loop


def _all_copied(copies):
    """Starts every copy, then waits for each: all of them in flight at once."""
    for c in copies:
        c.start()
    for c in copies:
        c.wait()


def _per_head(x, starts, bs, D, interpret, source):
    """Grid (B, H): the S blocks of KV head h copied from x in HBM, source(x_hbm, b, h, rows) each (rows: the
    block's pl.ds), into [S, BS, D] and summed: [B, H, BS, D] float32."""
    B, H, S = starts.shape

    def kernel(starts_ref, x_hbm, o_ref, buf, sems):
        b, h = pl.program_id(0), pl.program_id(1)
        _all_copied([pltpu.make_async_copy(
            source(x_hbm, b, h, pl.ds(pl.multiple_of(starts_ref[b, h, s], bs), bs)), buf.at[s], sems.at[s])
            for s in range(S)])
        o_ref[...] = jnp.sum(buf[...].astype(jnp.float32), axis=0)

    return pl.pallas_call(
        kernel, grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B, H), in_specs=[pl.BlockSpec(memory_space=pltpu.HBM)],
            out_specs=pl.BlockSpec((None, None, bs, D), lambda b, h, st: (b, h, 0, 0)),
            scratch_shapes=[pltpu.VMEM((S, bs, D), x.dtype), pltpu.SemaphoreType.DMA((S,))]),
        out_shape=jax.ShapeDtypeStruct((B, H, bs, D), jnp.float32), interpret=interpret)(starts, x)


def one_head(k, starts, bs, interpret):
    return _per_head(k, starts, bs, k.shape[3], interpret, lambda k_hbm, b, h, rows: k_hbm.at[b, rows, h])


def all_heads(k, starts, bs, interpret):
    B, TK, H, D = k.shape
    S = starts.shape[2]

    def kernel(starts_ref, k_hbm, o_ref, buf, sems):
        b = pl.program_id(0)
        for h in range(H):
            _all_copied([pltpu.make_async_copy(k_hbm.at[b, pl.ds(pl.multiple_of(starts_ref[b, h, s], bs), bs)],
                                               buf.at[s], sems.at[s]) for s in range(S)])
            o_ref[h] = jnp.sum(buf[:, :, h, :].astype(jnp.float32), axis=0)

    return pl.pallas_call(
        kernel, grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B,), in_specs=[pl.BlockSpec(memory_space=pltpu.HBM)],
            out_specs=pl.BlockSpec((None, H, bs, D), lambda b, st: (b, 0, 0, 0)),
            scratch_shapes=[pltpu.VMEM((S, bs, H, D), k.dtype), pltpu.SemaphoreType.DMA((S,))]),
        out_shape=jax.ShapeDtypeStruct((B, H, bs, D), jnp.float32), interpret=interpret)(starts, k)


def lanes(k, starts, bs, interpret):
    B, TK, H, D = k.shape
    return _per_head(k.reshape(B, TK, H * D), starts, bs, D, interpret,
                     lambda k_hbm, b, h, rows: k_hbm.at[b, rows, pl.ds(pl.multiple_of(h * D, D), D)])


def expected(k, starts, bs):
    """[B, H, BS, D] float32: sum over s of k[b, starts[b, h, s] + i, h]."""
    rows = starts[..., None] + jnp.arange(bs)  # [B, H, S, BS]
    b = jnp.arange(k.shape[0])[:, None, None, None]
    h = jnp.arange(k.shape[2])[None, :, None, None]
    return k[b, rows, h].astype(jnp.float32).sum(axis=2)


def copies_cache(fn, k, starts):
    """The compiled program's ops (other than parameters) that make an array of the cache's size."""
    text = jax.jit(fn).lower(k, starts).compile().as_text()
    size = "%d,%d,%d,%d" % k.shape
    flat = "%d,%d,%d" % (k.shape[0], k.shape[1], k.shape[2] * k.shape[3])
    return [line.strip()[:160] for line in text.splitlines()
            if ("[" + size + "]" in line or "[" + flat + "]" in line) and "parameter(" not in line
            and "ROOT" not in line and "custom-call" not in line
            and not line.lstrip().startswith(("HloModule", "ENTRY"))]  # the signatures name the cache too


def _heads_kernel(how, G, S, bs):
    """The --heads kernel body: `how` in ("extract", "interleaved")."""
    def kernel(starts_ref, q_ref, k_hbm, o_ref, buf, sems, acc):
        b = pl.program_id(0)
        H = buf.shape[2]
        _all_copied([pltpu.make_async_copy(k_hbm.at[b, pl.ds(pl.multiple_of(starts_ref[b, u // S, u % S], bs), bs)],
                                           buf.at[u], sems.at[u]) for u in range(H * S)])
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

        def block(u, carry):
            h = u // S
            if how == "extract":
                k_h = lax.switch(h, [lambda j=j: buf[u, :, j, :] for j in range(H)])  # [BS, D]
                rows = pl.ds(pl.multiple_of(h * G, G), G)
                p = jnp.exp(lax.dot_general(q_ref[rows, :], k_h, (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.float32) / 100)
                acc[rows, :] += jnp.dot(p.astype(k_h.dtype), k_h, preferred_element_type=jnp.float32)
            else:
                k2 = buf[u].reshape(bs * H, buf.shape[3])  # row c * H + j
                s = lax.dot_general(q_ref[...], k2, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                row = lax.broadcasted_iota(jnp.int32, s.shape, 0) // G
                col = lax.broadcasted_iota(jnp.int32, s.shape, 1) % H
                p = jnp.where((row == h) & (col == h), jnp.exp(s / 100), 0.0)
                acc[...] += jnp.dot(p.astype(k2.dtype), k2, preferred_element_type=jnp.float32)
            return carry

        lax.fori_loop(0, H * S, block, 0)
        o_ref[...] = acc[...]

    return kernel


def heads(k, q, starts, bs, interpret, how):
    """[B, H * G, D] float32: for each sequence b, sum over its blocks (h, s) of p @ k_h, p = exp(q_h k_h^T / 100)."""
    B, TK, H, D = k.shape
    S, R = starts.shape[2], q.shape[1]
    return pl.pallas_call(
        _heads_kernel(how, R // H, S, bs), grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B,),
            in_specs=[pl.BlockSpec((None, R, D), lambda b, st: (b, 0, 0)), pl.BlockSpec(memory_space=pltpu.HBM)],
            out_specs=pl.BlockSpec((None, R, D), lambda b, st: (b, 0, 0)),
            scratch_shapes=[pltpu.VMEM((H * S, bs, H, D), k.dtype), pltpu.SemaphoreType.DMA((H * S,)),
                            pltpu.VMEM((R, D), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((B, R, D), jnp.float32), interpret=interpret)(starts, q, k)


def heads_expected(k, q, starts, bs):
    B, TK, H, D = k.shape
    rows = starts[..., None] + jnp.arange(bs)  # [B, H, S, BS]
    b = jnp.arange(B)[:, None, None, None]
    h = jnp.arange(H)[None, :, None, None]
    blocks = k[b, rows, h].astype(jnp.float32)  # [B, H, S, BS, D]
    qh = q.astype(jnp.float32).reshape(B, H, -1, D)  # [B, H, G, D]
    p = jnp.exp(jnp.einsum("bhgd,bhscd->bhsgc", qh, blocks) / 100).astype(k.dtype).astype(jnp.float32)
    return jnp.einsum("bhsgc,bhscd->bhgd", p, blocks).reshape(B, -1, D)


def heads_main(k, starts, BS, args):
    """--heads: extract against interleaved, each checked against heads_expected and timed."""
    B, TK, H, D = k.shape
    q = jax.random.normal(jax.random.key(2), (B, H * 16, D), jnp.float32).astype(jnp.bfloat16)
    want = heads_expected(k, q, starts, BS)
    for how in ("extract", "interleaved"):
        fn = jax.jit(lambda k, q, s, how=how: heads(k, q, s, BS, args.interpret, how))
        try:
            got = jax.block_until_ready(fn(k, q, starts))
        except Exception as e:  # noqa: BLE001: a probe reports what Mosaic refuses
            print(f"heads {how}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        loop = jax.jit(lambda k, q, s, how=how: lax.fori_loop(
            0, STEPS, lambda i, acc: acc + heads(k, q, (s + i * BS) % TK, BS, args.interpret, how),
            jnp.zeros_like(want)))
        us = time_jax(loop, (k, q, starts), args.iters) * 1e6 / STEPS
        blocks = B * H * starts.shape[2]
        print(f"heads {how}: relative max err {err:.3g}; {us:.1f} us a call, {us / blocks * 1e3:.0f} ns a "
              f"(sequence, head, block)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--heads", action="store_true", help="the extract/interleaved probe alone")
    args = parser.parse_args()
    B, TK, H, D, BS, S = args.batch, args.context, 4, 128, 64, 16
    if args.interpret:
        B, TK = 2, 1024
    print("jax", jax.__version__, jax.devices())
    k = jax.random.normal(jax.random.key(0), (B, TK, H, D), jnp.float32).astype(jnp.bfloat16)
    starts = jax.random.randint(jax.random.key(1), (B, H, S), 0, TK // BS, jnp.int32) * BS
    if args.heads:
        return heads_main(k, starts, BS, args)
    want = expected(k, starts, BS)
    ideal = B * H * S * BS * D * 2
    for name, impl in (("one-head", one_head), ("all-heads", all_heads), ("lanes", lanes)):
        fn = jax.jit(lambda k, s, impl=impl: impl(k, s, BS, args.interpret))
        try:
            got = jax.block_until_ready(fn(k, starts))
        except Exception as e:  # noqa: BLE001: a probe reports what Mosaic refuses
            print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        err = float(jnp.max(jnp.abs(got - want)))
        copies = [] if args.interpret else copies_cache(fn, k, starts)
        loop = jax.jit(lambda k, s, impl=impl: lax.fori_loop(  # STEPS calls, each on other blocks
            0, STEPS, lambda i, acc: acc + impl(k, (s + i * BS) % TK, BS, args.interpret), jnp.zeros_like(want)))
        us = time_jax(loop, (k, starts), args.iters) * 1e6 / STEPS
        print(f"{name}: max err {err:.3g}; {us:.1f} us (the {ideal / 1e6:.1f} MB it must read: "
              f"{ideal / us / 1e6:.3f} TB/s); cache-size ops in the compiled program: {len(copies)}")
        for line in copies[:4]:
            print("   ", line)


if __name__ == "__main__":
    main()
