"""The decode benchmark: one NSA decode step over a KV cache, against dense decode and fla's NSA.

    python benchmarks/decode.py --out benchmarks/results [--batches 1 16 64] [--contexts 8192 65536 ...]

Standard heads: HQ = 64, H = 4, D = 128, bf16, block_size 64, 16 selected blocks, window 512. Each row is one
(B, TK) cache (every sequence TK tokens long unless --ragged, which draws each length uniformly from
[TK / 2, TK]) and one implementation of the attention of one new token per sequence:

  nsa-<impl>    nsa.attention(q [B, 1, HQ, D], cache.k, cache.v, k_cmp=..., v_cmp=..., kv_lens=...) with all
                three gates: compressed attention over the cache's compressed keys, the top-16 selection,
                selected attention and the window;
  nsa-<impl>-paged  the same step over the same rows in an nsa.PagedKVCache (--paged PAGE: pages of PAGE tokens,
                each sequence's pages at random places in the pool), nsa.attention(q, cache=...);
  dense-cudnn   jax.nn.dot_product_attention over the whole cache with per-sequence lengths
  dense-xla     (key_value_seq_lengths), cuDNN's and XLA's;
  fla           fla's parallel_nsa with TQ = 1 (no window without flash-attn, no per-sequence lengths, and it
                compresses the whole cache at every call: that is its decode path).

Times are on the device: a jitted lax.fori_loop of STEPS steps, each step's query made to depend on the
previous step's output (so nothing is hoisted or overlapped, as in generation), divided by STEPS; fla's
through triton's CUDA-graph timer. Beside each time: the bytes the step must read (useful: each sequence's
visible compressed rows, its selected blocks and its window for NSA; its whole length for dense) and the
memory-bandwidth bound, those bytes at `bandwidth()`: the H200's measured copy bandwidth, elsewhere the datasheet's.
"""

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

if not __package__:  # run as a script: the repo root holds the benchmarks package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nsa
from nsa import _device
from benchmarks.common import STANDARD, measure, meta, module_versions, time_jax, write_json

B_, HQ, H, D, BS, S, WINDOW = STANDARD[:7]
# A device-to-device copy on the H200 moved 4.3 TB/s (bytes read + written; the device library's KINDS.md);
# the datasheet says 4.8. The bound below uses the measured figure there, and elsewhere the datasheet's
# (nsa._device's table: 0.819 TB/s on a TPU v5e).
COPY_BANDWIDTH = 4.3e12
STEPS = 50  # decode steps per timed loop
TRITON_CACHE_DIR = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")


def bandwidth():
    """The bytes per second the bound is drawn at on this process's default device."""
    device = jax.devices()[0]
    if device.device_kind == "NVIDIA H200":
        return COPY_BANDWIDTH
    return _device.facts("tpu" if device.platform == "tpu" else "cuda").bandwidth


