#!/usr/bin/env bash
# Create .venv (if missing) with the tested working set; idempotent. All that examples/demo.sh sets up (about a minute
# on a fresh clone, most of it torch's download); .ci/setup.sh runs it first, then builds .venv-vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "error: Python 3.11 or newer is needed ($PY is $("$PY" -V 2>&1)); run with PYTHON=python3.11 (or newer)" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first and pinned: an open range would pull a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/pip install -q --disable-pip-version-check -e ".[test]" \
  "transformers==5.17.0" "accelerate==1.15.0" "safetensors==0.8.0" "msgspec==0.23.*" "psutil==7.2.*" "xxhash==3.6.0" \
  "torchao==0.18.0" "matplotlib==3.11.2" "peft==0.21.2" "fastapi==0.165.0" "uvicorn==0.38.0" "httpx==0.28.1" \
  "bitsandbytes==0.50.2" \
  "ray==2.60.0"  # bitsandbytes: the QLoRA tests (nf4 on the CPU); ray: tests/cluster (the [ray] extra); neither changes torch
