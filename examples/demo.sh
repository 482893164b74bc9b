#!/usr/bin/env bash
# Set up (first time) and run the demo: build a small model locally, export it, load the result.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup-venv.sh  # .venv only: the demo never uses .venv-vllm (the tests do: .ci/setup.sh)
exec .venv/bin/supervisor demo "${1:-demo}"
