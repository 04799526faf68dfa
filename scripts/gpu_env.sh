# Sourced by the scripts that run on the GPU machine (scripts/*_gpu.sh, gpu.sh): the carried wheels (.whl/: jax-triton
# 0.3.1, fla-core; nothing installs there from the network) into /tmp/site, on PYTHONPATH before this tree; Python
# unbuffered; a writable Triton cache (fla's autotuner needs one). The wheels (ignored by git) are fetched on the CPU
# machine with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform any -d .whl jax-triton==0.3.1 fla-core==0.6.0
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
