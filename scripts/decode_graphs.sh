#!/usr/bin/env bash
# The decode step with and without XLA's command buffers (CUDA graphs) around nsa's Triton launches.
#   run(command="bash scripts/decode_graphs.sh", carry=[".whl"])
# jax-triton lowers each kernel to the legacy custom call `triton_kernel_call`, which XLA leaves out of its
# command buffers unless --legacy_command_buffer_custom_call_targets names it; WHILE and CONDITIONALS let the
# benchmark's fori_loop itself run inside one graph. Each setting in its own process (XLA_FLAGS are read
# once); results in $OUT/<setting>/decode-graphs.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results}
GRAPHS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONALS,WHILE"
declare -A SETTINGS=(
    [default]=""
    [graphs]="$GRAPHS --legacy_command_buffer_custom_call_targets=triton_kernel_call"
)
status=0
for name in default graphs; do
    echo "=== $name: XLA_FLAGS=${SETTINGS[$name]}"
    XLA_FLAGS="${SETTINGS[$name]}" OUT="$out/$name" bash scripts/gpu.sh decode --name decode-graphs \
        --no-fla --dense cudnn --impls triton "$@" || status=1
done
exit $status
