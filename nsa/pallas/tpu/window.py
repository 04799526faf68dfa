"""Sliding-window attention on TPUs: the resident kernels below where they apply (`resident`: training, G query
heads per KV head a multiple of the sublanes, k and v within VMEM), else jax's own splash attention kernels where
they apply (`by_splash`), else the Pallas TPU flash kernels of nsa/pallas/tpu/_flash.py.

Query t, at key row p (t itself, or kv_lens[b] - T + t at the end of a KV cache's sequence b), sees the key
rows [max(sequence start, p - window_size + 1), p]; signatures and residuals are those of
nsa.reference.window. `interpret` (False: Mosaic, or a pltpu.InterpretParams) and `config` (a _flash.Config;
None: its default_config, or splash where it applies) go to the kernels.

Splash attention (jax.experimental.pallas.ops.tpu.splash_attention, run through nsa/pallas/tpu/_splash.py: its
layout, tiles and backward): without a KV cache the window is a local mask of the [T, T] logits (key j seen by
query t iff t - window_size < j <= t), packed sequences are its segment ids (one per sequence of cu_seqlens: no key
crosses a boundary), and grouped heads its MHA kernel with H KV heads. On a TPU v5e it ran 4.2x faster than the
flash kernels here, forward and backward (2026-12-06, 8k tokens, HQ = 64, H = 4, D = 128, bf16, window 512: 3.9 /
12.2 ms against 17.1 / 50.8; benchmarks/results/tpu-train/), its backward then splash's own gradient of a forward
run again; the backward now takes the forward's o and lse instead (`_splash.backward`; in
benchmarks/tpu.py the same day: 12.51 ms, splash's own under the same mask 11.04 in that run).
`by_splash` takes it for bfloat16 and float32 heads of whole lanes (Dk, Dv multiples of 128), window_size >= 1, a
static batch (folded into the heads), no KV cache and no Config (a Config sets the flash kernels' tiles). T is
padded to a multiple of 128 (the padded keys come after every real query, the padded queries are cut and get a
zero cotangent).

The flash kernels take the rest (KV caches, float16, other heads, explicit tiles). A query sees at most W key
rows (W = min(window_size, TK), TK = k's rows) and a key row is seen by at most W queries: the spans that size
their grids. With a KV cache longer than the L = T + W - 1 rows the T queries' windows span (a decode step, a
short chunk), k and v are first cut to those rows of each batch row (`nsa._plan.window_keys`: the kernels never
see, and XLA never copies or relays out, the rest of the cache); the backward scatters dk and dv back.
"""

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nsa._device import facts
from nsa._plan import kernel_delta, padded, window_keys, window_uncut
from nsa._varlen import cdiv, round_up, window_key_range
from nsa.pallas.tpu import _flash, _splash, selected
from nsa.pallas.tpu._common import dot, lane_padded, lanes, out_struct, params, sublanes


def by_splash(q, v, kv_lens, window_size, config):
    """Whether the window of q [B, T, HQ, Dk] over v [B, TK, H, Dv] runs splash attention (module docstring)."""
    return config is None and kv_lens is None and int(window_size) >= 1 and _splash.takes(q, v)


def forward(q, k, v, cu_seqlens, kv_lens=None, *, window_size, scale, interpret=False, config=None):
    """Returns o [B, T, HQ, Dv] and the residuals (inputs, o, lse [B, T, HQ]); k, v [B, TK, H, D], kv_lens
    None (TK = T) or int32 [B]."""
    plan = resident(q, k, v, kv_lens, window_size, config, backward=False)
    if plan is not None:
        o, lse = _resident_forward(q, k, v, cu_seqlens, plan[0], window_size=window_size, scale=scale,
                                   interpret=interpret)
        return o, (q, k, v, cu_seqlens, kv_lens, o, lse)
    if by_splash(q, v, kv_lens, window_size, config):
        o, lse = _splash.forward(_local_mask(window_size), q, k, v, _segments(cu_seqlens, q.shape[1]), scale=scale,
                                 interpret=interpret)
        return o, (q, k, v, cu_seqlens, kv_lens, o, lse)
    k_seen, v_seen, lo, hi, span, _ = window_keys(q, k, v, cu_seqlens, kv_lens, window_size)
    o, lse = _flash.attend(q, k_seen, v_seen, lo, hi, scale=scale, key_span=span, interpret=interpret,
                           config=config, name="window")
    return o, (q, k, v, cu_seqlens, kv_lens, o, lse)


