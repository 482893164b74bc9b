#!/usr/bin/env bash
# Everything we run on the GPU machine in one call (device time is scarce): GPU tests, then benchmarks.
# The machine has torch/transformers/accelerate but not llmcompressor/compressed-tensors/msgspec: they come as
# wheels in .whl (see docs/benchmarks.md for how they were fetched). Results go to $OUT (or ./gpu-results).
set -uo pipefail
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m supervisor.cli "$@"\n' > /tmp/bin/supervisor && chmod +x /tmp/bin/supervisor
export SUPERVISOR_BIN=/tmp/bin/supervisor
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; python3 -c 'import torch,sys; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count())'; } | tee "$OUT/machine.txt"
[ "${TESTS:-1}" = 1 ] && { python3 -m pytest -q -p no:cacheprovider -rs tests/gpu ${PYTEST_ARGS:-} 2>&1
  python3 -m pytest -q -p no:cacheprovider -rs tests/test_quantize.py -k cuda 2>&1; } | tee "$OUT/pytest.txt" | grep -v "^W11\|WARNING" | tail -60
if [ "${BENCH:-1}" = 1 ]; then
  python3 bench/offload_bench.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/offload_bench.txt" | tail -30
fi
if [ "${EXPORT_BENCH:-1}" = 1 ]; then
  python3 bench/export_bench.py ${EXPORT_BENCH_ARGS:-} 2>&1 | grep -v "^W11\|WARNING\|it/s]" | tee "$OUT/export_bench.txt" | tail -12
fi
if [ "${LORA_BENCH:-1}" = 1 ]; then
  python3 bench/lora_merge_fidelity.py 2>&1 | grep -v "^W11\|WARNING" | tee "$OUT/lora_merge_fidelity.txt" | tail -8
fi
if [ "${MOE_BENCH:-0}" = 1 ]; then  # a 35 GB DeepSeek-V3-shaped MoE, built and deleted here: opt-in
  python3 bench/moe_bench.py ${MOE_BENCH_ARGS:-} 2>&1 | grep -v "^W11\|WARNING\|it/s]" | tee "$OUT/moe_bench.txt" | tail -20
fi
