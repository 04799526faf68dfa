"""Fingerprints of the compiled nsa kernels, blind to source locations: proof that a refactor (modules moved,
lines shifted) left every kernel as it was.

    python scripts/same_code.py --platform tpu --out benchmarks/results/same-code/new-tpu.json
    python scripts/same_code.py --platform tpu --tree /tmp/old --out benchmarks/results/same-code/old-tpu.json
    cd benchmarks/results/same-code && python ../../../scripts/same_code.py --compare old-tpu.json new-tpu.json

For each case (an op, a shape, an implementation, its forward or its gradient) the program is lowered for one
platform with jax.export (ShapeDtypeStructs, nothing runs) and split into
  - `hlo`: the StableHLO module around the kernels, printed without debug info (no `loc(...)`, no name or call-site
    locations), each kernel's custom call left with a placeholder naming the kernel in place of its payload;
  - one entry per kernel (custom call), its payload decoded and normalised:
      tpu_custom_call (Mosaic TPU): the base64 MLIR bytecode of backend_config's custom_call_config.body, parsed
        with the Mosaic TPU dialect, deserialized (mosaic-serde) and printed without debug info, with the rest of
        the backend_config (JSON) and the call's attributes, operand and result types;
      mosaic_gpu / mosaic_gpu_v2 (Mosaic GPU): the MLIR bytecode in backend_config's `module`, parsed with the
        Mosaic GPU dialect, deserialized (mosaic_gpu-serde), printed without debug info; its `kernel_hash` (the
        sha256 of the bytecode, locations included) and the module's `mosaic_gpu.dump_basename` (a file name for
        dumps, numbered per process) are left out;
      triton_kernel_call (jax-triton): backend_config is a zlib-compressed TritonAnyKernelCall proto (jaxlib's
        triton.proto) holding the kernel's name, num_warps, num_ctas, shared memory, PTX, TTIR and compute
        capability, and the call's grid and scalar parameters. The entry is the compiled kernel: those settings,
        the grid and parameters, and the PTX without its line info (`.file` paths, `.loc` lines, `//` comments,
        the DWARF `.debug_*` sections and the `$L__tmp`/`$L__func_*` labels only they use). num_stages is not in
        the proto (its effect is in the PTX): the arguments of each jax_triton.triton_call (kernel, grid,
        num_warps, num_stages, constexprs) are recorded as the case's `triton_launches` entry. The TTIR (Triton's
        IR before its optimisation) names each helper it calls by module and name (`nsa.triton._flash._tile__...`):
        with `loc(...)` and the module prefixes removed it is kept as an informational entry (`<kernel>.ttir`):
        a renamed helper changes it and not the PTX, so it is reported but does not fail --compare.
Each entry's fingerprint is the sha256 of its normalised text; `--dump DIR` writes those texts. Whatever still
names a source file after normalisation (a `.py` path, a `loc(`) is listed in the summary's `residue`.

`--tree PATH` imports nsa from another checkout (PATH first on sys.path; the default is the checkout holding this
script), e.g. `git worktree add /tmp/old <commit>` for the tree before a refactor. `--compare A B` prints the
fingerprints that differ (or exist on one side only) and exits 1 if any do.

Mosaic TPU lowers on any machine (jax 0.10.2 and 0.11.2); Mosaic GPU ("cuda", implementation="pallas") only with
jax >= 0.11; Triton ("cuda", implementation="triton") only where jax_triton imports, i.e. on a GPU machine with
jax[cuda] and jax-triton installed: `python3 scripts/same_code.py --platform cuda --implementations triton ...`.
Compare files made on the same kind of machine with the same jax: nsa plans its kernels with the facts of the
device it finds (nsa._device), and lowering for CUDA or TPU on a machine without one plans with the table's
smallest values instead.
"""