def backward(residuals, do, *, window_size, scale, interpret=False, config=None):
    """Gradients (dq, dk, dv, None, None)."""
    q, k, v, cu_seqlens, kv_lens, o, lse = residuals
    plan = resident(q, k, v, kv_lens, window_size, config, backward=True)
    if plan is not None:
        return (*_resident_backward(q, k, v, cu_seqlens, o, lse, do, *plan, window_size=window_size, scale=scale,
                                    interpret=interpret), None, None)
    if by_splash(q, v, kv_lens, window_size, config):
        dq, dk, dv = _splash.backward(_local_mask(window_size), q, k, v, _segments(cu_seqlens, q.shape[1]), o, lse,
                                      do, scale=scale, interpret=interpret)
        return dq, dk, dv, None, None
    k_seen, v_seen, lo, hi, span, start = window_keys(q, k, v, cu_seqlens, kv_lens, window_size)
    dq, dk, dv = _flash.attend_backward(q, k_seen, v_seen, lo, hi, o, lse, do, scale=scale, key_span=span,
                                        query_span=span, interpret=interpret, config=config, name="window")
    return (dq, *window_uncut(k, v, dk, dv, start), None, None)


def _local_mask(window_size):
    """The window as splash's mask of a padded shape [TP, TP]: key j seen by query t iff t - window_size < j <= t."""
    return lambda shape: _splash.splash.LocalMask(shape, (int(window_size) - 1, 0), 0)


def _segments(cu_seqlens, T):
    """Packed sequences (cu_seqlens int [N + 1], B = 1) as splash's segment ids of the T queries and keys padded
    to whole lanes: token t's sequence, the padded tokens one after the last; None without cu_seqlens."""
    if cu_seqlens is None:
        return None
    TP = _splash.padded_rows(T)
    ids = jnp.searchsorted(cu_seqlens.astype(jnp.int32), jnp.arange(TP, dtype=jnp.int32), side="right") - 1
    ids = jnp.where(jnp.arange(TP) < T, ids, cu_seqlens.shape[0]).astype(jnp.int32)
    return _splash.splash.SegmentIds(q=ids, kv=ids)


# Resident kernels (training: no KV cache, no Config). A grid step owns TB consecutive tokens of one KV head, their G
# query heads stacked into R = TB * G MXU rows (token j's at j * G, as selected attention's union tiles), and attends
# them to the contiguous key rows [t0 + TB - SPAN, t0 + TB) (t0 = i * TB, SPAN = W - 1 + TB rounded up to whole lanes:
# every key any of its tokens sees) of the (b, h)'s k and v, held in VMEM for the whole grid row (copied in at its
# first step, as the resident selected kernels do), k and v zero-padded in front by PAD = SPAN - TB rows so that
# every step's rows are a slice [i * TB, i * TB + SPAN) aligned to TB. One [R, SPAN] softmax a step: at the standard
# shape (G = 16, TB = 16, W = 512) 256 x 640, 80% of it seen (splash's blocks of 512 against a 512-token window see
# half of theirs). The backward recomputes p from lse and adds each step's dk, dv into float32 sums resident like k
# and v, copied out at the row's last step (`selected._row_end`); no atomics, a fixed order: bitwise repeatable.
# Where one pass does not fit (64k tokens at the standard shape on a v5e), two, as selected attention's: (dq, dk),
# then (dv) holding k and dv alone, bitwise the same; none at 128k (splash then runs the backward, from the same o
# and lse).
# A non-finite key or value row inside a step's span that one of its tokens does not see (a later token of the
# tile, or another packed sequence's row) reaches that token as 0 * NaN, as in splash's blocks (training inputs are
# finite; the KV caches, whose rows past a sequence may hold anything, never take these kernels).
# Layouts: q, do, o, dq in nsa's own [B, T, HQ, D] as [B, Tp, H, G, Dp] (`selected._token_rows`); lse and delta
# float32 lane rows [B, H, 1, Tp * G] (`selected._lane_rows`: a [.., G, 1] form takes 128 lanes a value on the TPU, 2
# GiB each at 64k, and a 0.43 ms copy at 8k); the table (SMEM, a row per step) the first and last column each token
# sees, from `nsa._varlen.window_key_range` (packed sequences: a sequence's start bounds its window), a padded token
# none.

