#!/usr/bin/env bash
# Everything nsa runs on the GPU, in one call: the gpu-marked tests, then the benchmark.
#   scripts/gpu.sh [tests|bench|pallas|decode|ops|trace|packing|sanitize|all] [extra benchmark args...]
# (pallas: scripts/pallas_gpu_check.py and gpu_check_select.py, the Mosaic GPU kernels op by op, each under
#  PALLAS_TIMEOUT seconds (default 400); its args name the ops)
# (decode: benchmarks/decode.py, one decode step over a KV cache, with its own args;
#  ops: benchmarks/ops.py, the time of each op of the pipeline, with its own args, e.g. --sweep;
#  trace: benchmarks/trace.py, the device time of each op kernel by kernel;
#  packing: benchmarks/packing.py, selected attention with TB tokens per tile on random and local selections;
#  sanitize: scripts/gpu_hostile.py, every kernel on hostile inputs, under compute-sanitizer's memcheck;
#  its args, e.g. --cache for the KV-cache cases only, --pallas for the Mosaic GPU kernels)
# tests: PYTEST_ARGS (e.g. "-k 'selected and G1'") selects among the gpu tests; JOBS (default 4) pytest
# processes run them side by side on the one GPU.
# Installs the carried wheels (.whl/: jax-triton 0.3.1, fla-core) into /tmp/site first (scripts/gpu_env.sh). Through
# the device tool: run(command="bash scripts/gpu.sh all", carry=[".whl"]). Results go to $OUT (or
# benchmarks/results when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
out=${OUT:-benchmarks/results}
mkdir -p "$out"
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import jax, jax_triton, triton; print("jax", jax.__version__, "jax_triton", jax_triton.__version__, "triton", triton.__version__, jax.devices())'
status=0
if [[ $what == tests || $what == all ]]; then
    # JOBS pytest processes share the GPU, each on every JOBS-th test (Triton compiles on the CPU).
    jobs=${JOBS:-4}
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    eval "python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only ${PYTEST_ARGS:-}" | grep '::' > /tmp/gpu-tests.txt
    echo "$(wc -l < /tmp/gpu-tests.txt) gpu tests in $jobs processes"
    # each process's log and junit xml under /tmp/gpu-tests, then two files in $out (the device tool brings
    # back at most 8): the logs one after another, and all of it as a tarball
    rm -rf /tmp/gpu-tests && mkdir -p /tmp/gpu-tests
    for ((j = 0; j < jobs; j++)); do
        awk -v j=$j -v n=$jobs 'NR % n == j' /tmp/gpu-tests.txt > /tmp/gpu-tests-$j.txt
        mapfile -t ids < /tmp/gpu-tests-$j.txt
        python3 -m pytest -q -p no:cacheprovider -rf --junitxml="/tmp/gpu-tests/$j.xml" "${ids[@]}" \
            > "/tmp/gpu-tests/$j.log" 2>&1 &
    done
    for ((j = 0; j < jobs; j++)); do wait -n || status=1; done
    cat /tmp/gpu-tests/*.log > "$out/gpu-tests.log"
    tar czf "$out/gpu-tests.tgz" -C /tmp gpu-tests
    tail -q -n 15 /tmp/gpu-tests/*.log
fi
if [[ $what == bench || $what == all ]]; then
    python3 benchmarks/gpu.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | grep -v '^{'
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == pallas ]]; then  # the Mosaic GPU kernels' quick checks, each op in its own process
    for op in ${@:-window compressed selected select attention checkpoint time}; do
        check=scripts/pallas_gpu_check.py
        [[ $op == select ]] && check=scripts/gpu_check_select.py  # the selections, row by row
        timeout ${PALLAS_TIMEOUT:-400} python3 $check "$op" > "$out/pallas-$op.log" 2>&1 || status=1
        grep -E "^(ok|FAIL|ERR|T=|     File|[0-9]+ of)" "$out/pallas-$op.log" | cut -c1-400
    done
fi
if [[ $what == decode ]]; then
    python3 benchmarks/decode.py --out "$out" "$@" 2>&1 | tee "$out/decode.log" | grep -v '^{'
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == trace ]]; then
    python3 -m benchmarks.trace --out "$out" "$@" 2>&1 | tee "$out/trace.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == sanitize ]]; then
    # XLA's GPU compiles crawl under the sanitizer: a first pass without it fills jax's persistent
    # compilation cache and Triton's, so that the second, under memcheck with only nsa's Triton kernels
    # (named _..._kernel) instrumented, compiles nothing (gpu_hostile runs the reference on the CPU).
    export XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS=--xla_gpu_autotune_level=0 \
        JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
    start=$SECONDS
    python3 scripts/gpu_hostile.py --quick "$@" > "$out/sanitize-warm.log" 2>&1 || status=1
    echo "warm pass (no sanitizer): $((SECONDS - start)) s, $(tail -n 1 "$out/sanitize-warm.log")"
    compute-sanitizer --tool memcheck --error-exitcode 99 --kernel-name kns=_kernel \
        python3 scripts/gpu_hostile.py --quick "$@" 2>&1 | tee "$out/sanitize.log" | grep -v '^ok '
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    echo "sanitized pass: $((SECONDS - start)) s in all"
fi
if [[ $what == packing ]]; then
    python3 -m benchmarks.packing --out "$out" "$@" 2>&1 | tee "$out/packing.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if [[ $what == ops ]]; then
    python3 -m benchmarks.ops --out "$out" "$@" 2>&1 | tee "$out/ops.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
exit $status
