#!/usr/bin/env bash
# Create .venv and install mmkv with its test tools. CPU torch by default; for a GPU, install the torch build
# you want into .venv first (or set MMKV_TORCH="torch==X.Y.Z" / MMKV_TORCH=skip) and this keeps it.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
torch_spec="${MMKV_TORCH:-torch==2.13.0}"
if [ "$torch_spec" != "skip" ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "$torch_spec"
fi
.venv/bin/python -m pip install -q -e ".[dev,gateway]"
