#!/usr/bin/env bash
# The GPU part in one command, for the device machine (see bench/gpu.py for the steps and their bounds).
# The GPU image has torch, transformers, safetensors, pillow, numpy and tqdm but not diskcache: it travels as a
# wheel in .whl/ (fetch it here once with `bash bench/gpu.sh --fetch-wheels`, and name .whl in the run's carry).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  python3 -m pip download --no-deps --only-binary=:all: -d .whl 'diskcache==5.6.3'
  exit 0
fi
if ! python3 -c "import diskcache" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec python3 bench/gpu.py --out "${OUT:-runs/gpu}" "$@"
