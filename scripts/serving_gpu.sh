#!/usr/bin/env bash
# Issue 26's decode step (and issue 27's one-device overhead) on the H200, in device calls of at most 600 s each:
#   run(command="PARTS='context tests decode' bash scripts/serving_gpu.sh", carry=[".whl", ".ab"])
# Every log and JSON goes into $OUT/results.tgz (the device tool brings back 8 files at most), a summary into
# $OUT/summary.txt. PARTS (default "tests sanitize decode"), in this order, each under its own timeout so that a
# slow part leaves the others' results:
#   context   benchmarks/context_overhead.py at 64k: nsa.attention at P = 1 against the plain call (issue 27);
#   tests     the decode kernel tests (tests/test_triton_decode.py, every dtype) in JOBS processes;
#   sanitize  memcheck over gpu_hostile.py's KV-cache cases (--cache: decode select, the fused step) and paged
#             ragged steps (--paged);
#   decode    scripts/decode_ab.sh: this tree's decode step against the .ab/ trees' (and under XLA command buffers
#             where GRAPHS=1) at DECODE_ARGS (default B = 1, 16, 64 at 64k).
set -uo pipefail
cd "$(dirname "$0")/.."
parts=" ${PARTS:-tests sanitize decode} "
out=${OUT:-/tmp/serving}; mkdir -p "$out"
res=/tmp/serving-results; rm -rf "$res"; mkdir -p "$res"
trap 'tar czf "$out/results.tgz" -C /tmp serving-results' EXIT
summary="$out/summary.txt"
note() { echo "$*" | tee -a "$summary"; }
source scripts/gpu_env.sh
note "$(git log --oneline -1 2>/dev/null || echo this tree); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
status=0
if [[ $parts == *" context "* ]]; then
    start=$SECONDS
    timeout ${CONTEXT_TIMEOUT:-150} \
        python3 benchmarks/context_overhead.py --out $res/context > "$res/context.log" 2>&1 || status=1
    note "context overhead: $((SECONDS - start)) s"
    grep -E '^\|' "$res/context.log" | tee -a "$summary"
    tail -n 3 "$res/context.log" | grep -iE 'error|Killed' | cut -c1-300 | tee -a "$summary"
fi
if [[ $parts == *" tests "* ]]; then
    start=$SECONDS
    PYTEST_ARGS="tests/test_triton_decode.py" JOBS=${JOBS:-6} OUT=$res/tests \
        timeout ${TESTS_TIMEOUT:-220} bash scripts/gpu.sh tests > "$res/tests.log" 2>&1 || status=1
    note "tests: $((SECONDS - start)) s; $(grep -hE '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' $res/tests/gpu-tests.log 2>/dev/null | tr '\n' ' ')"
    grep -h "^FAILED" $res/tests/gpu-tests.log 2>/dev/null | head -20 | cut -c1-300 | tee -a "$summary"
fi
if [[ $parts == *" sanitize "* ]]; then
    for set in ${SANITIZE_SETS:-cache paged}; do
        start=$SECONDS
        OUT=$res/sanitize-$set timeout ${SANITIZE_TIMEOUT:-150} bash scripts/gpu.sh sanitize --$set > "$res/sanitize-$set.out" 2>&1 || status=1
        note "sanitize --$set: $((SECONDS - start)) s; $(grep -c '^ok' $res/sanitize-$set/sanitize.log 2>/dev/null) ok;" \
            "$(grep -hE 'ERROR SUMMARY|MISMATCH' $res/sanitize-$set/sanitize.log 2>/dev/null | sort | uniq -c | head -5 | tr '\n' ' ')"
    done
fi
if [[ $parts == *" decode "* ]]; then
    start=$SECONDS
    [[ ${GRAPHS:-0} == 1 ]] || export NO_GRAPHS=1
    OUT=$res/decode timeout ${DECODE_TIMEOUT:-200} bash scripts/decode_ab.sh \
        ${DECODE_ARGS:---batches 1 16 64 --contexts 65536 --long --impls triton --dense --no-fla} > "$res/decode.log" 2>&1 || status=1
    note "decode A/B: $((SECONDS - start)) s"
    grep -E '^(===|\| [0-9])' "$res/decode.log" | cut -c1-200 | tee -a "$summary"
fi
exit $status