import argparse
import base64
import datetime
import hashlib
import json
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# the standard shape: B = 1, HQ = 64, H = 4, D = 128, bfloat16, block 64, 16 blocks, window 512
B, HQ, H, D = 1, 64, 4, 128
BLOCK, COUNTS, WINDOW = 64, 16, 512
LENGTHS = (1024, 8192)
DECODE_KV = 8192
KERNEL_TARGETS = ("tpu_custom_call", "mosaic_gpu", "mosaic_gpu_v2", "triton_kernel_call")


def sha(text):
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


# ----------------------------------------------------------------------------------------------------- the cases

def make_cases(lengths, implementations):
    """[(case name, fn, specs, argnums of the gradient or None)]: each op at each length, nsa.attention packed
    (cu_seqlens, traced) at the longest length, and one decode step (1 query, kv_lens) over DECODE_KV keys."""
    import jax
    import jax.numpy as jnp
    import nsa

    S, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cases = []
    for impl in implementations:
        for T in lengths:
            NC = -(-T // BLOCK)
            q, kv, gate = S((B, T, HQ, D), bf), S((B, T, H, D), bf), S((B, T, HQ), bf)
            cmp, idx = S((B, NC, H, D), bf), S((B, T, H, COUNTS), i32)
            tag = f"T{T}-{impl}"
            ops = {
                "window": (lambda q, k, v, impl=impl: nsa.sliding_window_attention(
                    q, k, v, window_size=WINDOW, implementation=impl), (q, kv, kv), (0, 1, 2)),
                "compressed": (lambda q, k_cmp, v_cmp, impl=impl: nsa.compressed_attention(
                    q, k_cmp, v_cmp, block_size=BLOCK, implementation=impl), (q, cmp, cmp), (0, 1, 2)),
                "select": (lambda q, k_cmp, impl=impl: nsa.select_blocks(
                    q, k_cmp, block_counts=COUNTS, block_size=BLOCK, implementation=impl), (q, cmp), None),
                "selected": (lambda q, k, v, idx, impl=impl: nsa.selected_attention(
                    q, k, v, idx, block_counts=COUNTS, block_size=BLOCK, implementation=impl), (q, kv, kv, idx),
                    (0, 1, 2)),
                "attention": (lambda q, k, v, g1, g2, g3, impl=impl: nsa.attention(
                    q, k, v, g_cmp=g1, g_slc=g2, g_swa=g3, block_counts=COUNTS, block_size=BLOCK,
                    window_size=WINDOW, implementation=impl), (q, kv, kv, gate, gate, gate), (0, 1, 2, 3, 4, 5)),
            }
            if T == max(lengths):
                ops["packed"] = (lambda q, k, v, g1, g2, g3, cu, impl=impl: nsa.attention(
                    q, k, v, g_cmp=g1, g_slc=g2, g_swa=g3, block_counts=COUNTS, block_size=BLOCK,
                    window_size=WINDOW, cu_seqlens=cu, implementation=impl),
                    (q, kv, kv, gate, gate, gate, S((4,), i32)), (0, 1, 2, 3, 4, 5))
            for op, (fn, specs, argnums) in ops.items():
                cases.append((f"{op}-{tag}-fwd", fn, specs, None))
                if argnums is not None:
                    cases.append((f"{op}-{tag}-grad", fn, specs, argnums))
        q, kv, gate = S((B, 1, HQ, D), bf), S((B, DECODE_KV, H, D), bf), S((B, 1, HQ), bf)
        cases.append((f"decode-N{DECODE_KV}-{impl}-fwd", lambda q, k, v, g1, g2, g3, lens, impl=impl: nsa.attention(
            q, k, v, g_cmp=g1, g_slc=g2, g_swa=g3, block_counts=COUNTS, block_size=BLOCK, window_size=WINDOW,
            kv_lens=lens, implementation=impl), (q, kv, kv, gate, gate, gate, S((B,), i32)), None))
    return cases


def gradient(fn, argnums):
    import jax
    import jax.numpy as jnp

    def loss(*args):
        leaves = [x for x in jax.tree_util.tree_leaves(fn(*args)) if jnp.issubdtype(x.dtype, jnp.floating)]
        return sum(jnp.sum(x.astype(jnp.float32)) for x in leaves)
    return jax.grad(loss, argnums=argnums)


def lower(fn, specs, platform):
    """The StableHLO text (with locations) of jax.jit(fn) exported for `platform`."""
    import jax

    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in ("triton_kernel_call",)]
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*specs)
    return exported.mlir_module()


