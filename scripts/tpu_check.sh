#!/usr/bin/env bash
# nsa's Pallas TPU kernels compiled and run on a real TPU (one call of the device tool, kind tpu-v5e):
#   run(command="bash scripts/tpu_check.sh", kind="tpu-v5e")
# PARTS (default "ops hostile bench") picks, in this order:
#   ops      scripts/tpu_ops.py (each op alone, plain and packed, forward and gradients, and a decode step);
#   hostile  scripts/gpu_hostile.py --pallas (every case on hostile inputs, bfloat16, against the XLA reference on
#            the host's CPU: on a TPU, implementation="pallas" is Mosaic TPU) in its --resident (G = 16: the
#            resident training kernels), quick, --cache, --paged and --overlap sets (SETS), each under CASE_TIMEOUT s;
#   decode   benchmarks/decode.py: one decode step over a contiguous and a paged KV cache, nsa's Pallas and XLA
#            against XLA's dense decode, DECODE_ARGS (default B = 1 and 8 at 16k and 64k), bound at the datasheet's
#            bandwidth;
#   ab       the same decode benchmark (AB_ARGS, default B = 8) in each earlier tree of .ab/ (ignored by git:
#            mkdir -p .ab/NAME && git archive <commit> nsa $(git ls-files 'benchmarks/*.py') | tar -x -C .ab/NAME;
#            carry [".ab"]; AB_TREES names some), so that this tree's step is compared with theirs on the same chip;
#   trace    each kernel's device time in one decode step (benchmarks/decode.py --trace, TRACE_ARGS);
#   probe    scripts/tpu_resident_probe.py (selected attention alone, the resident kernels piece by piece), PROBE_ARGS
#            (default: the table row and base, random and local selections at 8k), in this tree, then with
#            PROBE_TREE_ARGS (default: base) in each tree of .ab named by PROBE_TREES (default none);
#   profile  benchmarks/trace.py --impl pallas --hlo (PROFILE_ARGS, default: nsa.attention's fwd+bwd at 8k): each
#            kernel's and XLA op's device time, and the optimized HLO that names them;
#   memory   scripts/tpu_memory_probe.py (MEMORY_ARGS, default: full at 16k and 64k; compiles only): the buffer
#            assignment's peak, the largest arrays as the chip stores them (tiles' padding), the residuals of
#            nsa.attention's fwd+bwd and the arrays live at its peak, beside splash's, in this tree, then in each
#            tree of .ab named by MEMORY_TREES (default none);
#   bench    benchmarks/tpu.py, BENCH_ARGS (default: its default cases at 8192 tokens, 5 iterations), its JSON and
#            table written after each length (a run cut by BENCH_TIMEOUT keeps the lengths it finished).
# Logs and JSON in /tmp/tpu-check, packed at exit into $OUT/tpu-check.tgz (the device tool brings back 8 files at
# most: one run's logs and JSON outnumber that); without OUT, into benchmarks/results/tpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
out=/tmp/tpu-check
rm -rf "$out" && mkdir -p "$out"
if [[ -n ${OUT:-} ]]; then
    trap 'tar czf "$OUT/tpu-check.tgz" -C /tmp tpu-check' EXIT
else
    trap 'mkdir -p benchmarks/results/tpu-check && cp -r "$out"/. benchmarks/results/tpu-check/' EXIT
fi
parts=" ${PARTS:-ops hostile bench} "
python3 -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
status=0
if [[ $parts == *" ops "* ]]; then
    timeout "${OPS_TIMEOUT:-200}" python3 scripts/tpu_ops.py 2>&1 | tee "$out/tpu-ops.log" | grep -E '^(ok|FAILED|MISMATCH)'
fi
if [[ $parts == *" hostile "* ]]; then
    for set in ${SETS:---resident --quick --cache --paged --overlap}; do
        start=$SECONDS
        timeout "${CASE_TIMEOUT:-150}" python3 scripts/gpu_hostile.py --pallas $set > "$out/hostile${set}.log" 2>&1 || status=1
        echo "hostile $set: $((SECONDS - start)) s, $(grep -c '^ok' "$out/hostile${set}.log") ok, $(grep -c '^MISMATCH' "$out/hostile${set}.log") mismatches, last: $(grep -E 'mismatches|Error' "$out/hostile${set}.log" | tail -1 | cut -c1-300)"
    done