def cache_arrays(B, TK, ragged, seed=0):
    """q [B, 1, HQ, D], the gates [B, 1, HQ], a cache's k, v [B, TK, H, D], k_cmp, v_cmp and lens int32 [B]."""
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (B, 1, HQ, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, TK, H, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, TK, H, D), jnp.bfloat16)
    gates = [jax.nn.sigmoid(jax.random.normal(key, (B, 1, HQ))).astype(jnp.bfloat16) for key in keys[3:6]]
    lens = np.random.default_rng(seed).integers(TK // 2, TK + 1, B) if ragged else np.full(B, TK)
    k_cmp, v_cmp = (jax.jit(lambda x: nsa.compress(x, block_size=BS))(x) for x in (k, v))
    return q, gates, k, v, k_cmp, v_cmp, jnp.asarray(lens, jnp.int32)


def paged_cache(k, v, k_cmp, v_cmp, lens, page, seed=0):
    """The cache k, v [B, TK, H, D], k_cmp, v_cmp [B, TK / BS, H, D] as an nsa.PagedKVCache of pages of `page`
    tokens: the B * TK / page pages in a random order in the pool, the page table listing each sequence's."""
    B, TK = k.shape[:2]
    if TK % page or page % BS:
        raise ValueError(f"--paged {page}: a page must divide TK = {TK} and be a multiple of block_size = {BS}")
    MP = TK // page
    order = jnp.asarray(np.random.default_rng(seed).permutation(B * MP), jnp.int32)
    pool = lambda x: jnp.zeros_like(x).reshape(B * MP, -1, *x.shape[2:]).at[order].set(
        x.reshape(B * MP, -1, *x.shape[2:]))
    return nsa.PagedKVCache(pool(k), pool(v), pool(k_cmp), pool(v_cmp), page_table=order.reshape(B, MP), lens=lens,
                            block_size=BS)


def useful_bytes(lens, sparse):
    """Bytes a step must read: per (sequence, KV head) the keys and values of its visible compressed rows, S
    selected blocks and the window (sparse), or of all its tokens (dense)."""
    row = 2 * D * 2  # a key and a value, bf16
    lens = np.asarray(lens, np.int64)
    if not sparse:
        return int(H * row * lens.sum())
    per = lens // BS + np.minimum(S * BS, lens) + np.minimum(WINDOW, lens)
    return int(H * row * per.sum())


def bounds(lens, sparse, step_us):
    """The row's bytes read, bandwidth bound and time over the bound."""
    read = useful_bytes(lens, sparse)
    bound_us = 1e6 * read / bandwidth()
    return dict(bytes_read=read, bound_us=bound_us, of_bound=step_us / bound_us)


def chained(step):
    """A jitted fn running `step(q) -> o` STEPS times, each q shifted by 0 * the previous o (a data dependency,
    so the steps run one after another and none is hoisted out of the loop)."""
    def loop(q, *args):
        def body(_, q_i):
            o = step(q_i, *args)
            return q + (o[..., :D] * 0).astype(q.dtype)

        return jax.lax.fori_loop(0, STEPS, body, q)

    return jax.jit(loop)


def nsa_step(implementation):
    def step(q, g_cmp, g_slc, g_swa, k, v, k_cmp, v_cmp, lens):
        return nsa.attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, k_cmp=k_cmp, v_cmp=v_cmp,
                             kv_lens=lens, block_counts=S, block_size=BS, window_size=WINDOW,
                             implementation=implementation)

    return step


def nsa_paged_step(implementation):
    def step(q, g_cmp, g_slc, g_swa, cache):
        return nsa.attention(q, cache=cache, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_counts=S,
                             window_size=WINDOW, implementation=implementation)

    return step


def dense_step(implementation):
    def step(q, k, v, lens):
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens, implementation=implementation)

    return step


def time_fla(B, TK, iters):
    """Seconds per fla parallel_nsa call with q [B, 1, HQ, D] over k, v [B, TK, H, D] (CUDA-graph timer)."""
    os.environ["TRITON_CACHE_DIR"] = TRITON_CACHE_DIR
    os.makedirs(TRITON_CACHE_DIR, exist_ok=True)
    import torch
    import triton
    from fla.ops.nsa import parallel_nsa

    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = make(B, 1, HQ, D), make(B, TK, H, D), make(B, TK, H, D)
    g_cmp, g_slc = torch.sigmoid(make(B, 1, HQ)), torch.sigmoid(make(B, 1, HQ))
    with torch.no_grad():
        fn = lambda: parallel_nsa(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=S, block_size=BS)
        fn()
        return triton.testing.do_bench_cudagraph(fn, rep=max(100, 5 * iters), return_mode="median") / 1e3


def rows_for(args, B, TK):
    q, gates, k, v, k_cmp, v_cmp, lens = cache_arrays(B, TK, args.ragged)
    base = dict(B=B, TK=TK, ragged=args.ragged)

    def timed(impl, sparse, seconds):
        def timings(row):
            row["step_us"] = 1e6 * seconds()
            row.update(bounds(lens, sparse, row["step_us"]))
        return measure(dict(base, impl=impl), timings)

    for impl in args.impls:
        if impl == "xla" and B * TK > args.xla_max_tokens:
            continue
        fn = chained(nsa_step(impl))
        yield timed(f"nsa-{impl}", True,
                    lambda: time_jax(fn, (q, *gates, k, v, k_cmp, v_cmp, lens), args.iters) / STEPS)
        if args.paged:
            paged, paged_fn = paged_cache(k, v, k_cmp, v_cmp, lens, args.paged), chained(nsa_paged_step(impl))
            yield timed(f"nsa-{impl}-paged", True, lambda: time_jax(paged_fn, (q, *gates, paged), args.iters) / STEPS)
    for impl in args.dense:
        fn = chained(dense_step(impl))
        yield timed(f"dense-{impl}", False, lambda: time_jax(fn, (q, k, v, lens), args.iters) / STEPS)


