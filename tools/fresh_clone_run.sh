#!/usr/bin/env bash
# Times the README's test command (.ci/run) on a fresh clone with no pip, uv or cargo cache, as CI
# runs it, optionally with `stress-ng --cpu N` beside it; prints the command's own closing table.
#
#   bash tools/fresh_clone_run.sh [--burner N] [--keep]
#
# The clone is made beside this checkout (so ../shared is beside it too), from this checkout's HEAD;
# its caches live in its own directory and everything is removed afterwards unless --keep.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BURNER=0 KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --burner) BURNER=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    *) echo "usage: bash tools/fresh_clone_run.sh [--burner N] [--keep]" >&2; exit 2 ;;
  esac
done
WORK=$(mktemp -d "$ROOT/../fresh-run.XXXXXX")
# The clone must sit where ../shared resolves as it does for this checkout.
CLONE=$ROOT/../$(basename "$WORK")-clone
git clone -q "$ROOT" "$CLONE"
echo "fresh clone of $(git -C "$CLONE" rev-parse --short HEAD) in $CLONE, caches in $WORK; burner: $BURNER cpu" >&2
burner_pid=""
if [ "$BURNER" -gt 0 ]; then
  command -v stress-ng >/dev/null || { echo "stress-ng not found (Debian: apt-get install stress-ng)" >&2; exit 1; }
  stress-ng --cpu "$BURNER" --quiet &
  burner_pid=$!
fi
cleanup() {
  [ -z "$burner_pid" ] || kill "$burner_pid" 2>/dev/null || true
  if [ "$KEEP" -eq 0 ]; then rm -rf "$WORK" "$CLONE"; fi
}
trap cleanup EXIT
t0=$SECONDS
rc=0
env UV_CACHE_DIR="$WORK/uv-cache" CARGO_HOME="$WORK/cargo-home" PIP_CACHE_DIR="$WORK/pip-cache" \
  CARGO_TARGET_DIR="$CLONE/target" bash "$CLONE/.ci/run" || rc=$?
echo "fresh-clone run: RC $rc in $((SECONDS - t0)) s (burner: $BURNER cpu)" >&2
exit "$rc"