fi
if [[ $parts == *" decode "* ]]; then
    timeout "${DECODE_TIMEOUT:-200}" python3 benchmarks/decode.py --out "$out" --name decode-tpu \
        ${DECODE_ARGS:---batches 1 8 --contexts 16384 65536 --long --impls pallas xla --dense xla --no-fla --paged 64 --iters 5} \
        > "$out/decode-tpu.log" 2>&1 || status=1
    grep -v '^{' "$out/decode-tpu.log" | tail -16
fi
if [[ $parts == *" ab "* ]]; then  # the decode step of each earlier tree in .ab/ (git archive <commit> nsa benchmarks)
    for name in ${AB_TREES:-$(ls .ab)}; do
        tree=.ab/$name
        (cd "$tree" && timeout "${DECODE_TIMEOUT:-200}" python3 benchmarks/decode.py --out "$out" --name "decode-tpu-$name" \
            ${AB_ARGS:---batches 8 --contexts 16384 65536 --long --impls pallas --dense --no-fla --paged 64 --iters 5} \
            > "$out/decode-tpu-$name.log" 2>&1) || status=1
        echo "=== $name"; grep -E '^\| [0-9]' "$out/decode-tpu-$name.log"
    done
fi
if [[ $parts == *" trace "* ]]; then  # each kernel's device time in one decode step
    timeout "${TRACE_TIMEOUT:-120}" python3 benchmarks/decode.py --out "$out" --name decode-tpu --trace --impls pallas \
        ${TRACE_ARGS:---batches 8 --contexts 16384 --long} --iters 5 > "$out/decode-tpu-trace.log" 2>&1 || status=1
    head -n 30 "$out/decode-tpu-trace.log" | cut -c1-160
fi
if [[ $parts == *" probe "* ]]; then  # selected attention alone, here and in each earlier tree of .ab/ named
    for tree in . ${PROBE_TREES:-}; do
        [[ $tree == . ]] && name=main && args=${PROBE_ARGS:---variants base --selections random local} \
            || { name=$tree && tree=.ab/$tree && args=${PROBE_TREE_ARGS:---variants base --selections random local}; }
        mkdir -p "$out/probe-$name"
        (cd "$tree" && timeout "${PROBE_TIMEOUT:-200}" python3 scripts/tpu_resident_probe.py --out "$out/probe-$name" \
            $args > "$out/probe-$name.log" 2>&1) || status=1
        echo "=== probe $name"; grep '^{' "$out/probe-$name.log" | cut -c1-230
    done
fi
if [[ $parts == *" profile "* ]]; then  # where nsa.attention's device time goes, with the HLO naming each event
    timeout "${PROFILE_TIMEOUT:-150}" python3 -m benchmarks.trace --out "$out" --impl pallas --hlo \
        ${PROFILE_ARGS:---ops attention --seq-lens 8192 --iters 3} > "$out/profile.log" 2>&1 || status=1
    grep -v '^{' "$out/profile.log" | grep -E '^ +[0-9]|T=' | head -n 40 | cut -c1-160
fi
if [[ $parts == *" memory "* ]]; then  # the fwd+bwd's memory (compiles only), here and in each tree of .ab named
    for tree in . ${MEMORY_TREES:-}; do
        name=$([[ $tree == . ]] && echo main || echo "$tree"); dir=$([[ $tree == . ]] && echo . || echo ".ab/$tree")
        mkdir -p "$out/memory-$name"
        (cd "$dir" && timeout "${MEMORY_TIMEOUT:-200}" python3 scripts/tpu_memory_probe.py --out "$out/memory-$name" \
            ${MEMORY_ARGS:---seq-lens 16384 65536} > "$out/memory-$name.log" 2>&1) || status=1
        echo "=== memory $name"; grep -v '^{' "$out/memory-$name.log" | grep -v Warning | head -n 200 | cut -c1-160
        grep '^{' "$out/memory-$name.log" | cut -c1-200
    done
fi
if [[ $parts == *" bench "* ]]; then
    timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/tpu.py --out "$out" ${BENCH_ARGS:---seq-lens 8192 --iters 5} \
        > "$out/tpu-bench.log" 2>&1 || status=1
    grep -v '^{' "$out/tpu-bench.log" | tail -40
    [[ -f $out/tpu.md ]] && tail -n +3 "$out/tpu.md"
fi
exit $status
