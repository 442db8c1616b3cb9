#!/usr/bin/env bash
# Run the GPU tests and the benchmark on a CUDA host.
#
#   tests/gpu/run.sh [BIN_DIR]
#
# BIN_DIR holds prebuilt `gpu` (the core's GPU test binary) and `bench_gpu`; without it they are
# built here with cargo (`--features cuda`). cudarc loads libcuda, libcublas and libnvrtc at run
# time; this script adds every directory that holds them (CUDA toolkit, or the nvidia-* pip
# wheels that torch brings) to LD_LIBRARY_PATH.
cd "$(dirname "$0")/../.."
. tests/gpu/libpath.sh
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
bin=${1:-}
if [ -z "$bin" ]; then
    cargo build -p pd-bridge-core --release --features cuda --example bench_gpu || exit 1
    mkdir -p target/gpubin/wheels
    for t in gpu gpu_capture; do
        exe=$(cargo test -p pd-bridge-core --release --features cuda --test $t --no-run 2>&1 | sed -n "s/.*(\(target[^)]*\/$t-[^)]*\)).*/\1/p" | tail -1)
        cp "$exe" target/gpubin/$t || exit 1
    done
    cp target/release/examples/bench_gpu target/gpubin/ || exit 1
    maturin build --release -m vllm_plugin/Cargo.toml -o target/gpubin/wheels || exit 1
    bin=target/gpubin
fi
rc=0
"$bin/gpu" --nocapture --test-threads=1 || rc=1
"$bin/gpu_capture" --nocapture --test-threads=1 || rc=1
# The capture engine through the vLLM wheel with torch CUDA tensors.
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$site" "$bin"/wheels/pd_bridge_vllm-*.whl || rc=1
PYTHONPATH="$site" python3 -m pytest -q -s -p no:cacheprovider tests/prefill/test_gpu_capture.py || rc=1
PD_BRIDGE_REPO=$PWD "$bin/bench_gpu" || rc=1
exit $rc