def fla_row(args, B, TK):
    """fla's row of (B, TK) (every sequence TK long: fla has no per-sequence lengths)."""
    def timings(row):
        row["step_us"] = 1e6 * time_fla(B, TK, args.iters)
        row.update(bounds(np.full(B, TK), True, row["step_us"]))
    return measure(dict(B=B, TK=TK, ragged=False, impl="fla (no window)"), timings)


def table(rows):
    lines = ["| B | TK | implementation | step µs | bytes read (MB) | bandwidth bound µs | × bound | speedup vs dense |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["B"], r["TK"])):
        if "error" in r:
            lines.append(f"| {r['B']} | {r['TK']} | {r['impl']} | failed: {r['error'][:80]} | | | | |")
            continue
        dense = [d["step_us"] for d in rows if d["B"] == r["B"] and d["TK"] == r["TK"]
                 and d["impl"].startswith("dense") and "error" not in d]
        speedup = f"{min(dense) / r['step_us']:.1f}x" if dense else "-"
        lines.append(f"| {r['B']} | {r['TK']} | {r['impl']} | {r['step_us']:.1f} | {r['bytes_read'] / 1e6:.1f} | "
                     f"{r['bound_us']:.1f} | {r['of_bound']:.1f} | {speedup} |")
    return "\n".join(lines)


def trace(args, configs):
    """{(B, TK): {kernel: device us per step}} of one jitted nsa step (no loop), printed and written as
    <name>-trace.json."""
    from benchmarks.trace import device_times

    result = {}
    for B, TK in configs:
        q, gates, k, v, k_cmp, v_cmp, lens = cache_arrays(B, TK, args.ragged)
        fn = jax.jit(nsa_step(args.impls[0]))
        times = device_times(fn, (q, *gates, k, v, k_cmp, v_cmp, lens), args.iters)
        result[f"B={B} TK={TK}"] = dict(sorted(times.items(), key=lambda kv: -kv[1]))
        print(f"B={B} TK={TK}: {sum(times.values()):.1f} us of device time in {len(times)} kinds of event; "
              f"wall {1e6 * time_jax(fn, (q, *gates, k, v, k_cmp, v_cmp, lens), args.iters):.1f} us")
        for name, us in list(result[f"B={B} TK={TK}"].items())[:25]:
            print(f"  {us:8.1f} us  {name[:110]}")
    with open(f"{args.out}/{args.name}-trace.json", "w") as f:
        json.dump(dict(meta=meta(STANDARD), traces=result), f, indent=1)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--long", type=int, nargs="*", default=[524288], help="contexts run at B = 1 only")
    parser.add_argument("--impls", nargs="*", default=["triton", "xla"], help="nsa implementations to time")
    parser.add_argument("--dense", nargs="*", default=["cudnn", "xla"], help="dense implementations to time")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--ragged", action="store_true", help="sequence lengths drawn from [TK / 2, TK]")
    parser.add_argument("--paged", type=int, default=0, metavar="PAGE",
                        help="also time each nsa implementation over a paged cache of pages of PAGE tokens")
    parser.add_argument("--xla-max-tokens", type=int, default=1 << 17, help="B * TK above which nsa-xla is skipped")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--name", default="decode", help="the results' file name (without .json)")
    parser.add_argument("--trace", action="store_true",
                        help="instead: each kernel's device time in one step of nsa-<impls[0]>, from a profiler trace")
    args = parser.parse_args(argv)
    configs = [(B, TK) for B in args.batches for TK in args.contexts] + [(1, TK) for TK in args.long]
    if args.trace:
        return trace(args, configs)
    rows = []
    for B, TK in configs:
        for row in rows_for(args, B, TK):
            rows.append(row)
            print(json.dumps(row), flush=True)
    for B, TK in configs if not (args.no_fla or args.ragged) else []:  # last: fla autotunes each shape
        rows.append(fla_row(args, B, TK))
        print(json.dumps(rows[-1]), flush=True)
    info = meta(STANDARD, steps_per_loop=STEPS, bandwidth=bandwidth(),
                **module_versions(("triton", "torch", "fla", "jax_triton")))
    write_json(f"{args.out}/{args.name}.json", info, rows)
    print(json.dumps(info))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
