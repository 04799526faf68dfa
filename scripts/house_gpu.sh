#!/usr/bin/env bash
# The house refactor's check on the H200, in one device call (issue 23): the compiled kernels against the old tree's
# (scripts/same_code.py, Mosaic GPU and Triton, old fingerprints in benchmarks/results/same-code/), side by side with
# every gpu-marked test in JOBS processes, each stopped at DEADLINE seconds (the device tool stops a call at 600 s):
# their -v logs say which tests passed, failed or never ran.
#   run(command="bash scripts/house_gpu.sh", carry=[".whl"])      # .whl: jax_triton-0.3.1 wheel
# IMPLS (default "triton pallas") picks same_code's families, TESTS (default: every gpu test) the test files.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/house}; mkdir -p "$out"
jobs=${JOBS:-12}; deadline=${DEADLINE:-480}
source scripts/gpu_env.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import jax, jax_triton, triton; print("jax", jax.__version__, "jax_triton", jax_triton.__version__, "triton", triton.__version__)'
git rev-parse HEAD 2>/dev/null || true
old=benchmarks/results/same-code
( for impl in ${IMPLS:-triton pallas}; do
    want=$old/old-5a425d0-$([[ $impl == triton ]] && echo triton || echo cuda)-h200.json
    python3 scripts/same_code.py --platform cuda --implementations $impl --out "$out/new-$impl-h200.json" \
        > "$out/same-code-$impl.log" 2>&1
    python3 scripts/same_code.py --compare "$want" "$out/new-$impl-h200.json" >> "$out/same-code-$impl.log" 2>&1
    echo "same_code $impl: exit $?" >> "$out/same-code-$impl.log"
  done ) &
python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only ${TESTS:-} | grep '::' > /tmp/gpu-tests.txt
echo "$(wc -l < /tmp/gpu-tests.txt) gpu tests in $jobs processes, stopped at $deadline s"
mkdir -p "$out/tests"
for ((j = 0; j < jobs; j++)); do
    awk -v j=$j -v n=$jobs 'NR % n == j' /tmp/gpu-tests.txt > /tmp/gpu-tests-$j.txt
    mapfile -t ids < /tmp/gpu-tests-$j.txt
    timeout $deadline python3 -m pytest -v -p no:cacheprovider -rf "${ids[@]}" > "$out/tests/$j.log" 2>&1 &
done
wait
cat "$out"/tests/*.log > "$out/gpu-tests.log"; rm -rf "$out/tests"
echo "passed $(grep -c ' PASSED' "$out/gpu-tests.log"), failed $(grep -c ' FAILED' "$out/gpu-tests.log"), errors $(grep -c ' ERROR' "$out/gpu-tests.log"), of $(wc -l < /tmp/gpu-tests.txt)"
grep -E ' (FAILED|ERROR)' "$out/gpu-tests.log" | sort -u | head -40
tail -n 4 "$out"/same-code-*.log
