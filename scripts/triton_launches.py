"""Records every Triton launch of nsa on a set of shapes, planned for one GPU's facts, and compares two records:
whether a change of nsa/triton moved any launch (kernel, grid, warps, stages, constexprs, array shapes).

    python scripts/triton_launches.py --out new.json                      # this checkout
    python scripts/triton_launches.py --tree /tmp/old-triton --out old.json  # another one (git worktree add)
    python scripts/triton_launches.py --compare old.json new.json          # exits 1 where they differ
    python scripts/triton_launches.py --ptx --cases 'T8192|TK65536-bf' --out new.json  # and each one's PTX

With --ptx each distinct launch is also compiled for sm_90 (the H100's and H200's architecture, by Triton's own
compiler and ptxas: still no GPU) and its record holds the sha256 of its PTX without the lines that name the
source (.loc, .file, the debug sections) and the shared memory it takes: the compiled code, compared too.

No GPU and no jax_triton needed: the launch (nsa.triton._launch._call) is replaced by a recorder that returns
zeros, nsa._device.facts by the table's row of --device (default the H200), and every case is traced only
(jax.eval_shape: Triton's launch arguments are computed at trace time), so no array of the case's size is
made. The cases: training (nsa.attention's three branches, forward and backward, and select_blocks alone,
without the compressed lse) at B = 1, T = 8192 and 65536, HQ = 64, H = 4, D = 128, block 64, 16 blocks,
window 512, in bfloat16 (and T = 8192 in float16 and float32, a packed T = 8192 with a traced cu_seqlens, and
the wide and odd heads of scripts/sm90_shared_memory.py); serving (a KV cache of TK = 65536, TQ = 1, 4 and 16
queries, B = 1, 16 and 64): the fused step, the step without a window, and each op alone.
"""

import argparse
import hashlib
import json
import os
import re
import sys


def _jsonable(value):
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    return str(value)


_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int32": "i32"}


def ptx_code(ptx):
    """The PTX without its debug lines (.loc, .file and the debug sections), which move with the source."""
    keep = [line for line in ptx.splitlines() if not line.lstrip().startswith((".loc", ".file"))]
    return "\n".join(keep[:next((i for i, line in enumerate(keep) if line.lstrip().startswith(".section")), len(keep))])


