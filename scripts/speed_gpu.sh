#!/usr/bin/env bash
# Training speed on the H200 (issue 25), in device calls of at most 600 s each, all in one lease:
#   run(command="bash scripts/speed_gpu.sh bench 65536", carry=[".whl", ".peers"])
#       benchmarks/gpu.py at one T (one call each: every row of one T takes most of a call): selection (random
#       indices), selection_local, full (iid inputs), full_local, full_nowin and window, with nsa's Triton, Mosaic GPU
#       and implementation=None rows, dense cuDNN (its own sliding window for window), fla, and mdy666's NSA (timed
#       in its own process first: .peers is ../shared/peers copied, ignored by git); writes $OUT/gpu-<T>.json.
#       CASES and IMPLS narrow a call. Then, on the CPU machine:
#       python benchmarks/gpu.py --merge gpu-8192.json gpu-16384.json gpu-65536.json --out benchmarks/results/...
#   run(command="bash scripts/speed_gpu.sh trace 8192 65536", carry=[".whl"])
#       benchmarks/trace.py: every op and the whole attention kernel by kernel, Triton and implementation=None
#       (OPS narrows the ops): the before and after of a kernel change.
#   run(command="bash scripts/speed_gpu.sh dq 8192 65536", carry=[".whl"])
#       benchmarks/packing.py --dq: selected attention's dq alone, Triton's kernel against Mosaic GPU's, on random,
#       iid and local selections (the break-even of nsa.pallas.gpu.selected.PACKED_DQ); writes $OUT/packing-dq-*.json.
# .whl holds the jax-triton 0.3.1 and fla-core 0.6.0 wheels (scripts/gpu.sh says how to fetch them).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:?bench, trace or dq}; shift
out=${OUT:-/tmp/speed}; mkdir -p "$out"
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git rev-parse HEAD 2>/dev/null || true
status=0
if [[ $what == bench ]]; then
    for T in "$@"; do
        mkdir -p "/tmp/speed-$T"
        timeout ${BENCH_TIMEOUT:-570} python3 benchmarks/gpu.py --out "/tmp/speed-$T" --seq-lens "$T" \
            --cases ${CASES:-selection selection_local full full_local full_nowin window} \
            --impls ${IMPLS:-triton pallas auto} --iters 10 --mdy .peers/mdy_side.py 2>&1 \
            | tee "$out/bench-$T.log" | grep -v '^{'
        [[ ${PIPESTATUS[0]} == 0 ]] || status=1
        cp "/tmp/speed-$T/gpu.json" "$out/gpu-$T.json" 2>/dev/null || status=1
    done
fi
if [[ $what == trace ]]; then
    for impl in triton auto; do
        timeout 250 python3 -m benchmarks.trace --out "$out" --seq-lens "$@" --impl $impl --iters 3 \
            ${OPS:+--ops $OPS} 2>&1 | tee -a "$out/trace.log" | grep -v '^WARNING'
        [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    done
fi
if [[ $what == dq ]]; then
    timeout 500 python3 -m benchmarks.packing --dq --out "$out" --seq-lens "$@" --iters 10 2>&1 | tee "$out/dq.log" \
        | grep -v '^WARNING'
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
exit $status
