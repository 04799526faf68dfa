"""Where the resident selected kernels' time goes on a TPU (issue 52), and which rewrites of their pieces pay: each
variant replaces one piece of `nsa.pallas.tpu.selected`'s resident kernels (the module's function, patched for the
variant's run only) and times selected attention's forward and forward+backward on random selections at the
standard shape (B = 1, HQ = 64, H = 4, D = 128, bf16, blocks of 64, 16 selected), on random selections or local
ones (`benchmarks.common.smooth_inputs`, selected by nsa's own select, as the benchmarks' `selection_local`).

Each selection's first row times the table the kernels read, built by XLA from the block indices alone. Variants
that compute the same thing (rewrites: a lever if faster) are checked against the kernels as they are
(relative error of o and of each gradient); ablations (a piece removed: wrong results, an upper bound on what that
piece costs) are timed only.

    python3 scripts/tpu_resident_probe.py [--seq-lens 8192] [--variants ...] [--selections random local]
                                          [--iters 5] [--out DIR]

Off a TPU it runs at T = 256 with HQ = 16 in interpret mode to prove that it runs.
"""

import argparse
import functools
import json
import os
import sys
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import (STANDARD, jax_inputs, random_block_indices, selection_of, smooth_inputs,  # noqa: E402
                               time_jax)
from nsa._plan import padded  # noqa: E402
from nsa.pallas.tpu import _common, selected  # noqa: E402

PATCHED = ("_gather", "_transposed_dot", "_seen_columns", "lax", "RESIDENT_UNROLL", "UNION_TILES", "_union_seen",
           "_union_gather", "_token_path")
ORIGINAL = {name: getattr(selected, name) for name in PATCHED if hasattr(selected, name)}


def pl_ds(start, align, size):
    """pl.ds(start, size), start marked a multiple of `align` where given."""
    return pl.ds(pl.multiple_of(start, align) if align else start, size)


def _gather_unzeroed(tab_ref, rows_at, last_at, pairs, *, slots, br, align, base=0, zeroed=None):
    """Ablation: the slots copied without zeroing the rows a token does not see (the NaN fix's cost)."""
    for s in range(slots):
        src = pl_ds(tab_ref[0, rows_at + s], align, br)
        for rows, buf in pairs:
            buf[pl_ds(base + s * br, None, br), :] = rows[src, :]


def _gather_none(tab_ref, rows_at, last_at, pairs, *, slots, br, align, base=0, zeroed=None):
    """Ablation: no gather at all (the buffers keep whatever they hold): the gather's whole cost."""


def _seen_all(tab_ref, j, *, slots, br, tokens):
    """Ablation: every gathered column seen (no per-column mask)."""
    return jnp.ones((1, slots * br), jnp.bool_)


def _token_path_simple(tab_ref, token, first, count, *, tokens, slots, unroll):
    """Rewrite where every grid step's tokens see at most one slot in part (random and local selections): the token
    loop that zeroes one slot alone, without the other loop for the steps that need every slot zeroed (the kernels'
    code a third smaller: whether their size costs time)."""
    selected._token_loop(first, count, functools.partial(token, zeroed=1), unroll)


def _union_seen_all(tab_ref, at, *, tokens, heads, slots, br):
    """Ablation: a union tile's every gathered column seen by every row (no [UT * G, UC * BR] mask built)."""
    return jnp.ones((tokens * heads, slots * br), jnp.bool_)


def _union_gather_none(tab_ref, at, pairs, *, slots, br, align):
    """Ablation: no union gather (the union buffers keep whatever they hold): its whole cost."""


def _tdot_bf16_padded(a, b, precision):
    """Rewrite: rows padded to the MXU pass in b's dtype (bf16: half the bytes transposed), then transposed."""
    rows = selected.round_up(a.shape[0], selected.MXU_ROWS)
    return _common.dot(padded(a.astype(b.dtype), 0, rows).T, padded(b, 0, rows), precision)