def compile_sm90(kernel, arrays, num_warps, num_stages, constexprs):
    """Triton's compile of the launch of `kernel` on `arrays` (its pointer arguments, inputs then outputs: anything
    with a dtype) for sm_90, the pointers 16-byte aligned as jax-triton passes them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = iter(_TYPES[str(a.dtype)] for a in arrays)
    signature = {n: "constexpr" if n in constexprs else "*" + next(pointers) for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n not in constexprs}
    src = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                    constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                             num_stages=num_stages))


def recorder(records, ptx=None):
    """A stand-in for jax_triton.triton_call that records the launch and returns zeros; with `ptx` (a dict, the
    compiles so far) it also compiles the launch for sm_90."""
    import jax.numpy as jnp

    def call(*args, kernel, out_shape, grid, num_warps, num_stages, **constexprs):
        outs = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]
        launch = dict(
            kernel=kernel.fn.__name__, module=kernel.fn.__module__, grid=[int(g) for g in grid],
            num_warps=num_warps, num_stages=num_stages,
            constexprs={k: _jsonable(v) for k, v in sorted(constexprs.items())},
            inputs=[[list(map(int, a.shape)), str(a.dtype)] for a in args],
            outputs=[[list(map(int, o.shape)), str(o.dtype)] for o in outs])
        if ptx is not None:
            key = json.dumps([launch[k] for k in ("kernel", "num_warps", "num_stages", "constexprs")] +
                             [str(a.dtype) for a in [*args, *outs]])
            if key not in ptx:
                compiled = compile_sm90(kernel, [*args, *outs], num_warps, num_stages, constexprs)
                code = ptx_code(compiled.asm["ptx"]).encode()
                ptx[key] = dict(ptx_sha256=hashlib.sha256(code).hexdigest(), shared=compiled.metadata.shared)
            launch.update(ptx[key])
        records.append(launch)
        zeros = [jnp.zeros(o.shape, o.dtype) for o in outs]
        return zeros if isinstance(out_shape, (list, tuple)) else zeros[0]

    return call


def cases():
    """{name: a function of no arguments that traces the case}."""
    import jax
    import jax.numpy as jnp

    import nsa

    HQ, H, D, BS, S, W = 64, 4, 128, 64, 16, 512
    arg = jax.ShapeDtypeStruct
    found = {}

    def training(T, dtype, G=HQ // H, dk=D, dv=D, bs=BS, packed=False):
        q, k, v = arg((1, T, H * G, dk), dtype), arg((1, T, H, dk), dtype), arg((1, T, H, dv), dtype)
        gate = arg((1, T, H * G), dtype)
        cu = arg((5,), jnp.int32) if packed else None

        def loss(q, k, v, g_cmp, g_slc, g_swa, cu):
            o = nsa.attention(q, k, v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_counts=S, block_size=bs,
                              window_size=W, cu_seqlens=cu, implementation="triton")
            return jnp.sum(o.astype(jnp.float32))

        def select(q, k):
            k_cmp = nsa.compress(k, block_size=bs)
            return nsa.select_blocks(q, k_cmp, block_counts=S, block_size=bs, implementation="triton")

        tag = f"{jnp.dtype(dtype).name}-T{T}-G{G}-dk{dk}-dv{dv}-bs{bs}" + ("-packed" if packed else "")
        found[f"train-{tag}"] = lambda: jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)), q, k, v, gate,
                                                       gate, gate, cu)
        found[f"select-{tag}"] = lambda: jax.eval_shape(select, q, k)

    for T in (8192, 65536):
        training(T, jnp.bfloat16)
    training(8192, jnp.float16)
    training(8192, jnp.float32)
    training(8192, jnp.bfloat16, packed=True)
    for G, dtype, dk, dv, bs in [(64, jnp.bfloat16, 256, 256, 128), (16, jnp.float16, 256, 16, 128),
                                 (1, jnp.bfloat16, 16, 256, 16), (3, jnp.float32, 64, 32, 32)]:
        training(2048, dtype, G, dk, dv, bs)

    def serving(B, TQ, window_size, TK=65536, dtype=jnp.bfloat16):
        q, k, v = arg((B, TQ, HQ, D), dtype), arg((B, TK, H, D), dtype), arg((B, TK, H, D), dtype)
        k_cmp, v_cmp = arg((B, TK // BS, H, D), dtype), arg((B, TK // BS, H, D), dtype)
        lens, gate = arg((B,), jnp.int32), arg((B, TQ, HQ), dtype)

        def step(q, k, v, k_cmp, v_cmp, lens, g_cmp, g_slc, g_swa):
            return nsa.attention(q, k, v, k_cmp=k_cmp, v_cmp=v_cmp, kv_lens=lens, g_cmp=g_cmp, g_slc=g_slc,
                                 g_swa=g_swa if window_size else None, block_counts=S, block_size=BS,
                                 window_size=window_size, implementation="triton")

        def ops(q, k, v, k_cmp, v_cmp, lens):
            common = dict(kv_lens=lens, implementation="triton")
            o_cmp, lse = nsa.compressed_attention(q, k_cmp, v_cmp, block_size=BS, **common)
            idx = nsa.select_blocks(q, k_cmp, block_counts=S, block_size=BS, **common)
            o_slc = nsa.selected_attention(q, k, v, idx, block_size=BS, **common)
            o_swa = nsa.sliding_window_attention(q, k, v, window_size=W, **common)
            return o_cmp, lse, o_slc, o_swa

        tag = f"B{B}-TQ{TQ}-TK{TK}-{jnp.dtype(dtype).name}"
        found[f"step-{tag}-W{window_size}"] = lambda: jax.eval_shape(step, q, k, v, k_cmp, v_cmp, lens, gate, gate,
                                                                     gate)
        if window_size:
            found[f"ops-{tag}"] = lambda: jax.eval_shape(ops, q, k, v, k_cmp, v_cmp, lens)

    for B in (1, 16, 64):
        for TQ in (1, 4, 16):
            serving(B, TQ, W)
        serving(B, 1, 0)
    serving(1, 1, W, TK=524288)
    serving(1, 2, W, TK=8192, dtype=jnp.float32)
    return found


def record(tree, device, pattern=".", ptx=False):
    sys.path.insert(0, os.path.abspath(tree))
    os.environ.pop("TRITON_INTERPRET", None)
    import nsa
    from nsa import _device
    from nsa.triton import _launch

    assert os.path.dirname(os.path.dirname(os.path.abspath(nsa.__file__))) == os.path.abspath(tree), nsa.__file__
    facts = _device.TABLE[device]
    _device.facts = lambda platform="cuda": facts
    result, compiles = {}, ({} if ptx else None)
    for name, trace in cases().items():
        if not re.search(pattern, name):
            continue
        records = []
        _launch._call = recorder(records, compiles)
        try:
            trace()
        except Exception as e:  # recorded: a case that no longer traces is a difference too
            records.append(dict(error=f"{type(e).__name__}: {e}"[:500]))
        result[name] = records
        print(f"{name}: {len(records)} launches", flush=True)
    return result


def _key(launch):
    return {k: v for k, v in launch.items() if k != "module"}  # a kernel may move to another module


def compare(old, new):
    """The differences between two records, one line each."""
    lines = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a is None or b is None:
            lines.append(f"{name}: only in the {'new' if a is None else 'old'} record")
            continue
        if len(a) != len(b):
            lines.append(f"{name}: {len(a)} launches against {len(b)}: {[x.get('kernel') for x in a]} against "
                         f"{[x.get('kernel') for x in b]}")
            continue
        for i, (x, y) in enumerate(zip(a, b)):
            if _key(x) != _key(y):
                fields = sorted(k for k in set(_key(x)) | set(_key(y)) if x.get(k) != y.get(k))
                lines.append(f"{name} launch {i} ({x.get('kernel')}): " + "; ".join(
                    f"{k}: {x.get(k)} -> {y.get(k)}" for k in fields))
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                        help="the checkout whose nsa is recorded (default: this one)")
    parser.add_argument("--device", default="NVIDIA H200", help="the row of nsa._device.TABLE the kernels plan for")
    parser.add_argument("--out", help="write the record here (JSON)")
    parser.add_argument("--cases", default=".", help="only the cases whose name this regular expression finds")
    parser.add_argument("--ptx", action="store_true", help="also compile each launch for sm_90 (slow)")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two records")
    args = parser.parse_args()
    if args.compare:
        old, new = (json.load(open(path)) for path in args.compare)
        lines = compare(old, new)
        launches = sum(len(v) for v in new.values())
        print("\n".join(lines) or f"the same {launches} launches in {len(new)} cases")
        return 1 if lines else 0
    result = record(args.tree, args.device, args.cases, args.ptx)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=0, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
