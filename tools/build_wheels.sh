#!/usr/bin/env bash
# Build the release wheels for the machines users have, from one Linux x86_64 machine, and check
# them as far as this machine can:
#
#   pd-bridge-vllm  manylinux_2_28 x86_64       (vLLM hosts on x86)
#   pd-bridge-vllm  manylinux_2_28 aarch64      (DGX Spark: Grace CPU, GB10, CUDA 13)
#   pd-bridge-omlx  macosx_11_0 arm64           (the Macs that run oMLX)
#   pd-bridge-omlx  manylinux_2_28 x86_64       (the Linux tests)
#
#   bash tools/build_wheels.sh [OUT]            build all four into OUT, then check them
#   bash tools/build_wheels.sh --checks-only [OUT]   only check the wheels already in OUT
#                                                   (needs only python3 >= 3.11; CI uses it)
#
# Cross-compiling goes through `maturin --zig` (PyPI's ziglang: no SDK, no cross toolchain, glibc
# 2.28 symbols for manylinux_2_28). The vLLM wheels are built with the core's `cuda` feature on
# both architectures; cudarc loads the CUDA libraries at run time, so no CUDA toolkit is needed.
#
# Checks (any failure makes the exit status non-zero):
#   * manylinux: wheel tags, the extension's ELF machine, its libraries and glibc symbol versions;
#     both vLLM wheels carry the CUDA path (cudarc) and the same Python files;
#   * macOS: the omlx extension is an arm64 Mach-O, abi3-tagged, links only system libraries and
#     no libpython, has a valid ad-hoc code signature, and its Python files equal the Linux
#     omlx wheel's;
#   * aarch64: tools/wheel_smoke.py runs the aarch64 vLLM wheel under qemu-user with Debian's
#     arm64 Python 3.11 (a capture fed, segments digested, served over loopback and pulled by
#     the x86_64 omlx wheel into blocks), and its results must equal the x86_64 wheel's.
#
# State (tool venv, cargo target dir, the arm64 Python root) lives in $PD_BRIDGE_WHEELS_HOME,
# default .pd-bridge-wheels/ (ignored by git through its own .gitignore). Needs rustup and
# python3 >= 3.11; the qemu check needs apt (Debian/Ubuntu, root) unless qemu-aarch64 and the
# arm64 root are there already. PD_BRIDGE_WHEELS_SKIP_QEMU=1 skips that check (reported as such).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STATE=${PD_BRIDGE_WHEELS_HOME:-$ROOT/.pd-bridge-wheels}
PYTHON=${PYTHON:-python3}
CHECKS_ONLY=0
if [ "${1:-}" = "--checks-only" ]; then CHECKS_ONLY=1; shift; fi
OUT=${1:-$STATE/dist}
mkdir -p "$STATE" "$OUT"
OUT=$(cd "$OUT" && pwd)
[ -f "$STATE/.gitignore" ] || echo '*' >"$STATE/.gitignore"
# Our own target dir: never waits on (or disturbs) a developer's cargo in target/.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$STATE/target}
VENV=$STATE/venv-tools
TOOL_REQS=("maturin>=1.9.4,<2" "ziglang")
MANYLINUX=manylinux_2_28
RUST_TARGETS=(x86_64-unknown-linux-gnu aarch64-unknown-linux-gnu aarch64-apple-darwin)
# The arm64 Python for the qemu check: Debian's, unpacked (dpkg -x) into a root of its own.
ARM64_DEBS=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libgcc-s1 zlib1g
  libexpat1 libffi8 libssl3 libcrypt1 libbz2-1.0 liblzma5 libuuid1 libsqlite3-0
  libncursesw6 libtinfo6 libreadline8)

