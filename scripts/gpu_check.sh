#!/usr/bin/env bash
# The GPU check, in two halves (docs/benchmarks.md "GPU results" says what it measured where it ran).
#   bash scripts/gpu_check.sh prepare   here, with network: the wheels a bare GPU machine lacks -> $GPU_WHEELS
#   bash scripts/gpu_check.sh run       there, one command: install them with --no-index into a scratch
#                                       --target, then scripts/gpu_check.py -> $GPU_CHECK_OUT (json + log)
#   bash scripts/gpu_check.sh dry-run   here: the same install into a clean folder, then the check, which
#                                       stops at "no CUDA device"
# GPU_WHEELS (default .gpu_wheels), GPU_CHECK_OUT (default out/gpu_check), PYTHON (default python3: on the GPU
# machine the interpreter that holds torch; for a dry run here .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${GPU_WHEELS:-.gpu_wheels}
PYTHON=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-out/gpu_check}
# The wheels are CPython 3.12 manylinux builds (the GPU machines' interpreter); naming the target lets the
# dry run install the same set from any interpreter.
TARGET_TAGS=(--python-version 3.12 --implementation cp --only-binary=:all:
             --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any)

install() {
  local site=$1
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS: run 'bash scripts/gpu_check.sh prepare' first" >&2; exit 2; }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "${TARGET_TAGS[@]}" \
    --target "$site" "$WHEELS"/*.whl
  for mod in zmq msgspec tvm_ffi flashinfer; do
    [ -d "$site/$mod" ] || { echo "the wheel set installed no $mod/ into $site" >&2; exit 2; }
  done
  echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels into $site with --no-index"
}

case "${1:-}" in
  prepare)
    exec "$PYTHON" scripts/gpu_wheels.py --dest "$WHEELS" ;;
  run)
    site=$(mktemp -d /tmp/gpu-site.XXXXXX)
    install "$site"
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" scripts/gpu_check.py --out "$OUT" "${@:2}" ;;
  dry-run)
    site=$(mktemp -d /tmp/gpu-site.XXXXXX)
    install "$site"
    # The cp312 binaries cannot load into another interpreter: the check itself runs on this one's packages.
    exec "$PYTHON" scripts/gpu_check.py --out "$OUT" "${@:2}" ;;
  *)
    sed -n '2,9p' "$0" >&2; exit 2 ;;
esac
