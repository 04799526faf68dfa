"""Resident range attention: the TPU training kernels of the two branches where each query token sees one contiguous
range [lo_t, hi_t] of key rows, the sliding window (nsa/pallas/tpu/window.py: the rows of its last W tokens) and
compressed attention (nsa/pallas/tpu/compressed.py: the compressed rows of its complete windows), in nsa's own
token-major layout.

A grid step (b, h, i) owns TB = RESIDENT_TOKENS consecutive tokens of one KV head, their G query heads stacked into R
= TB * G MXU rows (token j's at j * G, as selected attention's union tiles), and attends them to SPAN contiguous key
rows [i * ADVANCE, i * ADVANCE + SPAN) of the (b, h)'s k and v, held in VMEM for the whole grid row (copied in at its
first step, as the resident selected kernels do; k and v zero-padded in front by PAD rows and behind to KR = (NT - 1)
* ADVANCE + SPAN rows). The window slides (ADVANCE = TB, SPAN = W - 1 + TB rounded up to whole lanes, PAD = SPAN -
TB: every key any of its tokens sees); compressed attention does not (ADVANCE = 0, PAD = 0, SPAN = the compressed rows
rounded up to whole lanes), and a step reads the shortest of a few static prefixes of them that holds every row its
tokens see (`Layout.spans`, `_by_prefix`: about half of them on average under the causal mask). An SMEM table gives
each token's first and last column of the step's SPAN (from lo, hi: packed sequences included; empty where a token
sees nothing, a padded token none). One [R, SPAN] (or [R, prefix]) softmax a step; a row that sees nothing gets o =
0, lse = -inf. The backward recomputes p from lse and adds each step's dk, dv into float32 sums resident like k and
v, copied out at the row's last step (`selected._row_end`); no atomics, a fixed order: bitwise repeatable. Where one
pass does not fit (the window at 64k tokens at the standard shape on a v5e), two, as selected attention's: (dq, dk),
then (dv) holding k and dv alone, bitwise the same.

A non-finite key or value row inside a step's span that one of its tokens does not see (a later token of the tile,
another packed sequence's row) reaches that token as 0 * NaN, as in splash's blocks (training inputs are finite; the
KV caches, whose rows past a sequence may hold anything, never take these kernels).

Layouts: q, do, o, dq in nsa's own [B, T, HQ, D] as [B, Tp, H, G, Dp] (`selected._token_rows`); lse and delta float32
lane rows [B, H, 1, Tp * G] (`selected._lane_rows`: a [.., G, 1] form takes 128 lanes a value on the TPU, 2 GiB each
at 64k); k, v [B, H, KR, Dp]; the table int32 [NT, 1, 2 * TB] (SMEM, a row per step).
"""

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nsa._device import facts
from nsa._plan import kernel_delta, padded
from nsa._varlen import cdiv, round_up
from nsa.pallas.tpu import _splash, selected
from nsa.pallas.tpu._common import dot, lane_padded, lanes, out_struct, params, sublanes

RESIDENT_TOKENS = 16  # TB: the tokens of a step (R = TB * G rows)
# A step that does not slide (ADVANCE = 0: compressed attention) reads only a prefix of its SPAN rows, the shortest of
# up to PREFIX_VARIANTS static lengths, multiples of PREFIX_ROWS, that holds every column its tokens see: a causal
# step's tokens see the rows before their own, so the prefix is about half of SPAN on average, without a loop.
PREFIX_ROWS = 512
PREFIX_VARIANTS = 8


class Layout(NamedTuple):
    """The resident kernels' shapes (module docstring): batch, tokens and their padded count, KV heads, query heads
    per KV head, tokens per step and steps, padded head dims, the key rows a step reads, the zero rows in front of k
    and v, how far a step's rows move from one step to the next, and the rows of k and v as given."""

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
    advance: int
    keys: int

    @property
    def key_rows(self):
        """KR: the rows of k and v as the kernels hold them, padding included."""
        return (self.nt - 1) * self.advance + self.span

    @property
    def spans(self):
        """The row counts a step may read, ascending, the last SPAN: SPAN alone where steps slide (ADVANCE > 0), else
        the multiples of a quantum (PREFIX_ROWS, or SPAN / PREFIX_VARIANTS in whole lanes where that is more)."""
        if self.advance:
            return (self.span,)
        quantum = max(PREFIX_ROWS, round_up(cdiv(self.span, PREFIX_VARIANTS), lanes()))
        return tuple(range(quantum, self.span, quantum)) + (self.span,)


