#!/usr/bin/env bash
# The decode step A/B in one GPU call: this tree's nsa against earlier commits', the same shapes in the same
# session, then this tree's under XLA command buffers (CUDA graphs) with jax-triton's custom call captured.
#   mkdir -p .ab/NAME && git archive <commit> nsa $(git ls-files 'benchmarks/*.py') | tar -x -C .ab/NAME
#   (here, once per earlier tree; .ab is ignored), then run(command="bash scripts/decode_ab.sh", carry=[".whl", ".ab"])
# Results: $OUT/{new,NAME...,graphs}/decode-*.json; any args go to benchmarks/decode.py (default: B = 1, 16, 64 at
# TK = 65536, nsa-triton only).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
args=("$@")
[[ ${#args[@]} == 0 ]] && args=(--batches 1 16 64 --contexts 65536 --long --impls triton --dense --no-fla)
GRAPHS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONALS,WHILE"
GRAPHS="$GRAPHS --legacy_command_buffer_custom_call_targets=triton_kernel_call"
status=0
echo "=== new: $(git log --oneline -1 2>/dev/null || echo this tree)"
OUT="$out/new" bash scripts/gpu.sh decode --name decode-new "${args[@]}" || status=1
for tree in .ab/*/; do
    name=$(basename "$tree")
    echo "=== $name: $tree"
    mkdir -p "$out/$name"  # benchmarks/decode.py writes its JSON there and makes no folder
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/decode.py --out "$out/$name" --name "decode-$name" \
        "${args[@]}" 2>&1 | grep -v '^{') || status=1
done
if [[ -z ${NO_GRAPHS:-} ]]; then  # NO_GRAPHS=1: the trees only
    echo "=== graphs: XLA_FLAGS=$GRAPHS"
    XLA_FLAGS="$GRAPHS" OUT="$out/graphs" bash scripts/gpu.sh decode --name decode-graphs "${args[@]}" || status=1
fi
exit $status