def _tdot_bf16(a, b, precision):
    """Rewrite: a in b's dtype transposed as it is ([G, N] -> [N, G]), G unpadded."""
    return _common.dot(a.astype(b.dtype).T, b, precision)


def _tdot_f32(a, b, precision):
    """Rewrite: a transposed in float32 as it is ([G, N] -> [N, G]), then rounded."""
    return _common.dot(a.T.astype(b.dtype), b, precision)


def _tdot_dims(a, b, precision):
    """Rewrite: a^T b as one dot_general contracting both operands' first dims (Mosaic's transposed lhs)."""
    return lax.dot_general(a.astype(b.dtype), b, (((0,), (0,)), ((), ())),
                           precision=lax.Precision.DEFAULT if precision is None else precision,
                           preferred_element_type=jnp.float32)


def _tdot_skipped(a, b, precision):
    """Ablation: no dk, dv products (zeros of their shape)."""
    return jnp.zeros((a.shape[1], b.shape[1]), jnp.float32) + a[0, 0] * 0


def _unrolled(unroll):
    """selected's `lax` with fori_loops of at most 32 steps (a tile's tokens, not `_zero`'s rows) unrolled."""
    def fori_loop(lo, hi, body, init, **kw):
        if isinstance(hi, int) and isinstance(lo, int) and hi - lo <= 32:
            kw["unroll"] = unroll
        return lax.fori_loop(lo, hi, body, init, **kw)
    return types.SimpleNamespace(**{**{n: getattr(lax, n) for n in dir(lax) if not n.startswith("__")},
                                    "fori_loop": fori_loop})


# name: (what it patches, whether it computes the same thing)
VARIANTS = {
    "base": ({}, True),
    "unroll2": ({"lax": _unrolled(2)}, True),
    "unroll4": ({"lax": _unrolled(4)}, True),
    "tdot_bf16_padded": ({"_transposed_dot": _tdot_bf16_padded}, True),
    "tdot_bf16": ({"_transposed_dot": _tdot_bf16}, True),
    "tdot_f32": ({"_transposed_dot": _tdot_f32}, True),
    "tdot_dims": ({"_transposed_dot": _tdot_dims}, True),
    "no_zeroing": ({"_gather": _gather_unzeroed}, False),
    "no_gather": ({"_gather": _gather_none}, False),
    "no_column_mask": ({"_seen_columns": _seen_all}, False),
    "no_dkdv_products": ({"_transposed_dot": _tdot_skipped}, False),
    "no_fallback": ({"_token_path": _token_path_simple}, True),
    "no_union_mask": ({"_union_seen": _union_seen_all}, False),
    "no_union_gather": ({"_union_gather": _union_gather_none}, False),
    # the tokens of the resident kernels' token loop unrolled by hand, each with its own buffers (RESIDENT_UNROLL)
    "unrolled2": ({"RESIDENT_UNROLL": 2}, True),
    "unrolled4": ({"RESIDENT_UNROLL": 4}, True),
    "unrolled1": ({"RESIDENT_UNROLL": 1}, True),
    # union tiles (UNION_TILES) off and on, the token loop unrolled or not
    "union_off": ({"UNION_TILES": False}, True),
    "union_on": ({"UNION_TILES": True}, True),
    "union_on_unrolled2": ({"UNION_TILES": True, "RESIDENT_UNROLL": 2}, True),
    "union_on_unrolled4": ({"UNION_TILES": True, "RESIDENT_UNROLL": 4}, True),
    "union_off_unrolled2": ({"UNION_TILES": False, "RESIDENT_UNROLL": 2}, True),
    "union_off_unrolled4": ({"UNION_TILES": False, "RESIDENT_UNROLL": 4}, True),
}

ROWS = []


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b ** 2)), 1e-30))