# ------------------------------------------------------------------------------------------------ normalisation

def _names(attributes):
    return [a if isinstance(a, str) else a.name for a in attributes]


def _call_text(op, skip, ir):
    """A custom call's attributes (but `skip`), operand and result types, one per line."""
    lines = [f"{name} = {op.attributes[name]}" for name in sorted(_names(op.attributes)) if name not in skip]
    lines.append("operands: " + ", ".join(str(o.type) for o in op.operands))
    lines.append("results: " + ", ".join(str(r.type) for r in op.results))
    return "\n".join(lines)


def _deserialized(body, register, serde, ir, mlir, PassManager):
    """MLIR bytecode `body` parsed in a fresh context (`register` adds the dialects), the serde pass `serde`
    undone, printed without debug info."""
    ctx = mlir.make_ir_context()
    register(ctx)
    with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(body)
        try:
            PassManager.parse(f"builtin.module({serde}{{serialize=false}})").run(module.operation)
            note = None
        except Exception as e:  # the serialized form prints as well, only less readably
            note = f"{serde}{{serialize=false}} failed ({type(e).__name__}), printed serialized"
        return module, module.operation.get_asm(enable_debug_info=False), note


def _tpu_kernel(op, ir, mlir, PassManager):
    from jax._src.lib import tpu
    from jax._src import tpu_custom_call

    config = json.loads(ir.StringAttr(op.attributes["backend_config"]).value_bytes)
    body = base64.b64decode(config["custom_call_config"].pop("body"))

    def register(ctx):
        tpu.register_dialect(ctx)
        for loader in getattr(tpu_custom_call, "_extra_dialect_loaders", ()):
            loader(ctx)
    _, text, note = _deserialized(body, register, "mosaic-serde", ir, mlir, PassManager)
    name = ir.StringAttr(op.attributes["kernel_name"]).value if "kernel_name" in _names(op.attributes) else "tpu"
    header = _call_text(op, {"backend_config"}, ir)
    return name, "backend_config", (f"{header}\nbackend_config (body aside): {json.dumps(config, sort_keys=True)}\n"
                                    f"body:\n{text}"), note, None


def _mosaic_gpu_kernel(op, ir, mlir, PassManager):
    from jax._src.lib import mosaic_gpu_dialect

    attr = "mhlo.backend_config" if "mhlo.backend_config" in _names(op.attributes) else "backend_config"
    config = op.attributes[attr]
    try:
        config = ir.DictAttr(config)
    except (ValueError, TypeError):  # mosaic_gpu (v1): a string, the 32-byte kernel id and the bytecode
        raw = ir.StringAttr(config).value_bytes
        rest, body = {}, raw[32:]
    else:  # mosaic_gpu_v2: a dictionary
        rest = {name: str(config[name]) for name in _names(config) if name not in ("kernel_hash", "module")}
        body = ir.StringAttr(config["module"]).value_bytes
    # jax's gpu dialect prints its dimension attribute as `#gpu<dim x>`, which it does not parse back;
    # `#gpu.dim<x>` (as long, so the bytecode's offsets hold) is the same attribute in a form it parses
    for d in b"xyz":
        body = body.replace(b"#gpu<dim %c>" % d, b"#gpu.dim<%c>" % d)

    def register(ctx):
        mosaic_gpu_dialect.register_dialect(ctx)
    module, text, note = _deserialized(body, register, "mosaic_gpu-serde", ir, mlir, PassManager)
    text = re.sub(r',? ?mosaic_gpu\.dump_basename = "[^"]*"', "", text, count=1)
    attrs = module.operation.attributes
    name = ir.StringAttr(attrs["sym_name"]).value if "sym_name" in _names(attrs) else "mosaic_gpu"
    header = _call_text(op, {attr}, ir)
    return name, attr, (f"{header}\nbackend_config (kernel_hash, module aside): {json.dumps(rest, sort_keys=True)}\n"
                        f"module:\n{text}"), note, None