def layout(q, k, v, *, span, pad, advance):
    """The Layout of q [B, T, HQ, Dk] over k, v [B, TK, H, D], a step reading `span` rows (whole lanes) that move by
    `advance` (0 or TB) from one step to the next, behind `pad` zero rows."""
    B, T, HQ, _ = q.shape
    H, tb = k.shape[2], RESIDENT_TOKENS
    return Layout(B, T, H, HQ // H, tb, cdiv(T, tb), lane_padded(q.shape[3]), lane_padded(v.shape[3]),
                  round_up(span, lanes()), pad, advance, k.shape[1])


def takes(q, k, kv_lens, config):
    """Whether the resident kernels take q [B, T, HQ, Dk] over k [B, TK, H, Dk]: training (no KV cache, no flash
    Config), bfloat16 or float32 (as splash; float16: the flash kernels), a static batch, G a multiple of the sublanes
    of q's dtype (a token's G rows whole sublane tiles)."""
    return (config is None and kv_lens is None and isinstance(q.shape[0], int)
            and (q.shape[2] // k.shape[2]) % sublanes(q.dtype) == 0
            and jnp.dtype(q.dtype) in _splash.SPLASH_DTYPES)


def plan(lay, dtype, backward):
    """The passes (`selected.resident_plan`, on `resident_bytes`) within the chip's VMEM, or None."""
    return selected.resident_plan(lay, dtype, backward, facts("tpu").vmem, resident_bytes)


def resident_bytes(lay, dtype, outputs):
    """VMEM a step of a pass computing `outputs` (selected.FORWARD, or some of dq, dk, dv) holds: k (and v where the
    pass reads it) and the float32 sums of dk, dv it computes, resident; its tiles through BlockSpecs, double-buffered
    (q, o, lse; or q, do, lse, delta and dq where computed); the [R, SPAN] float32 logits a few times over."""
    size = jnp.dtype(dtype).itemsize
    dp = {"k": lay.dkp, "v": lay.dvp}
    keys = lay.key_rows * sum(dp[x] * size for x in selected._keys_read(outputs))
    keys += lay.key_rows * sum(dp[g[1]] * 4 for g in ("dk", "dv") if g in outputs)
    tiles = selected._step_tiles(lay, dtype, outputs)
    lane_rows = selected._lane_row_bytes(lay, 1 if outputs == selected.FORWARD else 2)  # lse (and delta)
    return (keys + 2 * (sum(selected._tile_bytes(lay, d, dt) for d, dt in tiles) + lane_rows)
            + 4 * lay.tb * lay.G * lay.span * 4)


def _keys(x, lay, dp):
    """k or v [B, TK, H, D] -> [B, H, KR, dp]: PAD zero rows in front, zero rows behind, D padded to dp."""
    x = jnp.transpose(padded(x, 3, dp), (0, 2, 1, 3))
    return jnp.pad(x, [(0, 0), (0, 0), (lay.pad, lay.key_rows - lay.pad - lay.keys), (0, 0)])


def _table(lay, lo, hi):
    """int32 [NT, 1, 2 * TB]: per step, the first then the last column (of its SPAN key rows) each token sees, from
    lo, hi [T] (its first and last key row as given: `nsa._varlen`'s ranges); a padded token sees none (first SPAN,
    last -1)."""
    t = jnp.arange(lay.nt * lay.tb, dtype=jnp.int32)
    base = (t // lay.tb) * lay.advance - lay.pad  # the key row (as given) of each token's step's column 0
    real = t < lay.T
    first = jnp.where(real, padded(lo.reshape(-1), 0, t.shape[0]) - base, lay.span)
    last = jnp.where(real, padded(hi.reshape(-1), 0, t.shape[0]) - base, -1)
    return jnp.concatenate([first.reshape(lay.nt, 1, lay.tb), last.reshape(lay.nt, 1, lay.tb)], axis=2)


def _seen(tab_ref, *, tokens, heads, span):
    """bool [TB * G, SPAN]: row j * G + g sees column c iff first_j <= c <= last_j (the step's table row)."""
    bounds = [jnp.concatenate([jnp.full((heads, span), tab_ref[0, at + j], jnp.int32) for j in range(tokens)])
              for at in (0, tokens)]
    col = lax.broadcasted_iota(jnp.int32, bounds[0].shape, 1)
    return (col >= bounds[0]) & (col <= bounds[1])


def _rows(tokens, *, advance, span):
    """The step's `span` key rows: [i * ADVANCE, i * ADVANCE + span) of the resident k and v."""
    if advance == 0:
        return pl.ds(0, span)
    return pl.ds(pl.multiple_of(pl.program_id(2) * advance, tokens), span)


def _by_prefix(tab_ref, step, *, tokens, spans):
    """step(span) for the shortest of `spans` (`Layout.spans`) holding the last column any of the step's tokens sees
    (the table row's second half; -1 for a token that sees none): one static length a step, chosen under `pl.when`."""
    if len(spans) == 1:
        return step(spans[0])
    last = tab_ref[0, tokens]
    for j in range(1, tokens):
        last = jnp.maximum(last, tab_ref[0, tokens + j])
    for n, span in enumerate(spans):
        shorter = last < span if n == 0 else (last >= spans[n - 1]) & (last < span)
        pl.when(shorter)(functools.partial(step, span))


def _keys_copies(pairs, sems):
    """The copies of the (b, h)'s rows of each (HBM source [B, H, rows, Dp], VMEM destination) pair, a semaphore
    each."""
    b, h = pl.program_id(0), pl.program_id(1)
    return [pltpu.make_async_copy(src.at[b, h], dst, sems.at[n]) for n, (src, dst) in enumerate(pairs)]


def _fwd_kernel(tab_ref, q_ref, k_hbm, v_hbm, o_ref, lse_ref, k_ref, v_ref, sems, *, spans, advance, scale,
                precision):
    """Grid (B, H, NT), a step TB tokens: q_ref (TB, G, Dkp) stacked into [R, Dkp] against k_ref, v_ref's SPAN rows
    (`_rows`; resident [KR, Dp]: `selected._row_start`), or the prefix of them its tokens see (`_by_prefix`); o_ref
    (TB, G, Dvp), lse_ref (1, R) float32, a lane row (`selected._lane_rows`)."""
    selected._row_start(_keys_copies([(k_hbm, k_ref), (v_hbm, v_ref)], sems), [])
    tokens, heads = q_ref.shape[:2]

    def step(span):
        rows = _rows(tokens, advance=advance, span=span)
        s = dot(selected._stacked(q_ref, 0, tokens), k_ref[rows, :], precision, transpose_b=True) * scale
        o, lse = selected._softmax_rows(s, _seen(tab_ref, tokens=tokens, heads=heads, span=span), v_ref[rows, :],
                                        precision)
        selected._unstack(o_ref, 0, o)
        lse_ref[...] = selected._lane_row(lse)

    _by_prefix(tab_ref, step, tokens=tokens, spans=spans)


def _bwd_kernel(tab_ref, q_ref, do_ref, lse_ref, delta_ref, k_hbm, v_hbm, *refs, outputs, spans, advance, scale,
                precision):
    """Grid (B, H, NT), in order along a (b, h)'s row: one pass of the backward computing `outputs` (some of dq, dk,
    dv), the forward's step again from lse (`selected._gradients`): q_ref, do_ref (TB, G, Dp) stacked into [R, Dp],
    lse_ref, delta_ref (1, R) float32 lane rows (`selected._lane_rows`) turned into [R, 1] columns. refs: the outputs
    (dq_ref (TB, G, Dkp) its own tile; dk, dv [B, H, KR, Dp] float32 in HBM, dk unscaled), the resident k (and v where
    the pass reads it), the float32 sums of dk, dv it computes (a step adds its [SPAN, Dp] at its rows; the row's last
    step copies them out), the DMA semaphores."""
    names = selected._keys_read(outputs)
    out = dict(zip(outputs, refs))
    sums = {g: ref for g, ref in zip((g for g in ("dk", "dv") if g in outputs), refs[len(outputs) + len(names):])}
    keys = dict(zip(names, refs[len(outputs):]))
    sems = refs[-1]
    b, h = pl.program_id(0), pl.program_id(1)
    hbm = {"k": k_hbm, "v": v_hbm}
    selected._row_start(_keys_copies([(hbm[x], keys[x]) for x in names], sems), list(sums.values()))
    tokens, heads = q_ref.shape[:2]

    def step(span):
        rows = _rows(tokens, advance=advance, span=span)
        stacked = [selected._stacked(x, 0, tokens) for x in (q_ref, do_ref)] + [
            selected._lane_column(x) for x in (lse_ref, delta_ref)]
        v = keys["v"][rows, :] if "v" in keys else None
        dq, grads = selected._gradients(*stacked, keys["k"][rows, :], v,
                                        _seen(tab_ref, tokens=tokens, heads=heads, span=span),
                                        outputs=outputs, scale=scale, precision=precision)
        if dq is not None:
            selected._unstack(out["dq"], 0, dq)
        for g, ref in sums.items():
            ref[rows, :] += grads[g]

    _by_prefix(tab_ref, step, tokens=tokens, spans=spans)
    selected._row_end([pltpu.make_async_copy(ref, out[g].at[b, h], sems.at[n]) for n, (g, ref) in
                       enumerate(sums.items())])


def _call(kernel, lay, table, tiled, k_rows, v_rows, out_shapes, scratch, *, outputs, q, scale, interpret, name):
    """pallas_call of a resident kernel on the grid (B, H, NT), NT "arbitrary" (a row's steps in order): the table
    row (SMEM), the tiled inputs [B, Tp, H, G, .] (TB tokens of KV head h a step) or lane rows, k and v in HBM,
    `out_shapes` (of `outputs`) tiled likewise or 4-d in HBM (dk, dv), `scratch` [(shape, dtype)] and two DMA
    semaphores."""
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)

    def tile_spec(shape):  # token rows [B, Tp, H, G, .]: (TB, G, .); lane rows [B, H, 1, Tp * G]: (1, TB * G)
        if selected._is_lane_rows(shape):
            return pl.BlockSpec((None, None, 1, lay.tb * lay.G), lambda b, h, i: (b, h, 0, i))
        return pl.BlockSpec((None, lay.tb, None) + shape[3:], lambda b, h, i: (b, i, h) + (0,) * (len(shape) - 3))

    semantics = ("parallel", "parallel", "arbitrary")
    need = resident_bytes(lay, k_rows.dtype, outputs) + selected.RESIDENT_MARGIN
    compiler = pltpu.CompilerParams(dimension_semantics=semantics,
                                    vmem_limit_bytes=int(min(facts("tpu").vmem, max(need, facts("tpu").scoped_vmem))))
    _, dots = params(q, interpret, semantics)
    return pl.pallas_call(
        functools.partial(kernel, spans=lay.spans, advance=lay.advance, scale=float(scale), **dots),
        grid=(lay.B, lay.H, lay.nt),
        in_specs=[pl.BlockSpec((None, 1, 2 * lay.tb), lambda b, h, i: (i, 0, 0), memory_space=pltpu.SMEM)]
        + [tile_spec(x.shape) for x in tiled] + [hbm, hbm],
        out_specs=[hbm if len(o.shape) == 4 and not selected._is_lane_rows(o.shape) else tile_spec(o.shape)
                   for o in out_shapes],
        out_shape=out_shapes,
        scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in scratch] + [pltpu.SemaphoreType.DMA((2,))],
        name=name, compiler_params=compiler, interpret=interpret,
    )(table, *tiled, k_rows, v_rows)


