#!/usr/bin/env bash
# Issue 21 item 4 on a CUDA host: the kernels compile for every target arch (and run on this
# one), a missing NVRTC builtins library is named with its fix, and the prefill host's doctor.
#
#   tests/gpu/arch_check.sh BIN_DIR    (BIN_DIR: a prebuilt `gpu` test binary and wheels/)
cd "$(dirname "$0")/../.."
. tests/gpu/libpath.sh
bin=$1
rc=0
for t in kernels_compile_for_every_target_arch a_missing_nvrtc_builtins_library_is_named_with_its_fix tiny_layers_match_cpu; do
    "$bin/gpu" --exact "$t" --nocapture --test-threads=1 || rc=1
done
# The builtins library hidden for real: NVRTC finds it through the loader cache here, so the
# child test runs in a private mount namespace (root) with every directory holding it masked and
# a copy of libnvrtc alone on LD_LIBRARY_PATH.
if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null; then
    hide=$( { ldconfig -p | sed -n 's/.*libnvrtc-builtins[^>]*=> \(.*\)\/[^/]*$/\1/p'; \
              for d in ${LD_LIBRARY_PATH//:/ }; do ls "$d"/libnvrtc-builtins* >/dev/null 2>&1 && echo "$d"; done; } | xargs -r -n1 readlink -f | sort -u)
    nvrtc=$(for d in ${LD_LIBRARY_PATH//:/ }; do ls "$d"/libnvrtc.so.13 2>/dev/null; done | head -1)
    alone=$(mktemp -d)
    cp "$nvrtc" "$alone/libnvrtc.so" && cp "$nvrtc" "$alone/libnvrtc.so.13"
    echo "hiding libnvrtc-builtins in: $hide"
    HIDE="$hide" ALONE="$alone" BIN="$bin" unshare -m sh -c '
        for d in $HIDE; do mount -t tmpfs tmpfs "$d" || exit 1; done
        PD_BRIDGE_CHILD_NO_BUILTINS=1 LD_LIBRARY_PATH="$ALONE" exec "$BIN/gpu" --exact a_missing_nvrtc_builtins_library_is_named_with_its_fix --nocapture --test-threads=1' || rc=1
else
    echo "SKIPPED: hiding the builtins library needs root and unshare"
fi
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$site" "$bin"/wheels/pd_bridge_vllm-*.whl || rc=1
weights=()
[ -d "$bin/weights" ] && weights=(--weights "$bin/weights")
# A host without vLLM yet (the lent H200 before the kit is installed): the rest is still checked.
python3 -c "import vllm" 2>/dev/null || weights+=(--no-vllm)
PYTHONPATH="$site" python3 -m pd_bridge_vllm.doctor doctor "${weights[@]}" --port 7188 || rc=1
exit $rc