# the protobuf wire format, enough for jaxlib's triton.proto

def _varint(buf, i):
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _fields(buf):
    i, out = 0, []
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = buf[i:i + n], i + n
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"protobuf wire type {wire}")
        out.append((number, wire, value))
    return out


KERNEL_FIELDS = {1: "kernel_name", 2: "num_warps", 10: "num_ctas", 3: "shared_mem_bytes", 4: "ptx", 5: "ttir",
                 6: "compute_capability"}


def _triton_kernel(buf):
    out = {}
    for number, wire, value in _fields(buf):
        name = KERNEL_FIELDS.get(number, f"field{number}")
        out[name] = value.decode() if wire == 2 else value
    return out


def _triton_call(buf):
    out = {"parameters": []}
    for number, wire, value in _fields(buf):
        if number == 1:
            out["kernel"] = _triton_kernel(value)
        elif number in (2, 3, 4):
            out[f"grid_{number - 2}"] = value
        elif number == 5:
            out["parameters"].append([(n, v.hex() if isinstance(v, bytes) else v) for n, _, v in _fields(value)]
                                     if value else [])
        else:
            out[f"field{number}"] = value.hex() if isinstance(value, bytes) else value
    return out


def _triton_any(buf):
    out = {}
    for number, wire, value in _fields(buf):
        if number == 1:
            out["kernel_call"] = _triton_call(value)
        elif number == 2:
            tuned = {"configs": [], "input_output_aliases": []}
            for n, w, v in _fields(value):
                if n == 1:
                    tuned["name"] = v.decode()
                elif n == 2:
                    config = {}
                    for cn, cw, cv in _fields(v):
                        config["kernel_call" if cn == 1 else "description"] = (
                            _triton_call(cv) if cn == 1 else cv.decode())
                    tuned["configs"].append(config)
                elif n == 3:
                    tuned["input_output_aliases"].append([(an, av) for an, _, av in _fields(v)])
            out["autotuned_kernel_call"] = tuned
        elif number == 3:
            out["metadata"] = value.hex()
        elif number == 4:
            out["name"] = value.decode()
    return out


def strip_ptx(ptx):
    """PTX without its line info: `.file` and `.loc` directives, `//` comments, the labels only the DWARF
    sections use ($L__tmpN, $L__func_beginN, $L__func_endN) and the `.section .debug_*` blocks (the brace block
    that follows the directive, on its line or the next)."""
    keep, section, depth, opened = [], False, 0, False
    for line in ptx.splitlines():
        line = re.sub(r"\s*//.*$", "", line)
        s = line.strip()
        if section:
            depth += s.count("{") - s.count("}")
            opened = opened or "{" in s
            if opened and depth <= 0:
                section = False
            continue
        if s.startswith(".section") and ".debug" in s:
            depth, opened = s.count("{") - s.count("}"), "{" in s
            section = not opened or depth > 0
            continue
        if not s or s.startswith((".file", ".loc")) or re.fullmatch(r"\$L__(tmp|func_begin|func_end)\d+:", s):
            continue
        keep.append(line)
    return "\n".join(keep)


# Triton names each function it calls by its module and qualified name (`nsa.triton._flash._tile__<types>`):
# the module is a file's path, dotted
MODULE_PREFIX = re.compile(r'(?<=[@"])(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*__)')


