#!/usr/bin/env bash
# One device call, in priority order, each step bounded (device time is scarce): import check, GPU tests file by
# file, then the export bench. Every step's output lands in $OUT. Usage: bash bench/gpu_session.sh
set -uo pipefail
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m supervisor.cli "$@"\n' > /tmp/bin/supervisor && chmod +x /tmp/bin/supervisor
export SUPERVISOR_BIN=/tmp/bin/supervisor
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/machine.txt"
# which import initialises CUDA (the warm parent must not)
timeout 60 env PYTORCH_NVML_BASED_CUDA_CHECK=1 python3 -c '
import importlib, torch
for m in ["child.quantize", "child.name_only", "child.loadcheck", "llmcompressor.core", "llmcompressor.pipelines.cache",
          "llmcompressor.modeling.moe.context", "llmcompressor.modeling.offset_norm", "llmcompressor.modifiers.gptq",
          "llmcompressor.modifiers.transform.awq", "child.samples", "child.boundary", "child.calibrate", "child.torchao_backend"]:
    importlib.import_module(m); print(m, "cuda initialised:", torch.cuda.is_initialized(), flush=True)
' 2>&1 | grep "cuda initialised" | tee "$OUT/imports.txt"
t() { local secs=$1 name=$2; shift 2; timeout "$secs" python3 -m pytest -q -p no:cacheprovider -rs "$@" 2>&1 | grep -v "^W11\|WARNING" > "$OUT/$name.txt"; tail -3 "$OUT/$name.txt"; }
t 140 calibrated tests/gpu/test_calibrated_gpu.py
t 140 others tests/gpu/test_studio_gpu.py tests/gpu/test_torchao_gpu.py tests/gpu/test_export_gpu.py
t 80 moe tests/gpu/test_moe_gpu.py
timeout ${BENCH_SECONDS:-200} python3 bench/export_bench.py ${EXPORT_BENCH_ARGS:---workers 0,1 --skip kill} 2>&1 | grep -v "^W11\|WARNING\|it/s]" > "$OUT/export_bench.txt"; tail -22 "$OUT/export_bench.txt"
