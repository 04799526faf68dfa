#!/usr/bin/env bash
# nsa's Pallas TPU kernels compiled and run on a real TPU (one call of the device tool, kind tpu-v5e):
#   run(command="bash scripts/tpu_check.sh", kind="tpu-v5e")
# scripts/tpu_ops.py (each op alone, plain and packed, forward and gradients, and a decode step), then
# scripts/gpu_hostile.py --pallas (every case on hostile inputs, bfloat16, against the XLA reference on the host's
# CPU: on a TPU, implementation="pallas" is Mosaic TPU) in its quick, --cache, --paged and --overlap sets (SETS), then
# benchmarks/tpu.py at 8192 tokens. Logs in $OUT (default benchmarks/results/tpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/tpu-check}
mkdir -p "$out"
python3 -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
status=0
timeout "${OPS_TIMEOUT:-200}" python3 scripts/tpu_ops.py 2>&1 | tee "$out/tpu-ops.log" | grep -E '^(ok|FAILED|MISMATCH)'
for set in ${SETS:---quick --cache --paged --overlap}; do
    start=$SECONDS
    timeout "${CASE_TIMEOUT:-150}" python3 scripts/gpu_hostile.py --pallas $set > "$out/hostile${set}.log" 2>&1 || status=1
    echo "hostile $set: $((SECONDS - start)) s, $(grep -c '^ok' "$out/hostile${set}.log") ok, $(grep -c '^MISMATCH' "$out/hostile${set}.log") mismatches, last: $(grep -E 'mismatches|Error' "$out/hostile${set}.log" | tail -1 | cut -c1-300)"
done
timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/tpu.py --out "$out" --seq-lens 8192 --iters 5 > "$out/tpu-bench.log" 2>&1 || status=1
grep -v '^{' "$out/tpu-bench.log" | tail -12
exit $status
