#!/usr/bin/env bash
# Issue 26's decode step on the H200, in device calls of at most 600 s each; every log and JSON goes into
# $OUT/results.tgz (the device tool brings back 8 files at most) and a summary into $OUT/summary.txt:
#   run(command="bash scripts/serving_gpu.sh check", carry=[".whl"])
#       the decode kernel tests (tests/test_triton_decode.py, every dtype) on the GPU, then memcheck over
#       gpu_hostile.py's KV-cache cases (--cache: decode select, the fused step) and paged ragged steps (--paged)
#   run(command="bash scripts/serving_gpu.sh time", carry=[".whl", ".ab"])
#       scripts/decode_ab.sh (this tree against the .ab/ trees, then under command buffers) with --paged 64, and
#       benchmarks/context_overhead.py at 64k (issue 27: nsa.attention at P = 1 against the plain call)
# Each step runs under `timeout` so that one slow step leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:?check or time}; shift
out=${OUT:-/tmp/serving}; mkdir -p "$out"
res=/tmp/serving-results; rm -rf "$res"; mkdir -p "$res"
trap 'tar czf "$out/results.tgz" -C /tmp serving-results' EXIT
summary="$out/summary.txt"
note() { echo "$*" | tee -a "$summary"; }
note "$(git log --oneline -1 2>/dev/null || echo this tree) $(git status --short nsa | wc -l) changed files under nsa/"
status=0
if [[ $what == check ]]; then
    start=$SECONDS
    PYTEST_ARGS="tests/test_triton_decode.py" JOBS=${JOBS:-4} OUT=$res/tests \
        timeout ${TESTS_TIMEOUT:-280} bash scripts/gpu.sh tests > "$res/tests.log" 2>&1 || status=1
    note "tests: exit $? after $((SECONDS - start)) s; $(grep -hE '(passed|failed|error)' $res/tests/gpu-tests.log 2>/dev/null | grep -E '^[0-9=]' | tr '\n' ' ')"
    grep -h "^FAILED" $res/tests/gpu-tests.log 2>/dev/null | head -20 | tee -a "$summary"
    for set in cache paged; do
        start=$SECONDS
        OUT=$res/sanitize-$set timeout ${SANITIZE_TIMEOUT:-150} bash scripts/gpu.sh sanitize --$set > "$res/sanitize-$set.out" 2>&1 || status=1
        note "sanitize --$set: $((SECONDS - start)) s; $(grep -c '^ok' $res/sanitize-$set/sanitize.log 2>/dev/null) ok;" \
            "$(grep -hE 'ERROR SUMMARY|mismatch|FAIL' $res/sanitize-$set/sanitize.log $res/sanitize-$set.out 2>/dev/null | sort | uniq -c | head -5 | tr '\n' ' ')"
    done
fi
if [[ $what == time ]]; then
    start=$SECONDS
    OUT=$res/decode timeout ${DECODE_TIMEOUT:-330} bash scripts/decode_ab.sh --batches 1 16 64 --contexts 65536 --long \
        --impls triton --dense --no-fla --paged 64 "$@" > "$res/decode.log" 2>&1 || status=1
    note "decode A/B: $((SECONDS - start)) s"
    grep -vE '^\{|^$' "$res/decode.log" | grep -E '^(===|\||nsa|dense|B=)' | cut -c1-200 | tee -a "$summary"
    start=$SECONDS
    PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 timeout ${CONTEXT_TIMEOUT:-200} \
        python3 benchmarks/context_overhead.py --out $res/context > "$res/context.log" 2>&1 || status=1
    note "context overhead: $((SECONDS - start)) s"
    grep -E '^\|' "$res/context.log" | tee -a "$summary"
fi
exit $status
