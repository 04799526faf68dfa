#!/usr/bin/env bash
# The paper's compression on the H200 (issue 24), in device calls of at most 600 s each:
#   run(command="bash scripts/paper_gpu.sh check", carry=[".whl"])
#       every gpu-marked test in JOBS processes (stopped at DEADLINE s; their -v log says which passed) beside
#       compute-sanitizer's memcheck over the overlapping-compression cases of scripts/gpu_hostile.py
#       (--overlap: Triton in float32, then Mosaic GPU in bfloat16); TESTS (pytest arguments, e.g. test ids) narrows
#       the tests, SANITIZE (default "triton pallas"; empty: none) the families sanitized; a pass of both takes
#       up to 900 s, so a call with all the tests leaves it out (SANITIZE=) and sanitizes in a call of its own;
#   run(command="bash scripts/paper_gpu.sh bench 8192 16384 32768", carry=[".whl", ".peers"])
#       benchmarks/gpu.py's full, full_nowin, paper and paper_nowin rows (implementation=None) at those T, with
#       mdy666's NSA (.peers: ../shared/peers copied, ignored by git) timed in its own process first.
#   run(command="COMPRESSION='32 16' bash scripts/paper_gpu.sh profile 65536", carry=[".whl"])
#       where the time goes at compression (l, d) = COMPRESSION (default the paper's, 32 16; 64 64 to compare):
#       benchmarks/ops.py per op for the Triton and the Mosaic GPU families, then benchmarks/trace.py's
#       kernel-by-kernel device time of select and the whole attention (implementation=None).
# .whl holds the jax-triton 0.3.1 wheel (scripts/gpu.sh says how to fetch it). Results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:?check, bench or profile}; shift
out=${OUT:-/tmp/paper}; mkdir -p "$out"
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import jax, jax_triton, triton, torch; print("jax", jax.__version__, "jax_triton", jax_triton.__version__, "triton", triton.__version__, "torch", torch.__version__)'
git rev-parse HEAD 2>/dev/null || true
status=0
if [[ $what == check ]]; then
    jobs=${JOBS:-10}; deadline=${DEADLINE:-470}
    ( export XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS=--xla_gpu_autotune_level=0 \
          JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
          JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
      for impl in ${SANITIZE-triton pallas}; do  # a warm pass fills the caches, the sanitized one compiles nothing
          name=sanitize-$impl; flag=$([[ $impl == pallas ]] && echo --pallas)
          timeout 200 python3 scripts/gpu_hostile.py --quick --overlap $flag > "$out/$name-warm.log" 2>&1
          timeout 250 compute-sanitizer --tool memcheck --error-exitcode 99 --kernel-name kns=_kernel \
              python3 scripts/gpu_hostile.py --quick --overlap $flag > "$out/$name.log" 2>&1
          echo "$name: exit $?, $(grep -c '^ok' "$out/$name.log") ok, $(tail -n 1 "$out/$name.log")" >> "$out/sanitize-summary.log"
      done ) &
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only ${TESTS:-} | grep '::' > /tmp/gpu-tests.txt
    echo "$(wc -l < /tmp/gpu-tests.txt) gpu tests in $jobs processes, stopped at $deadline s"
    mkdir -p "$out/gpu-logs"  # written as the tests run: what finished comes back even if the call is cut off
    for ((j = 0; j < jobs; j++)); do
        awk -v j=$j -v n=$jobs 'NR % n == j' /tmp/gpu-tests.txt > /tmp/gpu-tests-$j.txt
        mapfile -t ids < /tmp/gpu-tests-$j.txt
        timeout $deadline python3 -m pytest -v -p no:cacheprovider -rf "${ids[@]}" > "$out/gpu-logs/$j.log" 2>&1 &
    done
    wait
    cat "$out"/gpu-logs/*.log > "$out/gpu-tests.log"
    echo "passed $(grep -c ' PASSED' "$out/gpu-tests.log"), failed $(grep -c ' FAILED' "$out/gpu-tests.log"), errors $(grep -c ' ERROR' "$out/gpu-tests.log"), of $(wc -l < /tmp/gpu-tests.txt)"
    grep -E ' (FAILED|ERROR)' "$out/gpu-tests.log" | sort -u | head -40
    cat "$out/sanitize-summary.log"
    grep -h -E 'MISMATCH|ERROR SUMMARY|Invalid|Error' "$out"/sanitize*.log | sort | uniq -c | head -20
fi
if [[ $what == bench ]]; then
    timeout ${BENCH_TIMEOUT:-580} python3 benchmarks/gpu.py --out "$out" --seq-lens "$@" --cases full full_nowin paper paper_nowin --impls auto \
        --no-dense --no-fla --iters 10 --mdy .peers/mdy_side.py 2>&1 | tee "$out/bench.log" | grep -v '^{'
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == profile ]]; then
    compression=${COMPRESSION:-32 16}
    for impl in triton pallas; do
        timeout 200 python3 -m benchmarks.ops --out "$out" --seq-lens "$@" --impl $impl --compression $compression \
            --iters 10 2>&1 | tee -a "$out/profile.log" | grep '^{'
        [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    done
    timeout 150 python3 -m benchmarks.trace --out "$out" --seq-lens "$@" --impl auto --compression $compression \
        --ops select attention --iters 3 2>&1 | tee -a "$out/profile.log" | grep -v '^WARNING'
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
exit $status