RESIDENT_WINDOW_TOKENS = 16  # TB: the tokens of a step (R = TB * G rows)
RESIDENT_WINDOW = True  # False: the window runs splash attention where it applies


class ResidentLayout(NamedTuple):
    """The resident kernels' shapes (module comment above): batch, tokens and their padded count, KV heads, query
    heads per KV head, tokens per step and steps, padded head dims, the key rows a step reads and the zero rows in
    front of k and v."""

    B: int
    T: int
    H: int
    G: int
    tb: int
    nt: int
    dkp: int
    dvp: int
    span: int
    pad: int


def _resident_layout(q, k, v, window_size):
    B, T, HQ, _ = q.shape
    H = k.shape[2]
    tb = RESIDENT_WINDOW_TOKENS
    span = round_up(min(int(window_size), T) - 1 + tb, lanes())
    return ResidentLayout(B, T, H, HQ // H, tb, cdiv(T, tb), lane_padded(q.shape[3]), lane_padded(v.shape[3]), span,
                          span - tb)


def _resident_bytes(lay, dtype, outputs):
    """VMEM a step of a pass computing `outputs` (selected.FORWARD, or some of dq, dk, dv) holds: k (and v where the
    pass reads it) and the float32 sums of dk, dv it computes, resident; its tiles through BlockSpecs, double-buffered
    (q, o, lse; or q, do, lse, delta and dq where computed); the [R, SPAN] float32 logits a few times over."""
    rows = lay.pad + lay.nt * lay.tb
    size = jnp.dtype(dtype).itemsize
    dp = {"k": lay.dkp, "v": lay.dvp}
    keys = rows * sum(dp[x] * size for x in (("k", "v") if selected._reads_v(outputs) else ("k",)))
    keys += rows * sum(dp[g[1]] * 4 for g in ("dk", "dv") if g in outputs)
    tiles = [(lay.dkp, dtype), (lay.dvp, dtype)] + ([(lay.dkp, dtype)] if "dq" in outputs else [])
    lane_rows = selected._lane_row_bytes(lay, 1 if outputs == selected.FORWARD else 2)  # lse (and delta)
    return (keys + 2 * (sum(selected._tile_bytes(lay, d, dt) for d, dt in tiles) + lane_rows)
            + 4 * lay.tb * lay.G * lay.span * 4)


