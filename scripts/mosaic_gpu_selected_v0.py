"""Issue 12's first Mosaic GPU kernel: selected attention's forward, a prototype measured on the H200.

    python3 scripts/mosaic_gpu_selected_v0.py        # on the H200 (jax 0.11.2): check, then time at 8k
    python3 scripts/mosaic_gpu_selected_v0.py --export   # on any machine: lower it for cuda (jax.export)

Grid (NT, B * H), one warpgroup per program. Tile: the G query heads of TB = 64 / G consecutive tokens
of one KV head, 64 rows (wgmma's M; row j * G + g: token j, head g), q_t [B, H, NT, 64, D] copied to
SMEM once. The program walks its tile's union of selected blocks (built here in NumPy: the block starts
`union` in increasing order, their number `count`, and per block 4 bits per token, the times the token
lists it), copying each block's keys and values k[b, x : x + bs, h] to SMEM with TMA (rows past TK come
back as zeros), then S = q k^T (wgmma, [64, bs]), the mask (token j lists the block and key x + c <= its
position), log(times) added, an online softmax in float32, and acc += p v (wgmma). No pipelining yet:
each block's copies are waited for before its matmuls; it is not wired into nsa (next: the tables in
XLA shared with nsa/pallas/selected.py, a KV cache's NaN rows zeroed, double-buffered copies, dq, dk/dv).
"""

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # wgmma M


def forward_tiles(q_t, *, block_size, scale, G):
    """The kernel body for q_t [B, H, NT, 64, D] (row j * G + g: token j of the tile, head g) against k, v
    [B, TK, H, D], with the tables union, times [B, H, NT, U] int32 (times: 4 bits per token, the times it
    lists the block), count and t0 [B, H, NT]."""
    B, H, NT, R, D = q_t.shape
    TB = R // G
    BS = block_size
    dtype = q_t.dtype

    def body(q_ref, k_ref, v_ref, union_ref, count_ref, times_ref, t0_ref, o_ref, lse_ref, scoped):
        q_smem, k_smem, v_smem, o_smem, lse_smem, barriers = scoped
        i = lax.axis_index("tile")
        bh = lax.axis_index("bh")
        b, h = lax.div(bh, H), lax.rem(bh, H)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, i], q_smem, barriers.at[0])
        plgpu.barrier_wait(barriers.at[0])
        n = count_ref[b, h, i]
        t0 = t0_ref[b, h, i]
        m_i = plgpu.layout_cast(jnp.full((R,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((R,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((R, D), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def step(u, carry):
            acc, m_i, l_i = carry
            x = pl.multiple_of(union_ref[b, h, i, u], BS)
            bits = times_ref[b, h, i, u]
            plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(x, BS), h], k_smem, barriers.at[1])
            plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(x, BS), h], v_smem, barriers.at[2])
            plgpu.barrier_wait(barriers.at[1])

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk_scope, plgpu.ACC((R, BS), jnp.float32)) * scale
            row = plgpu.broadcasted_iota(jnp.int32, (R, BS), 0, layout=plgpu.Layout.WGMMA)
            col = plgpu.broadcasted_iota(jnp.int32, (R, BS), 1, layout=plgpu.Layout.WGMMA)
            j = lax.div(row, jnp.int32(G))
            times = lax.shift_right_logical(jnp.full((R, BS), bits, jnp.int32), 4 * j) & 15
            seen = (times > 0) & (x + col <= t0 + j)
            s = jnp.where(seen, s + jnp.log(jnp.maximum(times, 1).astype(jnp.float32)), -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m_i - m_use)
            p = jnp.exp(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(barriers.at[2])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_smem)
            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            return acc, m_new, l_i

        acc, m_i, l_i = lax.fori_loop(0, n, step, (acc, m_i, l_i))
        seen = l_i > 0
        o_smem[...] = (acc / lax.broadcast_in_dim(jnp.where(seen, l_i, 1.0), acc.shape, [0])).astype(dtype)
        lse_smem[...] = jnp.where(seen, m_i + jnp.log(jnp.where(seen, l_i, 1.0)), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, i])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, i])
        plgpu.wait_smem_to_gmem(0)

    def entry(*refs):
        tiling, swizzle = plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)
        smem = lambda shape, dt: plgpu.SMEM(shape, dt, transforms=(tiling, swizzle))
        pl.run_scoped(lambda *s: body(*refs, s),
                      smem((R, D), dtype), smem((BS, D), dtype), smem((BS, D), dtype), smem((R, D), dtype),
                      plgpu.SMEM((R,), jnp.float32), plgpu.Barrier(num_barriers=3))

    return entry