log() { printf '\n== %s\n' "$*" >&2; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.0f", b - a }'; }

SUMMARY=()
FAILED=0
record() { # status (ok|FAIL|skip), what, detail
  SUMMARY+=("$(printf '%-5s %-58s %s' "$1" "$2" "${3:-}")")
  [ "$1" = FAIL ] && FAILED=1
  return 0
}

setup_tools() {
  local key
  key=$(printf '%s\n' "$PYTHON" "${TOOL_REQS[@]}" | sha256sum | cut -c1-16)
  if [ ! -x "$VENV/bin/maturin" ] || [ "$(cat "$VENV/.pd-stamp" 2>/dev/null)" != "$key" ]; then
    log "creating the tool venv ($VENV): ${TOOL_REQS[*]}"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "${TOOL_REQS[@]}"
    echo "$key" >"$VENV/.pd-stamp"
  fi
  # maturin finds zig as `python3 -m ziglang` on PATH: the venv's.
  export PATH=$VENV/bin:$PATH
  "$VENV/bin/maturin" --version >&2
  "$VENV/bin/python" -m ziglang version | sed 's/^/zig /' >&2
  if ! command -v rustup >/dev/null; then
    echo "rustup not found: install Rust with rustup (https://rustup.rs) and retry" >&2
    exit 1
  fi
  local installed missing=()
  installed=$(rustup target list --installed)
  for t in "${RUST_TARGETS[@]}"; do grep -qx "$t" <<<"$installed" || missing+=("$t"); done
  if [ "${#missing[@]}" -gt 0 ]; then
    log "rustup target add ${missing[*]}"
    rustup target add "${missing[@]}"
  fi
}

BUILD_TIMES=()
build() { # label, crate dir, rust target, extra maturin args...
  local label=$1 crate=$2 target=$3 t0 t1 rc=0; shift 3
  log "building $label ($crate for $target)"
  rm -rf "$OUT/.tmp-$label" && mkdir -p "$OUT/.tmp-$label"
  t0=$(now)
  # `--locked`: the release builds exactly Cargo.lock (and never rewrites it).
  nice -n 10 "$VENV/bin/maturin" build --release --locked --zig --target "$target" -m "$crate/Cargo.toml" \
    -o "$OUT/.tmp-$label" "$@" >&2 || rc=$?
  t1=$(now)
  BUILD_TIMES+=("$(printf '%-24s %4ss' "$label" "$(secs "$t0" "$t1")")")
  if [ "$rc" -ne 0 ]; then
    record FAIL "build $label" "maturin exited $rc"
    return 0
  fi
  local whl
  whl=$(ls "$OUT/.tmp-$label"/*.whl)
  rm -f "$OUT/$(basename "$whl")"
  mv "$whl" "$OUT/" && rm -rf "$OUT/.tmp-$label"
  record ok "build $label" "$(basename "$whl") ($(secs "$t0" "$t1") s)"
}

build_all() {
  rm -f "$OUT"/pd_bridge_vllm-*.whl "$OUT"/pd_bridge_omlx-*.whl
  build vllm-x86_64 vllm_plugin x86_64-unknown-linux-gnu --compatibility "$MANYLINUX" --features cuda
  build vllm-aarch64 vllm_plugin aarch64-unknown-linux-gnu --compatibility "$MANYLINUX" --features cuda
  build omlx-macos-arm64 omlx_patch aarch64-apple-darwin
  build omlx-x86_64 omlx_patch x86_64-unknown-linux-gnu --compatibility "$MANYLINUX"
}

wheel() { # glob under OUT: exactly one wheel, or empty
  local m=("$OUT"/$1)
  [ "${#m[@]}" -eq 1 ] && [ -f "${m[0]}" ] && echo "${m[0]}"
  return 0
}

# --- the arm64 Python for qemu-user --------------------------------------------------------------
ARM64_ROOT=$STATE/arm64-root
setup_qemu() {
  if ! command -v qemu-aarch64 >/dev/null; then
    command -v apt-get >/dev/null || { echo "no qemu-aarch64 and no apt-get to install qemu-user" >&2; return 1; }
    log "apt-get install qemu-user"
    apt-get install -y -q qemu-user >&2 || { apt-get update -q >&2 && apt-get install -y -q qemu-user >&2; } || return 1
  fi
  local key
  key=$(printf '%s\n' "${ARM64_DEBS[@]}" | sha256sum | cut -c1-16)
  if [ -x "$ARM64_ROOT/usr/bin/python3.11" ] && [ "$(cat "$ARM64_ROOT/.pd-stamp" 2>/dev/null)" = "$key" ]; then
    return 0
  fi
  log "unpacking Debian's arm64 Python 3.11 into $ARM64_ROOT"
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    dpkg --add-architecture arm64 && apt-get update -q >&2 || return 1
  fi
  local debs=$STATE/arm64-debs pkgs=()
  for p in "${ARM64_DEBS[@]}"; do pkgs+=("$p:arm64"); done
  rm -rf "$debs" "$ARM64_ROOT" && mkdir -p "$debs" "$ARM64_ROOT" && chmod a+rwx "$debs"  # apt sandboxes downloads as _apt
  if ! (cd "$debs" && apt-get download -q "${pkgs[@]}" >&2); then
    apt-get update -q >&2 && (cd "$debs" && apt-get download -q "${pkgs[@]}" >&2) || return 1
  fi
  for d in "$debs"/*.deb; do dpkg -x "$d" "$ARM64_ROOT"; done
  echo "$key" >"$ARM64_ROOT/.pd-stamp"
}

# --- checks --------------------------------------------------------------------------------------
SMOKE=$ROOT/tools/wheel_smoke.py
CHECK_DIR=$STATE/check
smoke_outputs=()

check_all() {
  local vx va om ol py=$PYTHON out
  vx=$(wheel "pd_bridge_vllm-*manylinux_2_28_x86_64.whl")
  va=$(wheel "pd_bridge_vllm-*manylinux_2_28_aarch64.whl")
  om=$(wheel "pd_bridge_omlx-*macosx_*_arm64.whl")
  ol=$(wheel "pd_bridge_omlx-*manylinux_2_28_x86_64.whl")
  rm -rf "$CHECK_DIR" && mkdir -p "$CHECK_DIR"

  log "checking the manylinux wheels"
  for pair in "vllm x86_64:$vx:x86_64" "vllm aarch64:$va:aarch64" "omlx x86_64:$ol:x86_64"; do
    IFS=: read -r what whl arch <<<"$pair"
    if [ -z "$whl" ]; then record FAIL "manylinux_2_28 $what: tags, ELF machine" "no wheel"; continue; fi
    if out=$("$py" "$SMOKE" check-manylinux "$whl" "$arch" 2>&1); then
      record ok "manylinux_2_28 $what: tags, ELF machine" "$(tail -1 <<<"$out")"
    else
      printf '%s\n' "$out" >&2; record FAIL "manylinux_2_28 $what: tags, ELF machine" "$(tail -1 <<<"$out")"
    fi
  done
  if [ -n "$vx" ] && [ -n "$va" ]; then
    if out=$("$py" "$SMOKE" check-same-features "$vx" "$va" 2>&1); then
      record ok "vllm x86_64 = aarch64: CUDA path, Python files" "$(tail -1 <<<"$out")"
    else
      printf '%s\n' "$out" >&2; record FAIL "vllm x86_64 = aarch64: CUDA path, Python files" "$(tail -1 <<<"$out")"
    fi
  fi

  log "checking the macOS arm64 omlx wheel"
  if [ -z "$om" ] || [ -z "$ol" ]; then
    record FAIL "macOS arm64 omlx: Mach-O, abi3, system libs, same .py" "missing wheel (macOS: ${om:-none}, Linux: ${ol:-none})"
  elif out=$("$py" "$SMOKE" check-macos "$om" "$ol" 2>&1); then
    record ok "macOS arm64 omlx: Mach-O, abi3, system libs, same .py" "$(tail -1 <<<"$out")"
  else
    printf '%s\n' "$out" >&2; record FAIL "macOS arm64 omlx: Mach-O, abi3, system libs, same .py" "$(tail -1 <<<"$out")"
  fi

  log "smoke test: the x86_64 wheels natively"
  if [ -z "$vx" ] || [ -z "$ol" ]; then
    record FAIL "smoke x86_64 (vllm x86_64 -> omlx x86_64)" "missing wheel"; return 0
  fi
  "$py" "$SMOKE" unpack "$vx" "$CHECK_DIR/vllm-x86_64" && "$py" "$SMOKE" unpack "$ol" "$CHECK_DIR/omlx-x86_64"
  local t0 t1
  t0=$(now)
  if PYTHONPATH=$CHECK_DIR/omlx-x86_64 "$py" "$SMOKE" run --out "$CHECK_DIR/smoke-x86_64.json" -- \
      env PYTHONPATH="$CHECK_DIR/vllm-x86_64" "$py" "$SMOKE" prefill >&2; then
    t1=$(now); record ok "smoke x86_64 (vllm x86_64 -> omlx x86_64)" "$(secs "$t0" "$t1") s, $("$py" "$SMOKE" show "$CHECK_DIR/smoke-x86_64.json")"
  else
    record FAIL "smoke x86_64 (vllm x86_64 -> omlx x86_64)" "see the log above"; return 0
  fi

  log "smoke test: the aarch64 vLLM wheel under qemu-user (arm64 Python 3.11)"
  if [ "${PD_BRIDGE_WHEELS_SKIP_QEMU:-0}" = 1 ]; then
    record skip "smoke aarch64 under qemu (PD_BRIDGE_WHEELS_SKIP_QEMU=1)"; return 0
  fi
  if [ -z "$va" ]; then record FAIL "smoke aarch64 under qemu" "no wheel"; return 0; fi
  if ! setup_qemu; then record FAIL "smoke aarch64 under qemu" "could not set up qemu-user and an arm64 Python"; return 0; fi
  "$py" "$SMOKE" unpack "$va" "$CHECK_DIR/vllm-aarch64"
  t0=$(now)
  if PYTHONPATH=$CHECK_DIR/omlx-x86_64 "$py" "$SMOKE" run --out "$CHECK_DIR/smoke-aarch64.json" -- \
      env QEMU_LD_PREFIX="$ARM64_ROOT" PYTHONHOME="$ARM64_ROOT/usr" PYTHONPATH="$CHECK_DIR/vllm-aarch64" \
      qemu-aarch64 "$ARM64_ROOT/usr/bin/python3.11" "$SMOKE" prefill >&2; then
    t1=$(now); record ok "smoke aarch64 (vllm aarch64 under qemu -> omlx x86_64)" "$(secs "$t0" "$t1") s, $("$py" "$SMOKE" show "$CHECK_DIR/smoke-aarch64.json")"
  else
    record FAIL "smoke aarch64 (vllm aarch64 under qemu -> omlx x86_64)" "see the log above"; return 0
  fi
  if out=$("$py" "$SMOKE" compare "$CHECK_DIR/smoke-x86_64.json" "$CHECK_DIR/smoke-aarch64.json" 2>&1); then
    record ok "smoke results: aarch64 identical to x86_64" "$(tail -1 <<<"$out")"
  else
    printf '%s\n' "$out" >&2; record FAIL "smoke results: aarch64 identical to x86_64" "$(tail -1 <<<"$out")"
  fi
}

T_START=$(now)
if [ "$CHECKS_ONLY" = 0 ]; then setup_tools; build_all; fi
T_BUILT=$(now)
check_all
T_END=$(now)

printf '\n== summary (%s)\n' "$OUT"
ls -l "$OUT"/*.whl 2>/dev/null | awk '{ printf "  %9d  %s\n", $5, $NF }' || true
if [ "${#BUILD_TIMES[@]}" -gt 0 ]; then
  echo "build wall times:"
  printf '  %s\n' "${BUILD_TIMES[@]}"
fi
echo "results:"
printf '  %s\n' "${SUMMARY[@]}"
printf 'total %ss (set-up and builds %ss, checks %ss)\n' "$(secs "$T_START" "$T_END")" "$(secs "$T_START" "$T_BUILT")" "$(secs "$T_BUILT" "$T_END")"
if [ "$FAILED" -ne 0 ]; then
  echo "FAILED" >&2
  exit 1
fi
echo "all checks passed"