def resident(q, k, v, kv_lens, window_size, config, backward):
    """(ResidentLayout, passes) of the window of q [B, T, HQ, Dk] over k, v [B, T, H, D] when the resident kernels run
    it (RESIDENT_WINDOW; no KV cache or Config; window_size >= 1; bfloat16 or float32; G a multiple of the sublanes of
    q's dtype, so that a token's G rows are whole sublane tiles), else None; passes by selected.resident_plan on
    `_resident_bytes`: (FORWARD,), or the first of selected.BACKWARD_PLANS whose every pass fits within
    selected.RESIDENT_SHARE of the chip's VMEM (at the standard shape on a TPU v5e one pass to 32k tokens, two at
    64k)."""
    if not RESIDENT_WINDOW or config is not None or kv_lens is not None or int(window_size) < 1:
        return None
    if (q.shape[2] // k.shape[2]) % sublanes(q.dtype) or not isinstance(q.shape[0], int):
        return None
    if jnp.dtype(q.dtype) not in _splash.SPLASH_DTYPES:  # bfloat16 and float32, as splash (float16: the flash kernels)
        return None
    lay = _resident_layout(q, k, v, window_size)
    passes = selected.resident_plan(lay, k.dtype, backward, facts("tpu").vmem, _resident_bytes)
    return None if passes is None else (lay, passes)


def _resident_keys(x, lay, dp):
    """k or v [B, T, H, D] -> [B, H, PAD + Tp, dp]: PAD zero rows in front, T padded to Tp, D to dp."""
    x = jnp.transpose(padded(x, 3, dp), (0, 2, 1, 3))
    return jnp.pad(x, [(0, 0), (0, 0), (lay.pad, lay.nt * lay.tb - lay.T), (0, 0)])


def _resident_table(lay, window_size, cu_seqlens):
    """int32 [NT, 1, 2 * TB]: per step, the first then the last column (of its SPAN key rows) each token sees; a
    padded token sees none (first SPAN, last -1)."""
    lo, hi = window_key_range(lay.T, window_size, cu_seqlens)
    t = jnp.arange(lay.nt * lay.tb, dtype=jnp.int32)
    base = (t // lay.tb) * lay.tb - lay.pad  # the key row of each token's step's column 0
    real = t < lay.T
    first = jnp.where(real, padded(lo.reshape(-1), 0, t.shape[0]) - base, lay.span)
    last = jnp.where(real, padded(hi.reshape(-1), 0, t.shape[0]) - base, -1)
    return jnp.concatenate([first.reshape(lay.nt, 1, lay.tb), last.reshape(lay.nt, 1, lay.tb)], axis=2)


def _resident_seen(tab_ref, *, tokens, heads, span):
    """bool [TB * G, SPAN]: row j * G + g sees column c iff first_j <= c <= last_j (the step's table row)."""
    bounds = [jnp.concatenate([jnp.full((heads, span), tab_ref[0, at + j], jnp.int32) for j in range(tokens)])
              for at in (0, tokens)]
    col = lax.broadcasted_iota(jnp.int32, bounds[0].shape, 1)
    return (col >= bounds[0]) & (col <= bounds[1])


def _resident_keys_copies(pairs, sems):
    """The copies of the (b, h)'s rows of each (HBM source [B, H, rows, Dp], VMEM destination) pair, a semaphore
    each."""
    b, h = pl.program_id(0), pl.program_id(1)
    return [pltpu.make_async_copy(src.at[b, h], dst, sems.at[n]) for n, (src, dst) in enumerate(pairs)]


def _resident_fwd_kernel(tab_ref, q_ref, k_hbm, v_hbm, o_ref, lse_ref, k_ref, v_ref, sems, *, span, scale, precision):
    """Grid (B, H, NT), a step TB tokens: q_ref (TB, G, Dkp) stacked into [R, Dkp] against k_ref, v_ref's rows
    [i * TB, i * TB + SPAN) (resident [PAD + Tp, Dp]: `selected._row_start`); o_ref (TB, G, Dvp), lse_ref (1, R)
    float32, a lane row (`selected._lane_rows`)."""
    selected._row_start(_resident_keys_copies([(k_hbm, k_ref), (v_hbm, v_ref)], sems), [])
    tokens, heads = q_ref.shape[:2]
    rows = pl.ds(pl.multiple_of(pl.program_id(2) * tokens, tokens), span)
    s = dot(selected._stacked(q_ref, 0, tokens), k_ref[rows, :], precision, transpose_b=True) * scale
    o, lse = selected._softmax_rows(s, _resident_seen(tab_ref, tokens=tokens, heads=heads, span=span), v_ref[rows, :],
                                    precision)
    selected._unstack(o_ref, 0, o)
    lse_ref[...] = selected._lane_row(lse)


def _resident_bwd_kernel(tab_ref, q_ref, do_ref, lse_ref, delta_ref, k_hbm, v_hbm, *refs, outputs, span, scale,
                         precision):
    """Grid (B, H, NT), in order along a (b, h)'s row: one pass of the backward computing `outputs` (some of dq, dk,
    dv), the forward's step again from lse (`selected._gradients`): q_ref, do_ref (TB, G, Dp) stacked into [R, Dp],
    lse_ref, delta_ref (1, R) float32 lane rows (`selected._lane_rows`) turned into [R, 1] columns. refs: the outputs
    (dq_ref (TB, G, Dkp) its own tile; dk, dv [B, H, PAD + Tp, Dp] float32 in HBM, dk unscaled), the resident k (and v
    where the pass reads it), the float32 sums of dk, dv it computes (a step adds its [SPAN, Dp] at its rows; the row's
    last step copies them out), the DMA semaphores."""
    names = ("k", "v") if selected._reads_v(outputs) else ("k",)
    out = dict(zip(outputs, refs))
    sums = {g: ref for g, ref in zip((g for g in ("dk", "dv") if g in outputs), refs[len(outputs) + len(names):])}
    keys = dict(zip(names, refs[len(outputs):]))
    sems = refs[-1]
    b, h = pl.program_id(0), pl.program_id(1)
    hbm = {"k": k_hbm, "v": v_hbm}
    selected._row_start(_resident_keys_copies([(hbm[x], keys[x]) for x in names], sems), list(sums.values()))
    tokens, heads = q_ref.shape[:2]
    rows = pl.ds(pl.multiple_of(pl.program_id(2) * tokens, tokens), span)
    stacked = [selected._stacked(x, 0, tokens) for x in (q_ref, do_ref)] + [
        selected._lane_column(x) for x in (lse_ref, delta_ref)]
    v = keys["v"][rows, :] if "v" in keys else None
    dq, grads = selected._gradients(*stacked, keys["k"][rows, :], v,
                                    _resident_seen(tab_ref, tokens=tokens, heads=heads, span=span),
                                    outputs=outputs, scale=scale, precision=precision)
    if dq is not None:
        selected._unstack(out["dq"], 0, dq)
    for g, ref in sums.items():
        ref[rows, :] += grads[g]
    selected._row_end([pltpu.make_async_copy(ref, out[g].at[b, h], sems.at[n]) for n, (g, ref) in
                       enumerate(sums.items())])


def _resident_call(kernel, lay, table, tiled, k_rows, v_rows, out_shapes, scratch, *, outputs, q, scale, interpret,
                   name):
    """pallas_call of a resident kernel on the grid (B, H, NT), NT "arbitrary" (a row's steps in order): the table
    row (SMEM), the tiled inputs [B, Tp, H, G, .] (TB tokens of KV head h a step), k and v in HBM, `out_shapes` (of
    `outputs`) tiled likewise or 4-d in HBM (dk, dv), `scratch` [(shape, dtype)] and two DMA semaphores."""
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)

    def tile_spec(shape):  # token rows [B, Tp, H, G, .]: (TB, G, .); lane rows [B, H, 1, Tp * G]: (1, TB * G)
        if selected._is_lane_rows(shape):
            return pl.BlockSpec((None, None, 1, lay.tb * lay.G), lambda b, h, i: (b, h, 0, i))
        return pl.BlockSpec((None, lay.tb, None) + shape[3:], lambda b, h, i: (b, i, h) + (0,) * (len(shape) - 3))

    semantics = ("parallel", "parallel", "arbitrary")
    need = _resident_bytes(lay, k_rows.dtype, outputs) + selected.RESIDENT_MARGIN
    compiler = pltpu.CompilerParams(dimension_semantics=semantics,
                                    vmem_limit_bytes=int(min(facts("tpu").vmem, max(need, facts("tpu").scoped_vmem))))
    _, dots = params(q, interpret, semantics)
    return pl.pallas_call(
        functools.partial(kernel, span=lay.span, scale=float(scale), **dots),
        grid=(lay.B, lay.H, lay.nt),
        in_specs=[pl.BlockSpec((None, 1, 2 * lay.tb), lambda b, h, i: (i, 0, 0), memory_space=pltpu.SMEM)]
        + [tile_spec(x.shape) for x in tiled] + [hbm, hbm],
        out_specs=[hbm if len(o.shape) == 4 and not selected._is_lane_rows(o.shape) else tile_spec(o.shape)
                   for o in out_shapes],
        out_shape=out_shapes,
        scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in scratch] + [pltpu.SemaphoreType.DMA((2,))],
        name=name, compiler_params=compiler, interpret=interpret,
    )(table, *tiled, k_rows, v_rows)