def forward(q, k, v, lo, hi, lay, *, scale, interpret, name):
    """o [B, T, HQ, Dv], lse [B, T, HQ] float32 of q [B, T, HQ, Dk] over k, v [B, TK, H, D], token t seeing the key
    rows [lo[t], hi[t]] (int32 [T]), by the resident forward (kernel `name`_resident_forward)."""
    k_rows, v_rows = _keys(k, lay, lay.dkp), _keys(v, lay, lay.dvp)
    rows = (lay.B, lay.nt * lay.tb, lay.H, lay.G)
    o, lse = _call(
        _fwd_kernel, lay, _table(lay, lo, hi), [selected._token_rows(q, lay, lay.dkp)], k_rows, v_rows,
        [out_struct(rows + (lay.dvp,), q.dtype, q),
         out_struct((lay.B, lay.H, 1, lay.nt * lay.tb * lay.G), jnp.float32, q)],
        [(k_rows.shape[2:], k.dtype), (v_rows.shape[2:], v.dtype)], outputs=selected.FORWARD, q=q, scale=scale,
        interpret=interpret, name=f"{name}_resident_forward")
    return selected._from_token_rows(o, lay, v.shape[3]), selected._from_lane_rows(lse, lay)


def backward(q, k, v, lo, hi, o, lse, do, lay, passes, *, scale, interpret, name, dlse=None):
    """(dq, dk, dv) of `forward` for the cotangents do [B, T, HQ, Dv] (and dlse [B, T, HQ] of lse, None: lse is not an
    output) by the resident backward in `passes` (`plan`'s): one kernel call per pass, named `name`_resident_backward
    (one pass) or that followed by _ and its outputs (dq_dk, dv)."""
    k_rows, v_rows = _keys(k, lay, lay.dkp), _keys(v, lay, lay.dvp)
    rows = lambda x, dp, fill=0.0: selected._token_rows(x, lay, dp, fill)
    tiled = [rows(q, lay.dkp), rows(do.astype(q.dtype), lay.dvp), selected._lane_rows(lse, lay, -jnp.inf),
             selected._lane_rows(kernel_delta(o, do, q.dtype, lse, dlse), lay)]
    kr = lay.key_rows
    shapes = {"dq": out_struct((lay.B, lay.nt * lay.tb, lay.H, lay.G, lay.dkp), q.dtype, q),
              "dk": out_struct((lay.B, lay.H, kr, lay.dkp), jnp.float32, q),
              "dv": out_struct((lay.B, lay.H, kr, lay.dvp), jnp.float32, q)}
    scratch = {"k": ((kr, lay.dkp), k.dtype), "v": ((kr, lay.dvp), v.dtype), "dk": ((kr, lay.dkp), jnp.float32),
               "dv": ((kr, lay.dvp), jnp.float32)}
    table = _table(lay, lo, hi)
    grads = {}
    for outputs in passes:
        names = selected._keys_read(outputs) + tuple(g for g in ("dk", "dv") if g in outputs)
        call = f"{name}_resident_backward" + ("" if len(passes) == 1 else "_" + "_".join(outputs))
        grads |= zip(outputs, _call(
            functools.partial(_bwd_kernel, outputs=outputs), lay, table, tiled, k_rows, v_rows,
            [shapes[g] for g in outputs], [scratch[x] for x in names], outputs=outputs, q=q, scale=scale,
            interpret=interpret, name=call))
    keys = lambda x, d: jnp.transpose(x[:, :, lay.pad:lay.pad + lay.keys, :d], (0, 2, 1, 3))
    return (selected._from_token_rows(grads["dq"], lay, q.shape[3]),
            (keys(grads["dk"], k.shape[3]) * scale).astype(k.dtype), keys(grads["dv"], v.shape[3]).astype(v.dtype))