def fns(bs, S, interpret):
    kw = dict(block_size=bs, scale=STANDARD.D ** -0.5, interpret=interpret)

    def fwd(q, k, v, idx):
        return selected.forward(q, k, v, idx, S, None, None, **kw)[0]

    def fwd_bwd(q, k, v, idx, do):
        o, res = selected.forward(q, k, v, idx, S, None, None, **kw)
        return (o,) + tuple(selected.backward(res, do, **kw)[:3])

    return jax.jit(fwd), jax.jit(fwd_bwd)


def run_variant(name, T, selection, args_fwd, args_bwd, iters, interpret, want):
    patch, same = VARIANTS[name]
    row = dict(name=name, T=T, selection=selection, rewrite=same)
    if any(attr not in ORIGINAL for attr in patch):
        row["error"] = f"this tree's selected module has none of {sorted(set(patch) - set(ORIGINAL))}"
        ROWS.append(row)
        print(json.dumps(row), flush=True)
        return want
    for attr, value in patch.items():
        setattr(selected, attr, value)
    try:
        f, fb = fns(STANDARD.block_size, STANDARD.blocks, interpret)
        row["fwd_ms"] = 1e3 * time_jax(f, args_fwd, iters)
        row["fwd_bwd_ms"] = 1e3 * time_jax(fb, args_bwd, iters)
        got = fb(*args_bwd)
        if "union_tiles" in dir(selected) and getattr(selected, "UNION_TILES", False):
            q, k, v, idx = args_fwd
            row["union_fraction"] = float(np.mean(np.asarray(selected.union_tiles(
                q, k, v, idx, STANDARD.blocks, None, block_size=STANDARD.block_size))))
        if want is not None and same:
            row["rel"] = [rel(a, b) for a, b in zip(got, want)]
            row["bitwise"] = bool(all(np.array_equal(a, b) for a, b in zip(got, want)))
        if name == "base":
            want = got
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc(limit=1)
    finally:
        for attr, value in ORIGINAL.items():
            setattr(selected, attr, value)
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return want


def time_table(T, selection, q, k, v, idx, iters):
    """A row of the time XLA takes to build the resident kernels' table (`selected._step_table`, its union entries
    included: sorts) from the block indices alone, jitted: a part of the forward's time in every variant."""
    S, bs = STANDARD.blocks, STANDARD.block_size
    lay = selected._resident_layout(q, k, v, idx, bs, None)
    table = jax.jit(lambda idx: selected._step_table(idx, S, None, lay, bs))
    row = dict(name="table", T=T, selection=selection, table_ms=1e3 * time_jax(table, (idx,), iters))
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--selections", nargs="+", default=["random"], help="of random, local")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    on_tpu = jax.devices()[0].platform == "tpu"
    interpret = False if on_tpu else pltpu.InterpretParams()
    hq = STANDARD.HQ if on_tpu else 16
    print(jax.__version__, jax.devices(), flush=True)
    shape = STANDARD._replace(HQ=hq)
    for T in args.seq_lens if on_tpu else [256]:
        for selection in args.selections:
            if selection == "random":
                q, k, v, _, do = jax_inputs(T, hq=hq)
                idx = jnp.asarray(random_block_indices(T, shape=shape))
            else:
                q, k, v, _, do = smooth_inputs(T, hq=hq)
                idx = jnp.asarray(selection_of("selection_local", T, q, k, shape), jnp.int32)
            time_table(T, selection, q, k, v, idx, args.iters)
            want = None
            for name in ["base"] + [n for n in args.variants if n != "base"]:
                want = run_variant(name, T, selection, (q, k, v, idx), (q, k, v, idx, do), args.iters, interpret,
                                   want)
    with open(os.path.join(args.out, "resident-probe.json"), "w") as f:
        json.dump(dict(jax=jax.__version__, device=str(jax.devices()[0].device_kind), rows=ROWS), f, indent=1)


if __name__ == "__main__":
    main()