def _resident_forward(q, k, v, cu_seqlens, lay, *, window_size, scale, interpret):
    """o [B, T, HQ, Dv], lse [B, T, HQ] float32 by the resident forward (kernel name window_resident_forward)."""
    k_rows, v_rows = _resident_keys(k, lay, lay.dkp), _resident_keys(v, lay, lay.dvp)
    rows = (lay.B, lay.nt * lay.tb, lay.H, lay.G)
    o, lse = _resident_call(
        _resident_fwd_kernel, lay, _resident_table(lay, window_size, cu_seqlens),
        [selected._token_rows(q, lay, lay.dkp)], k_rows, v_rows,
        [out_struct(rows + (lay.dvp,), q.dtype, q),
         out_struct((lay.B, lay.H, 1, lay.nt * lay.tb * lay.G), jnp.float32, q)],
        [(k_rows.shape[2:], k.dtype), (v_rows.shape[2:], v.dtype)], outputs=selected.FORWARD, q=q, scale=scale,
        interpret=interpret, name="window_resident_forward")
    return selected._from_token_rows(o, lay, v.shape[3]), selected._from_lane_rows(lse, lay)


def _resident_backward(q, k, v, cu_seqlens, o, lse, do, lay, passes, *, window_size, scale, interpret):
    """(dq, dk, dv) by the resident backward in `passes` (`resident`'s): one kernel call per pass, named
    window_resident_backward (one pass) or window_resident_backward_ followed by its outputs (dq_dk, dv)."""
    k_rows, v_rows = _resident_keys(k, lay, lay.dkp), _resident_keys(v, lay, lay.dvp)
    rows = lambda x, dp, fill=0.0: selected._token_rows(x, lay, dp, fill)
    tiled = [rows(q, lay.dkp), rows(do.astype(q.dtype), lay.dvp), selected._lane_rows(lse, lay, -jnp.inf),
             selected._lane_rows(kernel_delta(o, do, q.dtype), lay)]
    kr = k_rows.shape[2]
    shapes = {"dq": out_struct((lay.B, lay.nt * lay.tb, lay.H, lay.G, lay.dkp), q.dtype, q),
              "dk": out_struct((lay.B, lay.H, kr, lay.dkp), jnp.float32, q),
              "dv": out_struct((lay.B, lay.H, kr, lay.dvp), jnp.float32, q)}
    scratch = {"k": ((kr, lay.dkp), k.dtype), "v": ((kr, lay.dvp), v.dtype), "dk": ((kr, lay.dkp), jnp.float32),
               "dv": ((kr, lay.dvp), jnp.float32)}
    table = _resident_table(lay, window_size, cu_seqlens)
    grads = {}
    for outputs in passes:
        names = (("k", "v") if selected._reads_v(outputs) else ("k",)) + tuple(g for g in ("dk", "dv") if g in outputs)
        name = "window_resident_backward" + ("" if len(passes) == 1 else "_" + "_".join(outputs))
        grads |= zip(outputs, _resident_call(
            functools.partial(_resident_bwd_kernel, outputs=outputs), lay, table, tiled, k_rows, v_rows,
            [shapes[g] for g in outputs], [scratch[x] for x in names], outputs=outputs, q=q, scale=scale,
            interpret=interpret, name=name))
    keys = lambda x, d: jnp.transpose(x[:, :, lay.pad:lay.pad + lay.T, :d], (0, 2, 1, 3))
    return (selected._from_token_rows(grads["dq"], lay, q.shape[3]),
            (keys(grads["dk"], k.shape[3]) * scale).astype(k.dtype), keys(grads["dv"], v.shape[3]).astype(v.dtype))