def run(q_t, k, v, union, count, times, t0, *, block_size, scale, G):
    B, H, NT, R, D = q_t.shape
    entry = forward_tiles(q_t, block_size=block_size, scale=scale, G=G)
    return plgpu.kernel(entry, out_type=(jax.ShapeDtypeStruct(q_t.shape, q_t.dtype),
                                         jax.ShapeDtypeStruct((B, H, NT, R), jnp.float32)),
                        grid=(NT, B * H), grid_names=("tile", "bh"))(q_t, k, v, union, count, times, t0)


def tables(idx, T, H, G, bs):
    """The kernel's tables from block_indices idx [B, T, H, S] (NumPy): union, count, times (4 bits per
    token) and t0 (each tile's first token)."""
    B, _, _, S = idx.shape
    TB = ROWS // G
    NT = T // TB
    U = TB * S
    union = np.zeros((B, H, NT, U), np.int32)
    times = np.zeros((B, H, NT, U), np.int32)
    count = np.zeros((B, H, NT), np.int32)
    for b in range(B):
        for h in range(H):
            for i in range(NT):
                toks = range(i * TB, i * TB + TB)
                blocks = sorted({int(c) for t in toks for c in idx[b, t, h] if 0 <= c <= t // bs})
                count[b, h, i] = len(blocks)
                for u, c in enumerate(blocks):
                    union[b, h, i, u] = c * bs
                    times[b, h, i, u] = sum(min(int(np.sum(idx[b, t, h] == c)) if c <= t // bs else 0, 15) << (4 * j)
                                            for j, t in enumerate(toks))
    t0 = np.broadcast_to(np.arange(NT, dtype=np.int32) * TB, (B, H, NT)).copy()
    return union, count, times, t0


def case(B, T, HQ, H, D, bs, S, seed=0):
    """Random q, k, v (bf16), block_indices with each token's current block first, the tiled q and tables."""
    G = HQ // H
    TB, NT = ROWS // G, T // (ROWS // G)
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((B, T, HQ, D), (B, T, H, D), (B, T, H, D)))
    idx = (rng.random((B, T, H, S)) * (np.arange(T)[None, :, None, None] // bs + 1)).astype(np.int32)
    idx[..., 0] = (np.arange(T) // bs)[None, :, None]
    q_t = jnp.transpose(q.reshape(B, NT, TB, H, G, D), (0, 3, 1, 2, 4, 5)).reshape(B, H, NT, ROWS, D)
    return q, k, v, idx, q_t, [jnp.asarray(x) for x in tables(idx, T, H, G, bs)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--export", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, ".")
    import nsa

    for B, T, HQ, H, D, bs, S, timed in ((1, 512, 32, 2, 128, 64, 4, False), (1, 8192, 64, 4, 128, 64, 16, True)):
        q, k, v, idx, q_t, tabs = case(B, T, HQ, H, D, bs, S)
        G, TB, NT = HQ // H, ROWS // (HQ // H), T // (ROWS // (HQ // H))
        f = jax.jit(functools.partial(run, block_size=bs, scale=D ** -0.5, G=G))
        if args.export:
            module = jax.export.export(f, platforms=["cuda"])(q_t, k, v, *tabs).mlir_module()
            print(f"T={T}: exported for cuda, {module.count('mosaic_gpu_v2')} mosaic_gpu_v2 call(s)")
            continue
        o_t, _ = f(q_t, k, v, *tabs)
        o = jnp.transpose(o_t.reshape(B, H, NT, TB, G, D), (0, 2, 3, 1, 4, 5)).reshape(B, T, HQ, D)
        ref = nsa.selected_attention(q, k, v, jnp.asarray(idx), block_size=bs, implementation="xla")
        err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ref.astype(jnp.float32))))
        print(f"T={T} G={G}: max abs error {err:.3e} against the reference (output scale "
              f"{float(jnp.max(jnp.abs(ref.astype(jnp.float32)))):.2f})", flush=True)
        if timed:
            jax.block_until_ready(f(q_t, k, v, *tabs))
            start = time.perf_counter()
            for _ in range(20):
                out = f(q_t, k, v, *tabs)
            jax.block_until_ready(out)
            ms = (time.perf_counter() - start) / 20 * 1e3
            flops = 4 * B * T * HQ * S * bs * D
            print(f"T={T}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s (useful: each token's S blocks; the "
                  f"tables are built outside the timing)", flush=True)


if __name__ == "__main__":
    main()