def strip_locations(text):
    """MLIR text (Triton's TTIR, which jax's MLIR cannot parse) without `loc(...)`: the `#locN = loc(...)` lines
    and each ` loc(...)` (balanced, strings skipped)."""
    text = re.sub(r"(?m)^#loc\d*\s*=\s*loc\(.*\n?", "", text)
    out, i = [], 0
    while True:
        j = text.find("loc(", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        if j > 0 and (text[j - 1].isalnum() or text[j - 1] in "_.%#"):
            out.append(text[i:j + 4])
            i = j + 4
            continue
        out.append(text[i:j].rstrip(" "))
        k, depth, quoted = j + 4, 1, False
        while k < len(text) and depth:
            c = text[k]
            if quoted:
                if c == "\\":
                    k += 1
                elif c == '"':
                    quoted = False
            elif c == '"':
                quoted = True
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
            k += 1
        i = k


def _normalised_triton_call(call):
    """(the compiled kernel: its settings, the call's grid and parameters, the PTX; the TTIR)."""
    kernel = dict(call["kernel"])
    ptx, ttir = kernel.pop("ptx", ""), kernel.pop("ttir", "")
    rest = {k: v for k, v in call.items() if k != "kernel"}
    return (f"kernel: {json.dumps(kernel, sort_keys=True)}\ncall: {json.dumps(rest, sort_keys=True)}\n"
            f"ptx:\n{strip_ptx(ptx)}"), MODULE_PREFIX.sub("", strip_locations(ttir))


def _triton_kernel_call(op, ir, mlir, PassManager):
    raw = ir.StringAttr(op.attributes["backend_config"]).value_bytes
    call = _triton_any(zlib.decompress(raw))
    header = _call_text(op, {"backend_config"}, ir)
    parts = [header, f"name: {call.get('name')!r}", f"metadata: {call.get('metadata')}"]
    ttirs = []
    if "kernel_call" in call:
        name = call["kernel_call"]["kernel"].get("kernel_name", "triton")
        compiled, ttir = _normalised_triton_call(call["kernel_call"])
        parts.append(compiled)
        ttirs.append(ttir)
    else:
        tuned = call["autotuned_kernel_call"]
        name = tuned["configs"][0]["kernel_call"]["kernel"].get("kernel_name", "triton") if tuned["configs"] else \
            "triton"
        parts.append(f"autotuned: {tuned.get('name')!r} aliases {tuned['input_output_aliases']}")
        for config in tuned["configs"]:
            compiled, ttir = _normalised_triton_call(config["kernel_call"])
            parts.append(f"config {config.get('description')!r}:\n{compiled}")
            ttirs.append(f"config {config.get('description')!r}:\n{ttir}")
    return name, "backend_config", "\n".join(parts), None, {"ttir": "\n".join(ttirs)}


DECODERS = {"tpu_custom_call": _tpu_kernel, "mosaic_gpu": _mosaic_gpu_kernel, "mosaic_gpu_v2": _mosaic_gpu_kernel,
            "triton_kernel_call": _triton_kernel_call}


def normalise(module_text):
    """(the module around the kernels, {kernel key: normalised text}, {informational key: text}, [notes]): see
    the module docstring."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager

    ctx = mlir.make_ir_context()
    kernels, informational, notes, seen = {}, {}, [], {}
    with ctx, ir.Location.unknown():
        module = ir.Module.parse(module_text)
        calls = []

        def visit(op):
            if op.name == "stablehlo.custom_call":
                calls.append(op)
            return ir.WalkResult.ADVANCE
        module.operation.walk(visit)
        for op in calls:
            target = ir.StringAttr(op.attributes["call_target_name"]).value
            if target not in DECODERS:
                continue
            name, attr, text, note, extra = DECODERS[target](op, ir, mlir, PassManager)
            seen[name] = seen.get(name, 0) + 1
            key = name if seen[name] == 1 else f"{name}#{seen[name]}"
            kernels[key] = f"target: {target}\n{text}"
            for suffix, body in (extra or {}).items():
                informational[f"{key}.{suffix}"] = body
            if note:
                notes.append(f"{key}: {note}")
            op.attributes[attr] = ir.StringAttr.get(f"<{target} {key}>")
        return module.operation.get_asm(enable_debug_info=False), kernels, informational, notes


RESIDUE = re.compile(r"[\w./-]*\.py\b|\bloc\(|#loc\d*\b")


def residue(text, trees):
    """What in a normalised text still looks like a source location."""
    found = set(RESIDUE.findall(text))
    found |= {t for t in trees if t and t in text}
    return sorted(found)


# ----------------------------------------------------------------------------------------------------- the run

class Launches:
    """Records the arguments of each jax_triton.triton_call while tracing (num_stages is in no custom call)."""

    def __init__(self):
        self.calls, self.installed = [], False
        try:
            import jax_triton
        except Exception:
            return
        original = jax_triton.triton_call

        def recording(*args, **kwargs):
            self.calls.append(self.describe(kwargs))
            return original(*args, **kwargs)
        jax_triton.triton_call = recording
        self.installed = True

    @staticmethod
    def describe(kwargs):
        def plain(x):
            if isinstance(x, (bool, int, float, str, type(None))):
                return x
            if isinstance(x, (tuple, list)):
                return [plain(y) for y in x]
            if isinstance(x, dict):
                return {str(k): plain(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
            if hasattr(x, "shape") and hasattr(x, "dtype"):
                return f"{tuple(x.shape)}:{x.dtype}"
            fn = getattr(x, "fn", x)  # a triton JITFunction wraps the Python function
            return getattr(fn, "__qualname__", getattr(fn, "__name__", type(x).__name__))
        return {k: plain(v) for k, v in sorted(kwargs.items())}

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def tree_commit(tree):
    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except Exception:
            return None
    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(tree).resolve():  # a copy without git, inside another checkout
        return {"commit": None, "nsa_dirty": None}
    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", "nsa")
    return {"commit": head, "nsa_dirty": bool(status) if status is not None else None}


def run(args):
    tree = Path(args.tree).resolve() if args.tree else REPO
    sys.path.insert(0, str(tree))
    import jax
    import jaxlib
    import nsa

    if not Path(nsa.__file__).resolve().is_relative_to(tree):
        sys.exit(f"nsa imported from {nsa.__file__}, not from --tree {tree}")
    implementations = args.implementations.split(",") if args.implementations else (
        ["pallas"] if args.platform == "tpu" else ["pallas", "triton"])
    launches = Launches()
    skipped = {}
    if "triton" in implementations and not launches.installed:
        implementations.remove("triton")
        skipped["triton"] = "jax_triton does not import here (it lowers Triton kernels only on a GPU machine)"
    lengths = tuple(int(t) for t in args.lengths.split(","))
    cases = make_cases(lengths, implementations)
    if args.cases:
        cases = [c for c in cases if re.search(args.cases, c[0])]
    dump = Path(args.dump) if args.dump else None
    trees = [str(tree), str(REPO), str(Path(nsa.__file__).resolve().parent)]
    fingerprints, informational, summary_cases, residues, errors, all_notes = {}, {}, {}, {}, {}, []
    start = time.perf_counter()
    for name, fn, specs, argnums in cases:
        t0 = time.perf_counter()
        f = fn if argnums is None else gradient(fn, argnums)
        try:
            text = lower(f, specs, args.platform)
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
            for t in trees:
                message = message.replace(t, "<tree>")
            errors[name] = message.splitlines()[0][:300]
            fingerprints[f"{name}/error"] = sha(message)
            print(f"{name}: {errors[name]}", flush=True)
            launches.take()
            continue
        hlo, kernels, extra, notes = normalise(text)
        entries = {"hlo": hlo, **kernels}
        calls = launches.take()
        if calls:
            entries["triton_launches"] = json.dumps(calls, indent=1, sort_keys=True)
        all_notes += [f"{name}/{n}" for n in notes]
        for key, body in [*entries.items(), *extra.items()]:
            (fingerprints if key in entries else informational)[f"{name}/{key}"] = sha(body)
            found = residue(body, trees)
            if found:
                residues[f"{name}/{key}"] = found[:20]
            if dump:
                path = dump / name / (re.sub(r"[^\w.#-]", "_", key) + ".txt")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(body)
        summary_cases[name] = {"kernels": sorted(kernels), "lower_s": round(time.perf_counter() - t0, 2),
                               "raw_sha256": sha(text)}
        print(f"{name}: {len(kernels)} kernels ({', '.join(kernels)}) in {time.perf_counter() - t0:.1f} s",
              flush=True)
    result = {
        "meta": {"platform": args.platform, "implementations": implementations, "skipped": skipped,
                 "lengths": list(lengths), "shape": dict(B=B, HQ=HQ, H=H, D=D, dtype="bfloat16", block_size=BLOCK,
                                                         block_counts=COUNTS, window_size=WINDOW,
                                                         decode_kv=DECODE_KV),
                 "tree": str(tree), **tree_commit(tree), "nsa_file": str(Path(nsa.__file__).resolve()),
                 "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": sys.version.split()[0],
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "seconds": round(time.perf_counter() - start, 1)},
        "summary": {"cases": len(cases), "lowered": len(summary_cases), "entries": len(fingerprints),
                    "errors": errors, "residue": residues, "notes": all_notes, "per_case": summary_cases},
        "fingerprints": dict(sorted(fingerprints.items())),
        "informational": dict(sorted(informational.items())),
    }
    text = json.dumps(result, indent=1) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(f"{len(summary_cases)}/{len(cases)} cases lowered, {len(fingerprints)} fingerprints, {len(errors)} errors, "
          f"{len(residues)} entries with location residue, {result['meta']['seconds']} s"
          + (f" -> {args.out}" if args.out else ""))


def compare(a_path, b_path):
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    for key in ("platform", "jax", "jaxlib", "lengths", "implementations"):
        if a["meta"].get(key) != b["meta"].get(key):
            print(f"note: {key} differs: {a['meta'].get(key)} vs {b['meta'].get(key)}")
    fa, fb = a["fingerprints"], b["fingerprints"]
    differ = sorted(k for k in fa.keys() & fb.keys() if fa[k] != fb[k])
    only_a, only_b = sorted(fa.keys() - fb.keys()), sorted(fb.keys() - fa.keys())
    for k in differ:
        print(f"differs: {k}")
    for k in only_a:
        print(f"only in {a_path}: {k}")
    for k in only_b:
        print(f"only in {b_path}: {k}")
    ca, cb = a["summary"]["per_case"], b["summary"]["per_case"]
    raw = [c for c in ca.keys() & cb.keys() if ca[c].get("raw_sha256") != cb[c].get("raw_sha256")]
    print(f"the exported modules as they are (locations and all) differ in {len(raw)} of {len(ca.keys() & cb.keys())}"
          " cases")
    ia, ib = a.get("informational", {}), b.get("informational", {})
    notes = sorted(k for k in ia.keys() | ib.keys() if ia.get(k) != ib.get(k))
    for k in notes:
        print(f"note: {k} differs (informational, not the compiled code: does not fail the comparison)")
    same = len(fa.keys() & fb.keys()) - len(differ)
    print(f"{a['meta'].get('commit')} ({a_path}) vs {b['meta'].get('commit')} ({b_path}): {same} equal, "
          f"{len(differ)} differ, {len(only_a)} + {len(only_b)} on one side only")
    return 1 if differ or only_a or only_b else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--platform", default="tpu", choices=["tpu", "cuda"])
    parser.add_argument("--implementations", help="comma-separated (default: pallas on tpu, pallas,triton on cuda)")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated sequence lengths")
    parser.add_argument("--cases", help="a regular expression: only the cases whose names match it")
    parser.add_argument("--tree", help="import nsa from this checkout (default: the one holding this script)")
    parser.add_argument("--out", help="write the fingerprints (JSON) here")
    parser.add_argument("--dump", help="write each normalised text to DIR/<case>/<entry>.txt")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files and exit")
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    run(args)


if __name__ == "__main__":
    main()
