#!/usr/bin/env bash
# The GPU runs, as device-tool calls of under 10 minutes each (device time is scarce), every step bounded and its
# output kept in $OUT. Needs the wheels in .whl/ (docs/benchmarks.md says which) and, for `tests`, two GPUs.
#
#   bash bench/gpu_session.sh tests    # import check, then every tests/gpu file (three groups at once), ~9 min
#   bash bench/gpu_session.sh calib    # bench/calib_bench.py (8 layers of the 8B shape) and bench/moe_bench.py
#   bash bench/gpu_session.sh export   # bench/export_bench.py FP8_DYNAMIC and W4A16, bench/offload_bench.py
#   bash bench/gpu_session.sh floor1   # issue 34: GPTQ 8 layers, before / after / oneshot (bench/calib_bench.py)
#   bash bench/gpu_session.sh floor2   # issue 34: AWQ and NVFP4 static scales, then tests/gpu/test_calibrated_gpu.py
set -uo pipefail
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m supervisor.cli "$@"\n' > /tmp/bin/supervisor && chmod +x /tmp/bin/supervisor
export SUPERVISOR_BIN=/tmp/bin/supervisor PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/machine.txt"
nproc >> "$OUT/machine.txt"

quiet() { grep --line-buffered -v "^W11\|WARNING\|it/s]\|Failed to load"; }
t() {  # t SECONDS NAME PYTEST-ARGS...: one pytest run, bounded, its whole output in $OUT/NAME.txt
  local secs=$1 name=$2; shift 2
  timeout "$secs" python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short "$@" 2>&1 | quiet > "$OUT/$name.txt"
  echo "== $name: $(tail -1 "$OUT/$name.txt")"
}

eb() {  # eb SECS NAME LINES ARGS...: bench/export_bench.py on cuda:0 (measure_error off, ARGS added), bounded, its
  # output in $OUT/NAME.txt, its last LINES lines shown (the bench starts from an empty --workdir itself)
  local secs=$1 name=$2 lines=$3; shift 3
  CUDA_VISIBLE_DEVICES=0 timeout "$secs" python3 bench/export_bench.py --device cuda:0 --measure-error false "$@" 2>&1 \
    | quiet > "$OUT/$name.txt"
  tail -"$lines" "$OUT/$name.txt"
}

imports_check() {  # import as the warm parent does (child/zygote.py): does any import initialise CUDA?
  timeout 90 env PYTORCH_NVML_BASED_CUDA_CHECK=1 TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION=1 python3 -c '
import importlib, time, torch
from child.zygote import _capability_from_nvml
with _capability_from_nvml(torch):
    for m in ["child.backends.quantize", "child.backends.name_only", "child.loadcheck", "child.backends.samples", "child.backends.boundary",
              "child.backends.calibrate", "child.backends.torchao_backend", "child.sources.adapter", "child.sources.checkpoint"]:
        t = time.perf_counter(); importlib.import_module(m)
        print(f"{m}: {time.perf_counter() - t:.1f} s, cuda initialised: {torch.cuda.is_initialized()}", flush=True)
print("capability (torch, after the imports):", torch.cuda.get_device_capability())
' 2>&1 | grep "cuda initialised\|capability" > "$OUT/imports.txt"; cat "$OUT/imports.txt"
}

importtime() {  # where the warm parent's import time goes on this machine (cumulative, the largest)
  env PYTORCH_NVML_BASED_CUDA_CHECK=1 TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION=1 timeout 90 \
    python3 -X importtime -c "import child.backends.quantize" 2> "$OUT/importtime.raw" > /dev/null
  awk -F'|' '/import time:/ {gsub(/ /, "", $2); print $2, $3}' "$OUT/importtime.raw" | sort -n -r | head -40 \
    > "$OUT/importtime.txt"
  timeout 60 python3 -c "import time; t = time.perf_counter(); import torch; print(f'import torch: {time.perf_counter() - t:.1f} s')" \
    >> "$OUT/importtime.txt" 2>&1
  head -12 "$OUT/importtime.txt"; tail -1 "$OUT/importtime.txt"
}

warm_imports() {  # the warm parent's imports as it does them (child/zygote.py), then child.backends.calibrate's
  timeout 120 env PYTORCH_NVML_BASED_CUDA_CHECK=1 TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION=1 python3 -c '
import sys, time, torch
from child.zygote import _imports
seconds, forkable = _imports("compressed-tensors")
ao = sys.modules.get("torchao") is not None
print(f"warm parent imports (compressed-tensors): {seconds:.1f} s, forkable {forkable}, torchao imported: {ao}",
      flush=True)
t = time.perf_counter(); import child.backends.calibrate
print(f"child.backends.calibrate after them: {time.perf_counter() - t:.1f} s, cuda initialised: {torch.cuda.is_initialized()}")
' 2>&1 | grep "imports\|calibrate" | tee "$OUT/imports.txt"
}

warm_parent_imports() {  # warm_parent_imports MODULE...: the warm parent's imports timed twice, and which MODULEs came in
  local mods; mods=$(printf '"%s",' "$@")
  for i in 1 2; do
    env PYTORCH_NVML_BASED_CUDA_CHECK=1 TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION=1 timeout 120 python3 -c '
import sys, time
t = time.perf_counter(); from child.imports import preload; preload("compressed-tensors")
heavy = [m for m in ('"$mods"') if sys.modules.get(m) is not None]
print(f"warm parent imports: {time.perf_counter() - t:.2f} s; imported: {heavy}")' 2>&1 | grep "warm parent" | tee -a "$OUT/imports.txt"
  done
}

preload_profile() {  # where the warm parent's imports go (as child/zygote.py does them), against oneshot's imports
  local envs="PYTORCH_NVML_BASED_CUDA_CHECK=1 TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION=1"
  env $envs timeout 120 python3 -X importtime -c "from child.imports import preload; preload('compressed-tensors')" \
    2> "$OUT/importtime.raw" > /dev/null
  awk -F'|' '/import time:/ {gsub(/ /, "", $2); print $2, $3}' "$OUT/importtime.raw" | sort -n -r | head -80 \
    > "$OUT/importtime.txt"
  for i in 1 2; do
    env $envs timeout 120 python3 -c '
import sys, time
t = time.perf_counter(); import torch; a = time.perf_counter() - t
from child.imports import preload; preload("compressed-tensors"); b = time.perf_counter() - t
heavy = [m for m in ("triton", "torch._dynamo", "sympy", "datasets", "pandas", "torchao", "scipy", "torch.distributed.tensor") if sys.modules.get(m) is not None]
print(f"warm parent imports: torch {a:.2f} s, all {b:.2f} s; imported: {heavy}")' 2>&1 | grep "warm parent" >> "$OUT/importtime.txt"
    timeout 120 python3 -c 'import time; t = time.perf_counter(); from llmcompressor import oneshot; import transformers
print(f"oneshot imports: {time.perf_counter() - t:.2f} s")' 2>&1 | grep "oneshot imports" >> "$OUT/importtime.txt"
  done
  head -25 "$OUT/importtime.txt"; tail -4 "$OUT/importtime.txt"
}

triton_key_check() {  # the warm parent's imports as child/zygote.py does them: forkable, and Triton's key cached?
  timeout 120 python3 -c '
import time
from child.zygote import _imports
seconds, forkable = _imports("compressed-tensors")
import torch, triton.runtime.cache as c
print(f"warm parent imports {seconds:.1f} s, forkable {forkable}, cuda initialised {torch.cuda.is_initialized()}, "
      f"Triton key cached: {c.triton_key.cache_info().currsize == 1}")' 2>&1 | grep "warm parent" | tee "$OUT/triton_key.txt"
}

bytecode_both() {  # every process with bytecode (PYTHONPYCACHEPREFIX, writing on: what a plain pip install gives both
  # tools; our own cache then stays off), each tool's imports compiled once first; with an argument, that tree's too
  rm -rf /tmp/pyc-all
  export PYTHONPYCACHEPREFIX=/tmp/pyc-all; unset PYTHONDONTWRITEBYTECODE
  timeout 60 python3 -c "from llmcompressor import oneshot; import transformers, child.backends.calibrate" > /dev/null 2>&1
  [ -n "${1:-}" ] && (cd "$1" && timeout 60 python3 -c "import child.backends.calibrate" > /dev/null 2>&1)
  return 0
}

cbk() {  # cbk SECS NAME ARGS...: as cb, on /tmp/cbk's checkpoint built once (--build-only), each run's output fresh
  local secs=$1 name=$2; shift 2
  rm -rf /tmp/cbk/sup /tmp/cbk/oneshot*
  timeout "$secs" python3 bench/calib_bench.py --layers 8 --skip kill,retry --workdir /tmp/cbk --keep "$@" 2>&1 \
    | quiet > "$OUT/$name.txt"
  grep "^supervisor (W" "$OUT/$name.txt"; grep -A11 "^| layer" "$OUT/$name.txt" | head -12; tail -14 "$OUT/$name.txt"
}

cb() {  # cb SECS NAME ARGS...: bench/calib_bench.py (8 layers of the 8B shape, no kill or retry runs) into
  # $OUT/NAME.txt, in a work folder of its own removed after; shows the run's line, its stage clock and its table
  local secs=$1 name=$2; shift 2
  rm -rf "/tmp/cb-$name"
  timeout "$secs" python3 bench/calib_bench.py --layers 8 --skip kill,retry --workdir "/tmp/cb-$name" "$@" 2>&1 \
    | quiet > "$OUT/$name.txt"
  grep "^supervisor (W" "$OUT/$name.txt"; grep -A11 "^| layer" "$OUT/$name.txt" | head -12; tail -14 "$OUT/$name.txt"
  rm -rf "/tmp/cb-$name"
}

case "${1:-tests}" in
s39c)  # thirty-eighth session's code (issue 34), its first GPU run: the one-kernel softmax's and the rotary kernel's
  # GPU tests (every way of moving a row: packed halves, shared memory), the variants timed
  # (bench/softmax_kernel_probe.py; s39a: the kernel 0.076 s of a 0.165 s attention pass), then the default AWQ
  # against oneshot on 8 layers of the 8B shape with the unscaled outputs and activation sums from the forward
  # (child/backends/awq_capture.py) and the grid's waits at its end (child/backends/awq_search.py), the kernels as
  # in s38c
  t 150 warp_gpu tests/gpu/test_eager_attention_gpu.py -m gpu
  timeout 120 python3 bench/softmax_kernel_probe.py --warps 4 --rounds 2 2>&1 | quiet > "$OUT/softmax_probe.txt"; tail -18 "$OUT/softmax_probe.txt"
  cb 330 awq_capture --method awq
  grep "worker logs" "$OUT/awq_capture.txt"
  ;;
s44b)  # forty-third session (issue 34): the candidates' passes replayed from CUDA graphs (child/backends/graphed_pass.py;
  # s43b: the attention's pass 0.138 s, its kernels 0.113 s, the rest the host's Python): the GPU tests, then the AWQ
  # probe with the graphs and without (passes timed by events, each pass's seconds to queue beside)
  t 100 graphed tests/gpu/test_graphed_pass_gpu.py tests/gpu/test_awq_search_gpu.py -m gpu
  t 200 awq_gpu tests/gpu/test_calibrated_gpu.py -m gpu -k "awq and not match"
  for k in graph nograph; do
    SUPERVISOR_TEST_KERNELS=$k timeout 110 python3 bench/awq_probe.py --fused --untimed-passes --profile-pass -1 \
      --workdir /tmp/awqp 2>&1 | quiet | grep -v "^20..-..-..T\|Grid search\|Smoothing" > "$OUT/awq_probe_$k.txt"
    echo "== $k"; tail -14 "$OUT/awq_probe_$k.txt"
  done
  rm -rf /tmp/awqp
  ;;
s44c)  # after s44b, on the same machine: with bytecode for both tools the default AWQ (graphed passes) against
  # oneshot on 8 layers of the 8B shape, every tensor compared
  bytecode_both
  rm -rf /tmp/cbk; timeout 150 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cbk --build-only 2>&1 | quiet | tail -2
  cbk 300 awq_graphed --method awq
  grep "worker logs" "$OUT/awq_graphed.txt"
  ;;
s44e)  # not yet run (the forty-third session's device refused twice): s44d cut to what a short budget holds: the GPU tests, then ours alone (the default AWQ, bytecode, 8 layers of the
  # 8B shape): its seconds a layer and the GPU memory its tree holds (s44c: 31.15 GiB, a pool a search)
  t 100 graphed tests/gpu/test_graphed_pass_gpu.py -m gpu
  bytecode_both
  rm -rf /tmp/cbk; timeout 150 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cbk --build-only 2>&1 | quiet | tail -1
  cbk 150 awq_graphed3 --method awq --skip kill,retry,oneshot
  grep "worker logs" "$OUT/awq_graphed3.txt"
  ;;
s44d)  # not yet run (the device refused; next session's first call): the graphs' memory in one pool a process (s44c: 31.15 GiB held by the worker against
  # 19.62 without graphs), a failed capture's random generators settled: the GPU tests, then the default AWQ against
  # oneshot again (bytecode for both, 8 layers of the 8B shape, every tensor compared)
  t 100 graphed tests/gpu/test_graphed_pass_gpu.py -m gpu
  bytecode_both
  rm -rf /tmp/cbk; timeout 150 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cbk --build-only 2>&1 | quiet | tail -2
  cbk 300 awq_graphed2 --method awq
  grep "worker logs" "$OUT/awq_graphed2.txt"
  ;;
s44p)  # not run (the device refused; s44b's probe has the seconds to queue): where the attention pass's host time goes, the AWQ probe alone (s44a's first
  # half): each pass's seconds to queue beside its device seconds, and one pass of each parent under cProfile
  timeout 150 python3 bench/awq_probe.py --fused --untimed-passes --profile-pass 2 --host-profile --top 40 \
    --workdir /tmp/awqp 2>&1 | quiet | grep -v "^20..-..-..T\|Grid search\|Smoothing" > "$OUT/awq_host.txt"
  tail -150 "$OUT/awq_host.txt" | head -40; rm -rf /tmp/awqp
  ;;
s44a)  # for the next session (issue 34), not yet run: where the attention pass's host time goes (s43b: its kernels
  # 0.113 s of a 0.138 s pass): the AWQ probe with each pass's seconds to queue beside its device seconds, and one
  # pass of each parent under cProfile; then with bytecode for both tools the default AWQ against oneshot on 8 layers
  # of the 8B shape (every tensor compared)
  timeout 120 python3 bench/awq_probe.py --fused --untimed-passes --profile-pass 2 --host-profile --top 30 \
    --workdir /tmp/awqp 2>&1 | quiet | grep -v "^20..-..-..T\|Grid search\|Smoothing" > "$OUT/awq_host.txt"
  tail -120 "$OUT/awq_host.txt" | head -60; rm -rf /tmp/awqp
  bytecode_both
  rm -rf /tmp/cbk; timeout 150 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cbk --build-only 2>&1 | quiet | tail -2
  cbk 250 awq_bytecode1 --method awq
  ;;
s43c)  # after s43a/s43b (issue 34): the kernels launched with little Python (child/backends/cuda_kernels.py; s43a's
  # profile: the attention pass's kernels 0.113 s of its 0.138, the host's Python the rest): the kernels' GPU tests,
  # then with bytecode for both tools the default AWQ against oneshot on 8 layers of the 8B shape (every tensor
  # compared), then where a pass's time goes (bench/awq_probe.py, passes timed by events)
  t 120 warp_gpu tests/gpu/test_eager_attention_gpu.py -m gpu -k "(smem and not pack) or division or leaves or rotary"
  bytecode_both
  rm -rf /tmp/cbk; timeout 150 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cbk --build-only 2>&1 | quiet | tail -2
  cbk 300 awq_default --method awq
  timeout 110 python3 bench/awq_probe.py --fused --untimed-passes --profile-pass -1 --workdir /tmp/awqp 2>&1 | quiet \
    | grep -v "^20..-..-..T\|Grid search\|Smoothing" > "$OUT/awq_probe.txt"; tail -12 "$OUT/awq_probe.txt"
  ;;
s43a)  # forty-second session (issue 34): the one-kernel softmax with fewer instructions a key (the row's division
  # with its reciprocal once, warp_softmax.ROW_DIVISION; no check against the row's length where the row fills the
  # lanes; the 8B row had 4728 SASS instructions, now 3872, with the hot path about 2200): the variants timed, the
  # division checked against div.rn for all 2^46 pairs of significands, the kernel's GPU tests (the product's way,
  # smem, and the division's tests)
  timeout 100 python3 bench/softmax_kernel_probe.py --warps 4 --rounds 2 2>&1 | quiet > "$OUT/softmax_probe.txt"; tail -15 "$OUT/softmax_probe.txt"
  timeout 150 python3 bench/division_proof.py 2>&1 | quiet > "$OUT/division_proof.txt"; grep -v "^  b signif" "$OUT/division_proof.txt"; tail -1 "$OUT/division_proof.txt"
  t 150 warp_gpu tests/gpu/test_eager_attention_gpu.py -m gpu -k "(smem and not pack) or division or leaves or rotary"
  ;;
s43b)  # after s43a, on the same machine (issue 34): with bytecode for both tools, one checkpoint of 8 layers of the 8B
  # shape, the default AWQ (now with s43a's kernel) against oneshot, every tensor compared
  bytecode_both
  rm -rf /tmp/cbk; timeout 150 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cbk --build-only 2>&1 | quiet | tail -2
  cbk 330 awq_default --method awq
  ;;
s42c)  # forty-first session (issue 34), run once (tree ee3e0a2): the one-kernel softmax's variants timed against a
  # copy variant (its loads and stores alone, as its SASS showed in s43a), the kernel's GPU tests, then with bytecode for both tools, on one
  # checkpoint (8 layers of the 8B shape): ours with ZEROS and FASTDIV on (both since removed, slower) against oneshot
  # (every tensor compared), then ours with both off. (Its test step ran out of its 150 s: 244 tests were too many.)
  timeout 90 python3 bench/softmax_kernel_probe.py --warps 4 --rounds 2 2>&1 | quiet > "$OUT/softmax_probe.txt"; tail -11 "$OUT/softmax_probe.txt"
  t 150 warp_gpu tests/gpu/test_eager_attention_gpu.py -m gpu -k "not models"
  bytecode_both
  rm -rf /tmp/cbk; timeout 150 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cbk --build-only 2>&1 | quiet | tail -2
  SUPERVISOR_TEST_KERNELS=zeros,fastdiv cbk 250 awq_zeros_fastdiv --method awq
  cbk 110 awq_default --method awq --skip oneshot,kill,retry
  ;;
s42b)  # for the next session (issue 34), not yet run: how wide the default AWQ's ratio to oneshot runs on one
  # machine, with bytecode for both tools (the image has none: each start compiles the wheels' sources, and s41a/s41b's
  # start-ups differed by 3.4 s): two runs of the default against oneshot, one checkpoint, every tensor compared
  bytecode_both
  rm -rf /tmp/cbk; timeout 150 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cbk --build-only 2>&1 | quiet | tail -2
  cbk 250 awq_bytecode1 --method awq
  cbk 250 awq_bytecode2 --method awq
  ;;
s41b)  # after s41a, on the other kind of card: the default AWQ against oneshot on 8 layers of the 8B shape
  rm -rf /tmp/cbk; timeout 150 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cbk --build-only 2>&1 | quiet | tail -2
  cbk 330 awq_default --method awq
  ;;
s41a)  # fortieth session (issue 34): AWQ's passes sample by sample (child/backends/awq_search.py: each sample's output
  # added into the candidate's loss and let go, eager attention's probabilities let go at once; the library holds all
  # 128 samples' until a pass is over: 32 GiB for the 8B layer): AWQ's GPU equality tests against oneshot, the default
  # AWQ against oneshot on 8 layers of the 8B shape (every tensor compared; peak GPU), the same with the library's
  # way of holding them (SUPERVISOR_TEST_KERNELS=nosamplewise, ours only), then where the search's time goes now
  t 120 awq_gpu tests/gpu/test_calibrated_gpu.py -m gpu -k "llama-W4A16-awq or awq_match"
  rm -rf /tmp/cbk; timeout 150 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cbk --build-only 2>&1 | quiet | tail -2
  cbk 330 awq_default --method awq
  SUPERVISOR_TEST_KERNELS=nosamplewise cbk 120 awq_held --method awq --skip oneshot,kill,retry
  timeout 100 python3 bench/awq_probe.py --fused --untimed-passes --profile-pass -1 --workdir /tmp/awqp 2>&1 | quiet \
    | grep -v "^20..-..-..T\|Grid search\|Smoothing" > "$OUT/awq_probe.txt"; tail -12 "$OUT/awq_probe.txt"; rm -rf /tmp/awqp
  ;;
s40a)  # thirty-ninth session (issue 34): awq_search's candidates without a wait (tests/gpu/test_awq_search_gpu.py)
  # and the default AWQ equal to oneshot on cuda; then the default AWQ, now with the one-kernel softmax's rows through
  # shared memory, the rotary kernel on (s39c/s39f: their GPU tests pass; the kernel 0.058 s against 0.140) and no
  # wait per candidate in the search, against oneshot on
  # 8 layers of the 8B shape, 128 x 2048 (every tensor compared); then, on the same checkpoint and machine, ours with
  # the AWQ search's and capture's stand-ins off (the library's own steps): what those two save; between them, where
  # the search's time outside its passes goes (bench/awq_probe.py --fused --untimed-passes: passes and losses timed
  # by CUDA events, no waits; --count-syncs: every wait for the device left in the smoothing, by the line that makes it)
  t 60 awq_search_gpu tests/gpu/test_awq_search_gpu.py -m gpu
  t 90 awq_gpu tests/gpu/test_calibrated_gpu.py -m gpu -k "llama-W4A16-awq"
  rm -rf /tmp/cbk; timeout 150 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cbk --build-only 2>&1 | quiet | tail -2
  cbk 330 awq_default --method awq
  timeout 120 python3 bench/awq_probe.py --fused --untimed-passes --count-syncs --profile-pass -1 --workdir /tmp/awqp 2>&1 | quiet \
    | grep -v "^20..-..-..T\|Grid search\|Smoothing" > "$OUT/awq_probe.txt"; tail -24 "$OUT/awq_probe.txt"; rm -rf /tmp/awqp
  SUPERVISOR_TEST_KERNELS=nocapture,nosearch cbk 120 awq_library_steps --method awq --skip oneshot,kill,retry
  ;;
s39f)  # after s39c: the default AWQ with the kernels' switches on (packed halves, shared memory, the rotary kernel;
  # ours only, against s39c's run on the same machine), then AWQ's GPU equality tests against oneshot
  SUPERVISOR_TEST_KERNELS=smem,rotary cb 200 awq_kernels --method awq --skip oneshot,kill,retry
  grep "worker logs" "$OUT/awq_kernels.txt"
  t 150 awq_gpu tests/gpu/test_calibrated_gpu.py -m gpu -k "llama-W4A16-awq or awq_match"
  SUPERVISOR_TEST_KERNELS=smem,rotary t 150 awq_gpu_kernels tests/gpu/test_calibrated_gpu.py -m gpu -k "llama-W4A16-awq"
  ;;
s39a)  # thirty-eighth session (issue 34): the one-kernel softmax's fp16 fix on the GPU (bound 1024; the prefix gives
  # fp16's softmax the half input), a pass's time against the floor (bench/attention_floor_probe.py), then where the
  # default AWQ's search goes now: oneshot's search with the product's fused attention installed, each mapping's
  # passes timed and one candidate's pass per parent profiled (bench/awq_probe.py --fused)
  t 150 warp_gpu tests/gpu/test_eager_attention_gpu.py -m gpu
  timeout 120 python3 bench/attention_floor_probe.py 2>&1 | quiet > "$OUT/floor_probe.txt"; tail -12 "$OUT/floor_probe.txt"
  timeout 240 python3 bench/awq_probe.py --fused --workdir /tmp/awqp 2>&1 | quiet | grep -v "^20..-..-..T\|Grid search\|Smoothing" > "$OUT/awq_probe.txt"
  tail -70 "$OUT/awq_probe.txt"; rm -rf /tmp/awqp
  ;;
s38c)  # thirty-seventh session (issue 34): eager attention's probabilities in one CUDA kernel (scaling, mask, PyTorch's
  # warp softmax, cast; child/backends/warp_softmax.py): its GPU tests, the default AWQ against oneshot on 8 layers of
  # the 8B shape, 128 x 2048 (every tensor compared), then AWQ's GPU equality tests against oneshot on small models
  t 150 warp_gpu tests/gpu/test_eager_attention_gpu.py -m gpu
  cb 380 awq_warp --method awq
  grep "worker logs" "$OUT/awq_warp.txt"
  t 170 awq_gpu tests/gpu/test_calibrated_gpu.py -m gpu -k "llama-W4A16-awq or awq_match"
  ;;
s37a)  # thirty-sixth session (issue 34): the default AWQ with eager attention's scaling, mask and upcast fused (same
  # bits, child/backends/eager_attention.py): 8 layers of the 8B shape, 128 x 2048, ours against oneshot (every
  # tensor compared), then its GPU equality tests against oneshot on the small models
  cb 380 awq_fused --method awq
  grep "worker logs" "$OUT/awq_fused.txt"
  t 170 awq_gpu tests/gpu/test_calibrated_gpu.py -m gpu -k "llama-W4A16-awq or awq_match"
  ;;
s36a)  # thirty-fifth session (issue 34): could AWQ's attention search be screened through SDPA and decided by the
  # library's eager passes on the few points that could win, keeping oneshot's bits? Ran with that screen in the
  # default path (f128a7e; removed after: it needed every point eagerly here; its probe then also ran the screened
  # search): the default AWQ, 8 layers of the 8B shape, 128 x 2048, ours against oneshot; then
  # bench/awq_screen_probe.py, the landscape of eager losses and SDPA's offsets
  cb 340 awq --method awq
  timeout 140 python3 bench/awq_screen_probe.py --workdir /tmp/awqs 2>&1 | quiet | grep -v "^20..-..-..T\|Grid search\|Smoothing" > "$OUT/awq_screen_probe.txt"
  tail -12 "$OUT/awq_screen_probe.txt"; rm -rf /tmp/awqs
  ;;
s35b)  # AWQ with match_oneshot = false: SDPA kept in the grid search (s35a: the eager attention's passes are 64% of
  # the search, 80% of each pass elementwise on the [32, 2048, 2048] scores). Its fidelity test, then 8 layers of
  # the 8B shape, ours (match_oneshot = false) against oneshot
  t 110 awq_fast tests/gpu/test_calibrated_gpu.py -m gpu -k "awq_match and llama"
  cb 400 awq_fast --method awq --fast --skip kill,retry,default
  ;;
s35a)  # thirty-fourth session (issue 34): the host-memory run order: GPTQ 8 layers
  # without the layer ahead first, then with it (s34a/s34b ran with it first: +0.068 GiB of file pages from layer 0 on);
  # then where AWQ's grid search goes (oneshot's, one layer of the 8B shape, each mapping and pass timed, one candidate's
  # pass per parent profiled); --overlap: the attention and MLP parents side by side on two streams, bit for bit?
  cb 330 rss_order --skip oneshot,kill,retry --rss-trace --no-ahead-too=first
  timeout 270 python3 bench/awq_probe.py --workdir /tmp/awqp --overlap 64 --rounds 8 2>&1 | quiet | grep -v "^20..-..-..T\|Grid search\|Smoothing" > "$OUT/awq_probe.txt"
  tail -60 "$OUT/awq_probe.txt"; rm -rf /tmp/awqp
  ;;
s34b)  # s34a's GPTQ after / before again, after other runs on the machine (s34a's "after" ran first on a fresh one, +0.068 GiB of file pages from layer
  # 0's embedding on, before any layer ahead), and the data-free read-ahead back to the driver's copy (s34a: through
  # DeviceStaging three FP8_DYNAMIC workers waited 0.57 s a layer for it, against 0.000 before)
  bytecode_both .whl/before
  eb 200 fp8 12 --scheme FP8_DYNAMIC --skip oneshot,model_free_ptq,kill,1w,warm --before .whl/before
  cb 330 rss_gptq --before .whl/before --skip oneshot,kill,retry --rss-trace
  ;;
s34a)  # thirty-third session (issue 34): where a calibrated layer's host memory peaks (--rss-trace), with and without
  # the layer started ahead (the same code: --no-ahead-too), against 6a3d967 (peak RSS per layer 6.05-6.10 against
  # 5.97 GiB in s33d/s33e); then the data-free exports, whose read-ahead now goes through DeviceStaging, against it
  bytecode_both .whl/before
  cb 330 rss_gptq --before .whl/before --skip oneshot,kill,retry --rss-trace --no-ahead-too
  eb 200 fp8 12 --scheme FP8_DYNAMIC --skip oneshot,model_free_ptq,kill,1w,warm --before .whl/before --per-layer
  ;;
s33a)  # thirty-second session (issue 34 part 1): the next calibrated layer started ahead (child/ahead.py), its setup
  # and forward beside the previous layer's shard write. GPU tests (GPTQ and AWQ equal oneshot on cuda, kill and
  # rerun byte-identical), then GPTQ 8 layers after / oneshot / before (6a3d967, last stop) with the stage peaks
  t 200 gpu_tests tests/gpu/test_calibrated_gpu.py -m gpu -k "llama-W4A16-gptq or llama-W4A16-awq or kill"
  bytecode_both .whl/before
  cb 330 floor_gptq --before .whl/before --stage-peaks
  ;;
s33c)  # s33a's layer ahead, with the next layer copied onto the GPU as the previous one's propagate stage starts,
  # through pinned chunks on a side stream (DeviceStaging: it waited 0.1 s for a pageable copy), and the cuBLAS
  # workspace of the main thread given back (two of them held every layer's peak 32 MiB higher in s33a)
  t 200 gpu_tests tests/test_staging.py tests/gpu/test_calibrated_gpu.py -m gpu -k "staging or chunks or llama-W4A16-gptq or kill"
  bytecode_both .whl/before
  cb 330 floor_gptq --before .whl/before --stage-peaks
  ;;
s33d)  # s33c with the next layer's copy started once this one has let go of its source tensors (after its errors
  # are measured): s33c's copy at propagate mapped two layers' weights at once (peak RSS 6.47 against 5.97 GiB)
  t 200 gpu_tests tests/test_staging.py tests/gpu/test_calibrated_gpu.py -m gpu -k "staging or chunks or llama-W4A16-gptq or kill"
  bytecode_both .whl/before
  cb 330 floor_gptq --before .whl/before --stage-peaks
  ;;
s33e)  # s33d's code (chunks of 8 MiB): the AWQ equality on cuda, an after / before pair of GPTQ (no oneshot), then
  # NVFP4 static scales after / oneshot
  t 100 gpu_awq tests/gpu/test_calibrated_gpu.py -m gpu -k "llama-W4A16-awq"
  bytecode_both .whl/before
  cb 140 floor_pair1 --before .whl/before --skip oneshot,kill,retry
  cb 130 floor_nvfp4 --method rtn --scheme NVFP4
  ;;
s32d)  # two more after / before pairs (no oneshot), the machine warm for the second: is the steady layers' gain real?
  bytecode_both .whl/before
  cb 140 floor_pair1 --before .whl/before --skip oneshot,kill,retry
  cb 140 floor_pair2 --before .whl/before --skip oneshot,kill,retry
  ;;
s32c)  # s32b on the issue's card (an H200): GPTQ 8 layers after / oneshot / before (cd40885), then NVFP4 static
  bytecode_both .whl/before
  cb 330 floor_gptq --before .whl/before --stage-peaks
  cb 130 floor_nvfp4 --method rtn --scheme NVFP4
  ;;
s32b)  # s32a's changes measured again after two fixes it showed: a part not read ahead (layer 0) stays on the host
  # (its device copy in the read moved its pages into layer 0's embedding peak: RSS 6.46 against 5.98 GiB), and the
  # last sample's device copy no longer outlives the forward loop into the solve (where the layer's peak is). GPTQ
  # equal oneshot on cuda, then GPTQ 8 layers after / oneshot / before (cd40885), then NVFP4 static (after, oneshot)
  t 100 gpu_tests tests/gpu/test_calibrated_gpu.py -m gpu -k "llama-W4A16-gptq"
  bytecode_both .whl/before
  cb 330 floor_gptq --before .whl/before --stage-peaks
  cb 130 floor_nvfp4 --method rtn --scheme NVFP4
  ;;
s32a)  # thirty-first session (issue 34 part 1): a calibrated layer read ahead onto the GPU beside the previous layer's
  # write (setup copies nothing from pageable memory; each module's error measured against the host source). The GPU
  # tests that run it (equality with oneshot, errors against transformers' loading, MoE, kill and rerun), then GPTQ
  # W4A16 on 8 layers after / oneshot / before (.whl/before = `git archive cd40885 child shared supervisor`), with each
  # layer's peak GPU memory as each stage ended (where the 3.78 GiB is reached)
  t 200 gpu_tests tests/gpu/test_calibrated_gpu.py -m gpu -k "llama-W4A16-gptq or llama-W4A16-awq or qwen3moe or kill"
  bytecode_both .whl/before
  cb 320 floor_gptq --before .whl/before --stage-peaks
  ;;
s31c)  # thirtieth session: GPU tests of the boundaries' copies (334421e: layer n-2's and layer 0's outputs into pinned
  # memory asynchronously), of each calibrated module's error measured beside its shard's write (equal to transformers'
  # loading), and of the calibrated engine (GPTQ and AWQ equal oneshot, a kill); then GPTQ W4A16 on 8 layers of the 8B
  # shape after / before (.whl/before = `git archive 3cf689a child shared supervisor`: the error measured before the
  # write), no oneshot
  t 240 gpu_tests tests/test_staging.py tests/test_quant_error.py tests/gpu/test_calibrated_gpu.py -m gpu \
    -k "staging or quant_error or llama-W4A16 or kill"
  bytecode_both .whl/before
  cb 170 floor_gptq --before .whl/before --skip oneshot,kill,retry
  ;;
s31d)  # s31c in less device time: the GPTQ cases of the GPU tests only, then 6 layers after / before, no oneshot
  t 160 gpu_tests tests/test_staging.py tests/test_quant_error.py tests/gpu/test_calibrated_gpu.py -m gpu \
    -k "staging or quant_error or llama-W4A16-gptq or kill"
  bytecode_both .whl/before
  cb 150 floor_gptq --layers 6 --before .whl/before --skip oneshot,kill,retry
  ;;
s31b)  # (never run) the GPU tests of the calibrated engine and of the boundaries' copies, then bench/pin_probe.py
  t 420 calibrated tests/gpu/test_calibrated_gpu.py tests/test_staging.py tests/test_calibrate.py -m gpu
  timeout 60 python3 bench/pin_probe.py --device cuda --gib 2.1 --rounds 2 2>&1 | quiet | tee "$OUT/pin.txt"
  ;;
s31a)  # thirtieth session (issue 34 part 1), bytecode for every process: GPTQ W4A16 default on 8 layers of the 8B shape,
  # after (a42b7de: layer 0's host memory made while the plan is judged; reverted in af97fa6, as measured slower) /
  # oneshot / before (.whl/before = `git archive 3cf689a child shared supervisor`: made while layer 0 embeds and
  # computes), then NVFP4 static, then bench/pin_probe.py (whose thread failed: fixed since)
  bytecode_both .whl/before
  cb 280 floor_gptq --before .whl/before
  cb 150 floor_nvfp4 --method rtn --scheme NVFP4
  timeout 90 python3 bench/pin_probe.py --device cuda --gib 2.1 2>&1 | quiet | tee "$OUT/pin.txt"
  ;;
s30a)  # next session (issue 34 part 1), bytecode for every process: GPTQ W4A16 default on 8 layers of the 8B shape,
  # after / oneshot / before (.whl/before: make it `git archive 2f6d383 child shared supervisor`, the code of s28d:
  # the plan beside layer 0 on its GPU, layer n-2's outputs copied synchronously); then NVFP4 and FP8 static scales,
  # then bench/pin_probe.py (s30b)
  bytecode_both .whl/before
  cb 280 floor_gptq --before .whl/before
  cb 150 floor_nvfp4 --method rtn --scheme NVFP4
  cb 150 floor_fp8 --method rtn --scheme FP8
  timeout 90 python3 bench/pin_probe.py --device cuda --gib 2.1 2>&1 | quiet | tee "$OUT/pin.txt"
  ;;
s30b)  # does a boundary's pinned memory made on a thread slow the GPU's products beside it? (layer 0; ~30 s)
  timeout 90 python3 bench/pin_probe.py --device cuda --gib 2.1 2>&1 | quiet | tee "$OUT/pin.txt"
  ;;
s29c)  # twenty-ninth session (issue 34 part 1), bytecode for every process: where a calibrated plan is judged. GPTQ
  # W4A16 on 4 layers of the 8B shape: after (then: beside layer 0 on the host), before (.whl/before = 2f6d383: beside
  # it on its GPU), then after with the plan judged first (SUPERVISOR_TEST_PLAN_BESIDE=0)
  bytecode_both .whl/before
  cb 150 floor_gptq --layers 4 --before .whl/before --skip oneshot,kill,retry
  SUPERVISOR_TEST_PLAN_BESIDE=0 cb 90 floor_gptq_first --layers 4 --skip oneshot,kill,retry
  ;;
s28a)  # twenty-eighth session (issue 34 part 1): GPTQ's per-sample Hessian terms accumulated into H as stripes (mirrored
  # once) against today's mirrored term per sample and the library's; the first use of each op in a fresh process
  timeout 240 python3 bench/accumulate_probe.py --device cuda --tokens 2048 --widths 4096:2,14336:4 --samples 16 2>&1 \
    | quiet | tee "$OUT/accumulate.txt"
  ;;
s28f)  # twenty-eighth session, the shortest call (issue 34 part 1): GPTQ W4A16 default after / oneshot, bytecode for both
  bytecode_both; cb 190 floor_gptq
  ;;
s28d)  # twenty-eighth session, last call (issue 34 part 1), bytecode for every process: GPTQ W4A16 default before
  # (.whl/before, 8214df6) / after / oneshot, then NVFP4 and FP8 static scales after / oneshot
  bytecode_both .whl/before
  cb 280 floor_gptq --before .whl/before
  cb 150 floor_nvfp4 --method rtn --scheme NVFP4
  cb 150 floor_fp8 --method rtn --scheme FP8
  ;;
s28b)  # twenty-eighth session (issue 34 part 1), bytecode for every process: GPTQ W4A16 default on 8 layers of the 8B
  # shape, 128 x 2048: before (.whl/before = `git archive 8214df6 child shared supervisor`, the twenty-seventh session's
  # code), after (the Hessians' stripes into H's upper triangle; the plan judged beside layer 0) and oneshot; then the
  # per-sample accumulation probe
  bytecode_both .whl/before
  cb 400 floor_gptq --before .whl/before
  timeout 120 python3 bench/accumulate_probe.py --device cuda --tokens 2048 --widths 4096:2,14336:4 --samples 16 2>&1 \
    | quiet | tee "$OUT/accumulate.txt"
  ;;
s28c)  # twenty-eighth session (issue 34 part 1): NVFP4 and FP8 static scales, ours against oneshot, bytecode for both;
  # then the calibrated GPU tests
  bytecode_both
  cb 220 floor_nvfp4 --method rtn --scheme NVFP4
  cb 220 floor_fp8 --method rtn --scheme FP8
  CUDA_VISIBLE_DEVICES=0 t 200 calib_gpu tests/gpu/test_calibrated_gpu.py -k "llama-W4A16-gptq or kill_and_rerun or stripes"
  ;;
s27b)  # twenty-seventh session (issue 34 part 1): GPTQ W4A16 default on 8 layers of the 8B shape, 128 x 2048, and
  # NVFP4 static scales, every process with bytecode
  bytecode_both
  cb 330 floor_gptq
  cb 200 floor_nvfp4 --method rtn --scheme NVFP4
  ;;
s27d)  # twenty-seventh session (issue 34 part 1): FP8 static scales and AWQ W4A16 on 8 layers, bytecode as s27b
  bytecode_both
  cb 200 floor_fp8 --method rtn --scheme FP8
  cb 330 floor_awq --method awq
  ;;
s27c)  # next session (issue 34 parts 1/3), the image as it is (no bytecode for oneshot; ours from its cache, filled
  # first): GPTQ W4A16 default on 8 layers against oneshot
  rm -rf /tmp/calib-bench /tmp/cold-bench "$HOME/.cache/layerwise-supervisor"
  timeout 60 env PYTORCH_NVML_BASED_CUDA_CHECK=1 python3 -P -c "from child import bytecode; bytecode.cache_imports(); from child.zygote import _imports; _imports('compressed-tensors'); import child.backends.calibrate" > /dev/null 2>&1
  timeout 330 python3 bench/calib_bench.py --layers 8 --skip kill,retry 2>&1 | quiet > "$OUT/floor_gptq.txt"
  grep -A12 "^| layer" "$OUT/floor_gptq.txt" | head -13; tail -12 "$OUT/floor_gptq.txt"; rm -rf /tmp/calib-bench
  ;;
s27a)  # twenty-sixth session (issue 34 parts 1/3): this image has no bytecode (--no-compile, PYTHONDONTWRITEBYTECODE=1):
  # the warm parent's imports compiled from source against read from the workers' bytecode cache (child/bytecode.py),
  # oneshot's imports as they are and with bytecode (PYTHONPYCACHEPREFIX, writing on); then the 8B data-free cold
  # start against oneshot, the cache filled by the probe before it (the steady state of a machine that ran once)
  envs="PYTORCH_NVML_BASED_CUDA_CHECK=1 TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION=1"
  imp='import sys, time; t = time.perf_counter(); from child import bytecode; said = bytecode.cache_imports(); from child.zygote import _imports; s, f = _imports("compressed-tensors"); print(f"warm parent imports {s:.2f} s (process {time.perf_counter() - t:.2f} s); cache: {sys.pycache_prefix}")'
  one='import time; t = time.perf_counter(); from llmcompressor import oneshot; import transformers; print(f"oneshot imports: {time.perf_counter() - t:.2f} s")'
  rm -rf "$HOME/.cache/layerwise-supervisor" /tmp/pyc-oneshot
  { for c in off off fill read read; do printf "%s: " "$c"; env $envs SUPERVISOR_BYTECODE_CACHE=$([ $c = off ] && echo off || echo "") \
      timeout 60 python3 -P -c "$imp" 2>&1 | grep "warm parent"; done
    printf "oneshot as is: "; timeout 60 python3 -c "$one" 2>&1 | grep "oneshot imports"
    for c in fill read; do printf "oneshot with bytecode ($c): "; env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=/tmp/pyc-oneshot \
      timeout 60 python3 -c "$one" 2>&1 | grep "oneshot imports"; done; } | tee "$OUT/imports.txt"
  rm -rf /tmp/cold-bench
  timeout 170 python3 bench/cold_start.py --tree after=. --rounds 2 --oneshot-rounds 1 --skip imports,warm \
    --device cuda:0 2>&1 | quiet > "$OUT/cold_start.txt"
  tail -14 "$OUT/cold_start.txt"; grep -rh "bytecode" /tmp/cold-bench --include=zygote.log | sort | uniq -c
  ;;
s26b)  # twenty-fifth session, call 2 (issue 34 part 3): the data-free 8B FP8_DYNAMIC cold and warm start, before
  # (.whl/before: `git archive 1357707 child shared supervisor`) and after (datasets left out of every export worker,
  # the warm parent launched as the job is read), alternating, oneshot once
  rm -rf /tmp/cold-bench
  timeout 290 python3 bench/cold_start.py --tree before=.whl/before --tree after=. --rounds 2 --oneshot-rounds 1 \
    --skip imports --device cuda:0 2>&1 | quiet > "$OUT/cold_start.txt"
  tail -18 "$OUT/cold_start.txt"; rm -rf /tmp/cold-bench
  ;;
s26c)  # call 3 (issue 34 part 1): GPTQ W4A16 default on 8 layers of the 8B shape, 128 x 2048, before (.whl/before) and
  # after against oneshot, tensors compared; then FP8 static scales after, against oneshot
  rm -rf /tmp/calib-bench /tmp/cb-fp8
  timeout 330 python3 bench/calib_bench.py --layers 8 --before .whl/before --skip kill,retry 2>&1 | quiet \
    > "$OUT/floor_gptq.txt"
  grep -A12 "^| layer" "$OUT/floor_gptq.txt" | head -26; tail -16 "$OUT/floor_gptq.txt"; rm -rf /tmp/calib-bench
  timeout 200 python3 bench/calib_bench.py --layers 8 --method rtn --scheme FP8 --workdir /tmp/cb-fp8 \
    --skip kill,retry 2>&1 | quiet > "$OUT/floor_fp8.txt"
  grep -A11 "^| layer" "$OUT/floor_fp8.txt" | head -11; tail -12 "$OUT/floor_fp8.txt"
  ;;
s26d)  # call 4 (issue 34 part 1): NVFP4 static scales and AWQ W4A16 on 8 layers of the 8B shape, ours against oneshot
  rm -rf /tmp/cb-fp8 /tmp/cb-nvfp4 /tmp/cb-awq
  timeout 200 python3 bench/calib_bench.py --layers 8 --method rtn --scheme NVFP4 --workdir /tmp/cb-nvfp4 \
    --skip kill,retry 2>&1 | quiet > "$OUT/floor_nvfp4.txt"
  grep -A11 "^| layer" "$OUT/floor_nvfp4.txt" | head -11; tail -12 "$OUT/floor_nvfp4.txt"; rm -rf /tmp/cb-nvfp4
  timeout 380 python3 bench/calib_bench.py --layers 8 --method awq --workdir /tmp/cb-awq \
    --skip kill,retry 2>&1 | quiet > "$OUT/floor_awq.txt"
  grep -A11 "^| layer" "$OUT/floor_awq.txt" | head -11; tail -12 "$OUT/floor_awq.txt"
  ;;
s26a)  # twenty-fifth session, call 1 (issue 34): why imports take 14 s here against 3 s on the CPU VM: bytecode caches,
  # file systems, the CPU; a calibrated warm parent's imports and the worker's child.backends.calibrate under -X importtime
  envs="PYTORCH_NVML_BASED_CUDA_CHECK=1 TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION=1"
  { env | grep -i "^PYTHON\|^PIP" ; python3 -c "import sys; print(sys.version, 'dont_write_bytecode', sys.flags.dont_write_bytecode, 'prefix', sys.pycache_prefix, sys.path)"
    for m in torch sympy transformers; do python3 -c "import importlib.util as u, os, sys; s = u.find_spec('$m'); d = os.path.dirname(s.origin); c = os.path.join(d, '__pycache__'); print('$m', d, 'writable', os.access(d, os.W_OK), 'pycache', os.path.isdir(c) and len(os.listdir(c)))"; done
    find /tmp/site -name "*.pyc" | wc -l; df -hT /tmp/site "$(python3 -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("torch").origin))')"
    lscpu | grep "Model name\|^CPU(s)\|MHz"; cat /proc/loadavg; free -g | head -2; } > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
  for i in 1 2 3; do python3 -c "import time; t = time.perf_counter(); import torch; a = time.perf_counter(); import sympy; b = time.perf_counter(); import transformers; c = time.perf_counter(); print(f'torch {a - t:.2f} sympy {b - a:.2f} transformers {c - b:.2f}')"; done 2>&1 | tee "$OUT/plain.txt"
  imp='import time; t = time.perf_counter(); from child.imports import preload; preload("compressed-tensors"); a = time.perf_counter(); import child.backends.calibrate; b = time.perf_counter(); print(f"preload {a - t:.2f} calibrate {b - a:.2f}")'
  for i in 1 2; do env $envs python3 -c "$imp"; done 2>&1 | grep preload | tee "$OUT/calib_imports.txt"
  env $envs python3 -X importtime -c "$imp" 2> "$OUT/importtime.raw" > /dev/null
  awk -F'|' '/import time:/ {gsub(/ /, "", $2); print $2, $3}' "$OUT/importtime.raw" | sort -n -r | head -60 > "$OUT/importtime_cum.txt"
  awk -F'|' '/import time:/ {split($1, a, ":"); gsub(/ /, "", a[2]); print a[2], $3}' "$OUT/importtime.raw" | sort -n -r | head -60 > "$OUT/importtime_self.txt"
  head -30 "$OUT/importtime_cum.txt"; echo ==self; head -30 "$OUT/importtime_self.txt"
  mkdir -p /tmp/pyc; for i in 1 2 3; do env $envs PYTHONPYCACHEPREFIX=/tmp/pyc python3 -c "$imp"; done 2>&1 | grep preload | sed "s/^/pycache_prefix: /" | tee -a "$OUT/calib_imports.txt"
  for i in 1 2; do python3 -c 'import time; t = time.perf_counter(); from llmcompressor import oneshot; import transformers
print(f"oneshot imports: {time.perf_counter() - t:.2f} s")'; done 2>&1 | grep "oneshot imports" | tee -a "$OUT/calib_imports.txt"
  ;;
s25b)  # call 2 (issue 34 part 2's second target): 32 layers of the 8B shape, 128 x 2048, GPTQ W4A16, match_oneshot =
  # false alone against oneshot, the boundary files rewritten over spent ones (durable.take_spare), GPTQ's kernels
  # warmed first
  rm -rf /tmp/calib-bench
  timeout 570 python3 bench/calib_bench.py --layers 32 --fast --skip default,kill,retry 2>&1 \
    | grep --line-buffered -v "^W11\|WARNING\|it/s]\|Failed to load" > "$OUT/floor_gptq32.txt"
  head -8 "$OUT/floor_gptq32.txt"; grep -A34 "^| layer" "$OUT/floor_gptq32.txt" | head -36; tail -10 "$OUT/floor_gptq32.txt"
  ;;
s25c)  # call 3 (issue 34 part 1): the GPU tests of the boundaries rewritten over spares; 8 layers of the 8B shape, GPTQ
  # W4A16 default and match_oneshot = false against oneshot; FP8 static scales again (same checkpoint), tensors compared
  rm -rf /tmp/calib-bench /tmp/qb
  CUDA_VISIBLE_DEVICES=0 t 170 calib_gpu tests/gpu/test_calibrated_gpu.py -k "llama-W4A16-gptq or kill_and_rerun"
  timeout 240 python3 bench/calib_bench.py --layers 8 --fast --skip kill,retry 2>&1 | quiet > "$OUT/floor_gptq.txt"
  grep -A12 "^| layer" "$OUT/floor_gptq.txt" | head -26; tail -16 "$OUT/floor_gptq.txt"
  timeout 120 python3 bench/calib_bench.py --layers 8 --method rtn --scheme FP8 --keep --skip kill,retry 2>&1 \
    | quiet > "$OUT/floor_fp8.txt"
  grep -A11 "^| layer" "$OUT/floor_fp8.txt" | head -11; tail -12 "$OUT/floor_fp8.txt"
  ;;
s25d)  # call 4 (issue 34 part 1): static activation scales with the boundaries over spares: FP8 and NVFP4 on 8 layers of
  # the 8B shape, 128 x 2048, ours against oneshot, tensors compared (each bench in a workdir of its own)
  rm -rf /tmp/calib-bench /tmp/cb-fp8 /tmp/cb-nvfp4
  timeout 170 python3 bench/calib_bench.py --layers 8 --method rtn --scheme FP8 --workdir /tmp/cb-fp8 \
    --skip kill,retry 2>&1 | quiet > "$OUT/floor_fp8.txt"
  grep -A11 "^| layer" "$OUT/floor_fp8.txt" | head -11; tail -12 "$OUT/floor_fp8.txt"; rm -rf /tmp/cb-fp8
  timeout 200 python3 bench/calib_bench.py --layers 8 --method rtn --scheme NVFP4 --workdir /tmp/cb-nvfp4 \
    --skip kill,retry 2>&1 | quiet > "$OUT/floor_nvfp4.txt"
  grep -A11 "^| layer" "$OUT/floor_nvfp4.txt" | head -11; tail -12 "$OUT/floor_nvfp4.txt"
  ;;
s25a)  # twenty-fourth session, call 1 (issue 34): this disk's facts; fresh boundary files against spent ones rewritten in
  # place (bench/unlink_probe.py, 2.1 GB, as a run's boundaries); FP8 static activation scales on 8 layers of the 8B
  # shape (part 1's last unmeasured scheme), ours against oneshot, tensors compared
  rm -rf /tmp/calib-bench /tmp/cb-fp8
  { df -hT /tmp; grep " / \| /tmp " /proc/mounts; } > "$OUT/disk.txt" 2>&1; cat "$OUT/disk.txt"
  timeout 150 python3 bench/unlink_probe.py --dir /tmp --gb 2.1 --rounds 6 2>&1 | tee "$OUT/unlink_probe.txt"
  timeout 330 python3 bench/calib_bench.py --layers 8 --method rtn --scheme FP8 --workdir /tmp/cb-fp8 \
    --skip kill,retry 2>&1 | quiet > "$OUT/floor_fp8.txt"
  grep -A11 "^| layer" "$OUT/floor_fp8.txt" | head -11; tail -14 "$OUT/floor_fp8.txt"
  ;;
s24a)  # twenty-third session, call 1 (issue 34 part 2's second target): 32 layers of the 8B shape, 128 x 2048,
  # GPTQ W4A16, match_oneshot = false alone (--skip default) against oneshot, the device libraries warmed first
  rm -rf /tmp/calib-bench
  timeout 570 python3 bench/calib_bench.py --layers 32 --fast --skip default,kill,retry 2>&1 \
    | grep --line-buffered -v "^W11\|WARNING\|it/s]\|Failed to load" > "$OUT/floor_gptq32.txt"
  head -6 "$OUT/floor_gptq32.txt"; grep "^| mean\|wall\|oneshot" "$OUT/floor_gptq32.txt" | head; tail -8 "$OUT/floor_gptq32.txt"
  ;;
s23c)  # call 3 (issue 34 part 2's second target): 32 layers of the 8B shape, 128 x 2048, GPTQ W4A16: ours with
  # match_oneshot = false alone (--skip default), then oneshot, bounded by the device time left (ours is printed first)
  rm -rf /tmp/calib-bench
  timeout 350 python3 bench/calib_bench.py --layers 32 --fast --skip default,kill,retry 2>&1 \
    | grep --line-buffered -v "^W11\|WARNING\|it/s]\|Failed to load" > "$OUT/floor_gptq32.txt"
  head -5 "$OUT/floor_gptq32.txt"; grep "^| mean\|wall\|oneshot" "$OUT/floor_gptq32.txt" | head; tail -8 "$OUT/floor_gptq32.txt"
  ;;
s23b)  # call 2 (issue 34 part 2): GPTQ's factor from the reversed Hessian (child/backends/factorize.py) added, SDPA on
  # cuda only: the GPU unit tests of the new code, the fidelity test on cuda (hidden 1024), then 8 layers of the 8B
  # shape, default and match_oneshot = false against oneshot, the stage clock synced
  rm -rf /tmp/calib-bench
  CUDA_VISIBLE_DEVICES=0 t 60 unit_gpu tests/test_factorize.py tests/test_hessians.py -k cuda
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short -s \
    tests/gpu/test_calibrated_gpu.py -k match_oneshot_false 2>&1 | quiet > "$OUT/fidelity_gpu.txt"
  grep "held-out\|passed\|failed\|Error" "$OUT/fidelity_gpu.txt" | head -8
  timeout 330 python3 bench/calib_bench.py --layers 8 --fast --sync-stages --skip kill,retry 2>&1 | quiet \
    > "$OUT/floor_gptq.txt"
  grep -A12 "^| layer" "$OUT/floor_gptq.txt" | head -30; tail -16 "$OUT/floor_gptq.txt"
  ;;
s23a)  # twenty-second session, call 1 (run: docs/benchmarks.md) (issue 34 part 2): match_oneshot = false with SDPA attention and the Hessian as
  # the GEMM's accumulator (hessians.FastTerm), before (.whl/before = `git archive 12e0c1f child shared supervisor`)
  # and after, 4 layers, stage clock synced (--sync-stages); the attention probe; the solve's kernels and TF32; the
  # GPU tests of the new code and of 98287aa's one-slot change
  rm -rf /tmp/calib-bench /tmp/qb
  timeout 60 python3 bench/attention_probe.py --device cuda --samples 128 2>&1 | quiet | tee "$OUT/attention_probe.txt" | tail -6
  timeout 90 python3 bench/solve_probe.py --device cuda --profile 2>&1 | quiet > "$OUT/solve_probe.txt"
  grep "^|" "$OUT/solve_probe.txt"
  timeout 240 python3 bench/calib_bench.py --layers 4 --fast --sync-stages --before .whl/before --skip kill,retry,oneshot \
    2>&1 | quiet > "$OUT/floor_gptq.txt"
  grep -A8 "^| layer" "$OUT/floor_gptq.txt" | head -30; tail -22 "$OUT/floor_gptq.txt"
  rm -rf /tmp/calib-bench
  CUDA_VISIBLE_DEVICES=0 t 40 unit_gpu tests/test_hessians.py tests/test_quant_error.py tests/test_staging.py -k "cuda or device or staging"
  CUDA_VISIBLE_DEVICES=0 t 170 calib_gpu tests/gpu/test_calibrated_gpu.py -k "llama-W4A16-gptq or kill_and_rerun"
  ;;
s22e)  # NOT RUN yet (refused: the twenty-first session's device time was spent): the quantization error summed on the
  # device, one wait per module (child/backends/quant_error.py): NVFP4 static scales on 4 layers, before (.whl/before
  # = `git archive 0f5b55d~1 child shared supervisor`: the error as before) and after, no oneshot, the two outputs compared; the error's GPU test; eager attention against SDPA for one 8B layer
  # (bench/attention_probe.py: what `match_oneshot = false` could save with SDPA)
  rm -rf /tmp/calib-bench /tmp/cold-bench /tmp/cb-nvfp4
  timeout 60 python3 bench/attention_probe.py --device cuda --samples 128 2>&1 | quiet | tee "$OUT/attention_probe.txt"
  timeout 105 python3 bench/calib_bench.py --layers 4 --method rtn --scheme NVFP4 --workdir /tmp/cb-nvfp4 \
    --before .whl/before --skip kill,retry,oneshot 2>&1 | quiet > "$OUT/floor_nvfp4.txt"
  grep "^| [0-9] \|^| mean\|^| supervisor\|before / after" "$OUT/floor_nvfp4.txt"
  CUDA_VISIBLE_DEVICES=0 t 25 quant_error_gpu tests/test_quant_error.py -k device
  ;;
s22d)  # call 4: NVFP4 static scales on 4 layers again, the shards back to the page cache (s22c's were written past
  # it, slower), the boundaries past it: ours against oneshot, tensors compared
  rm -rf /tmp/calib-bench /tmp/cold-bench /tmp/cb-nvfp4
  timeout 200 python3 bench/calib_bench.py --layers 4 --method rtn --scheme NVFP4 --workdir /tmp/cb-nvfp4 \
    --skip kill,retry 2>&1 | quiet > "$OUT/floor_nvfp4.txt"
  grep -A7 "^| layer" "$OUT/floor_nvfp4.txt" | head -7; tail -12 "$OUT/floor_nvfp4.txt"
  ;;
s22c)  # call 3 (issue 34 parts 3 and 1): shards written past the page cache too (child/writer.py, durable.write_direct):
  # the data-free 8B FP8_DYNAMIC cold and warm start, before (.whl/before: c8699ef) and after, alternating, oneshot
  # once; then NVFP4 static scales on 4 layers (its boundaries were disk-bound), ours against oneshot, tensors compared
  rm -rf /tmp/calib-bench /tmp/cold-bench /tmp/cb-nvfp4
  timeout 290 python3 bench/cold_start.py --tree before=.whl/before --tree after=. --rounds 2 --oneshot-rounds 1 \
    --skip imports --device cuda:0 2>&1 | quiet > "$OUT/cold_start.txt"
  tail -18 "$OUT/cold_start.txt"; rm -rf /tmp/cold-bench
  timeout 180 python3 bench/calib_bench.py --layers 4 --method rtn --scheme NVFP4 --workdir /tmp/cb-nvfp4 \
    --skip kill,retry 2>&1 | quiet > "$OUT/floor_nvfp4.txt"
  grep -A7 "^| layer" "$OUT/floor_nvfp4.txt" | head -7; tail -12 "$OUT/floor_nvfp4.txt"
  ;;
s22b)  # call 2 (issue 34 parts 1 and 2): the boundaries written past the page cache (O_DIRECT, durable.write_direct):
  # GPTQ W4A16 on 8 layers of the 8B shape, 128 x 2048: ours default and match_oneshot = false, before (.whl/before:
  # c8699ef) and after, oneshot, tensors compared; then the calibrated kill-and-rerun GPU test (boundaries resumed)
  rm -rf /tmp/calib-bench /tmp/qb
  timeout 420 python3 bench/calib_bench.py --layers 8 --fast --before .whl/before --skip kill,retry 2>&1 | quiet \
    > "$OUT/floor_gptq.txt"
  grep -A12 "^| layer" "$OUT/floor_gptq.txt" | head -26; tail -16 "$OUT/floor_gptq.txt"
  rm -rf /tmp/calib-bench
  CUDA_VISIBLE_DEVICES=0 t 150 calib_gpu "tests/gpu/test_calibrated_gpu.py::test_cuda_kill_and_rerun_is_byte_identical"
  ;;
s22a)  # twenty-first session, call 1: how fast one boundary-sized file becomes durable on this disk, by method
  # (bench/disk_probe.py: the buffered one-thread path of today against parallel and O_DIRECT writes); where the warm
  # parent's imports go on this machine; the GPU tests of c8699ef's writer (the Future buffer) and the equality case
  timeout 150 python3 bench/disk_probe.py --dir /tmp --gb 2.1 --rounds 2 2>&1 | tee "$OUT/disk_probe.txt"
  df -hT /tmp >> "$OUT/disk_probe.txt"; tail -1 "$OUT/disk_probe.txt"
  preload_profile
  CUDA_VISIBLE_DEVICES=0 t 260 gpu_tests tests/test_staging.py tests/gpu/test_quality_gpu.py \
    tests/gpu/test_calibrated_gpu.py -k "staging or quality or llama-W4A16-gptq"
  ;;
s21a)  # twentieth session, call 1 (issue 36): where the head's time goes (bench/head_probe.py); verify --quality on 8
  # layers of the 8B shape, 64 x 2048, with the boundary files streamed while the samples come and layer 0's
  # outputs' memory made meanwhile; the GPU tests of both (~6 min on a fresh machine)
  rm -rf /tmp/qb
  timeout 90 python3 bench/head_probe.py --device cuda 2>&1 | quiet | tee "$OUT/head_probe.txt"
  timeout 260 python3 bench/quality_bench.py --layers 8 --work /tmp/qb 2>&1 | quiet > "$OUT/quality_bench.txt"
  tail -34 "$OUT/quality_bench.txt"
  CUDA_VISIBLE_DEVICES=0 t 150 gpu_tests tests/test_staging.py tests/gpu/test_quality_gpu.py
  ;;
s21b)  # call 2 (issue 34 part 1): GPTQ W4A16 on 8 layers of the 8B shape, 128 x 2048, ours (stripes, registered
  # boundary memory, layer 0's outputs' memory made meanwhile) against oneshot on one machine, tensors compared;
  # then the calibrated kill-and-rerun GPU test
  rm -rf /tmp/calib-bench /tmp/qb
  timeout 330 python3 bench/calib_bench.py --layers 8 --skip kill,retry 2>&1 | quiet > "$OUT/floor_gptq.txt"
  tail -40 "$OUT/floor_gptq.txt"
  CUDA_VISIBLE_DEVICES=0 t 120 calib_gpu "tests/gpu/test_calibrated_gpu.py::test_cuda_kill_and_rerun_is_byte_identical"
  ;;
s21c)  # call 3 (issue 34 part 1): the samples' copies beside the compute (Activations.to_device ahead, the boundary's
  # device -> host copies on a stream of their own): GPTQ 8 layers ours against oneshot, tensors compared; the GPU
  # tests of both copy paths, the calibrated equality cases they touch, verify --quality's
  rm -rf /tmp/calib-bench /tmp/qb
  timeout 300 python3 bench/calib_bench.py --layers 8 --skip kill,retry 2>&1 | quiet > "$OUT/floor_gptq.txt"
  grep -A12 "^| layer" "$OUT/floor_gptq.txt" | head -12; tail -9 "$OUT/floor_gptq.txt"
  rm -rf /tmp/calib-bench
  CUDA_VISIBLE_DEVICES=0 t 260 gpu_tests tests/test_staging.py tests/gpu/test_quality_gpu.py \
    tests/gpu/test_calibrated_gpu.py -k "staging or quality or llama-W4A16-gptq or llama-W4A16-awq or qwen3moe"
  ;;
s21d)  # call 4: the copies' memory from the compute stream's own pool (s21c's side-stream pools grew the tree's
  # GPU memory 6.15 -> 10.97 GiB): GPTQ 8 layers ours only, then the GPU tests of the copy paths and one equality case
  rm -rf /tmp/calib-bench
  timeout 150 python3 bench/calib_bench.py --layers 8 --skip kill,retry,oneshot 2>&1 | quiet > "$OUT/floor_gptq.txt"
  grep -A12 "^| layer" "$OUT/floor_gptq.txt" | head -12; tail -5 "$OUT/floor_gptq.txt"
  rm -rf /tmp/calib-bench
  CUDA_VISIBLE_DEVICES=0 t 100 gpu_tests tests/test_staging.py tests/gpu/test_calibrated_gpu.py -k "staging or llama-W4A16-gptq"
  ;;
s20a)  # next session (NOT RUN yet): verify --quality with the head's sums on the device and the inputs copied without
  # a wait (5bfd920), against issue 36's 2x; then GPTQ 8 layers ours (stripes, registered boundary memory) against
  # oneshot on the same machine for issue 34's 0.55x (~8 min on a fresh machine)
  rm -rf /tmp/calib-bench /tmp/qb
  timeout 200 python3 bench/quality_bench.py --layers 8 --work /tmp/qb 2>&1 | quiet > "$OUT/quality_bench.txt"
  tail -32 "$OUT/quality_bench.txt"; rm -rf /tmp/qb
  timeout 300 python3 bench/calib_bench.py --layers 8 --skip kill,retry 2>&1 | quiet > "$OUT/floor_gptq.txt"
  tail -14 "$OUT/floor_gptq.txt"
  ;;
s19c)  # call 3: the boundaries' host memory registered instead of cudaHostAlloc'd (and reused by verify --quality,
  # whose files are written by four threads): GPTQ 8 layers ours before (.whl/before: 72d1957, the stripes alone)
  # and after, tensors compared; verify --quality on that checkpoint; the GPU tests of both paths
  rm -rf /tmp/calib-bench /tmp/qb
  timeout 200 python3 bench/calib_bench.py --layers 8 --before .whl/before --skip kill,retry,oneshot 2>&1 | quiet \
    > "$OUT/floor_gptq.txt"
  grep -A12 "^| layer" "$OUT/floor_gptq.txt" | head -12; tail -8 "$OUT/floor_gptq.txt"
  mkdir -p /tmp/qb; ln -s /tmp/calib-bench/model /tmp/qb/src
  timeout 170 python3 bench/quality_bench.py --layers 8 --work /tmp/qb 2>&1 | quiet > "$OUT/quality_bench.txt"
  tail -32 "$OUT/quality_bench.txt"
  CUDA_VISIBLE_DEVICES=0 t 140 gpu_tests tests/test_staging.py tests/gpu/test_quality_gpu.py \
    "tests/gpu/test_calibrated_gpu.py::test_cuda_kill_and_rerun_is_byte_identical"
  ;;
s19a)  # nineteenth session, call 1 (issue 34 part 1): which stripe counts equal the full matmul (more counts than
  # sym34 tried); GPTQ W4A16 on 8 layers of the 8B shape, 128 x 2048: ours before (.whl/before: git archive of
  # 72d1957, the verified stripes alone), ours after (the Hessians on a stream beside the forward too), oneshot,
  # tensors compared; the GPU test of the stripes; GPTQ's solve per batch and on a stream each (bench/solve_probe.py)
  rm -rf /tmp/calib-bench /tmp/cold-bench /tmp/cb-awq /tmp/cb-nvfp4 /tmp/qb
  timeout 50 python3 bench/symmetric_probe.py --device cuda --tokens 2048 --widths 4096,14336 \
    --blocks 8,6,5,4,3,2 --seeds 2 2>&1 | quiet | tee "$OUT/symmetric_probe.txt"
  timeout 60 python3 bench/solve_probe.py --device cuda 2>&1 | quiet | tee "$OUT/solve_probe.txt"
  timeout 370 python3 bench/calib_bench.py --layers 8 --before .whl/before --skip kill,retry 2>&1 | quiet \
    > "$OUT/floor_gptq.txt"
  tail -40 "$OUT/floor_gptq.txt"
  CUDA_VISIBLE_DEVICES=0 t 100 stripes_gpu tests/gpu/test_calibrated_gpu.py -k stripes -s
  grep "hessians: width" "$OUT/stripes_gpu.txt"
  ;;
s19b)  # call 2 (issue 36): verify --quality on 8 layers of the 8B shape, 64 x 2048, W4A16 (the checkpoint of s19a
  # where the machine kept it), the measurement's start-up apart; then the calibrated GPU tests (the Hessians'
  # stripes and side stream against oneshot on cuda, every case)
  mkdir -p /tmp/qb; [ -e /tmp/qb/src ] || { [ -d /tmp/calib-bench/model ] && ln -s /tmp/calib-bench/model /tmp/qb/src; }
  timeout 400 python3 bench/quality_bench.py --layers 8 --work /tmp/qb 2>&1 | quiet > "$OUT/quality_bench.txt"
  tail -22 "$OUT/quality_bench.txt"; df -h /tmp > "$OUT/df.txt"
  CUDA_VISIBLE_DEVICES=0 t 190 calibrated_gpu tests/gpu/test_calibrated_gpu.py
  ;;
sym34)  # eighteenth session: GPTQ's Hessian term as mirrored upper-triangle stripes, bit for bit the library's?
  # (bench/symmetric_probe.py); then issue 36's figure: verify --quality on 8 layers of the 8B shape, 64 x 2048
  rm -rf /tmp/calib-bench /tmp/cold-bench /tmp/cb-awq /tmp/cb-nvfp4 /tmp/qb
  timeout 120 python3 bench/symmetric_probe.py --device cuda --tokens 2048 --widths 4096,14336 --blocks 2,4,8 \
    2>&1 | quiet | tee "$OUT/symmetric_probe.txt"
  timeout 420 python3 bench/quality_bench.py --layers 8 --work /tmp/qb 2>&1 | quiet > "$OUT/quality_bench.txt"
  tail -20 "$OUT/quality_bench.txt"
  ;;
q36b)  # sym34's quality bench again on the same machine (its checkpoint and export kept in /tmp/qb): the per-layer
  # seconds, and the forwards (both models at once: the figures per sample)
  timeout 400 python3 bench/quality_bench.py --layers 8 --work /tmp/qb 2>&1 | quiet > "$OUT/quality_bench.txt"
  tail -20 "$OUT/quality_bench.txt"; df -h /tmp /dev/shm > "$OUT/df.txt"; cat "$OUT/df.txt"
  ;;
q36)  # issue 36 and 34: verify --quality on 8 layers of the 8B shape (64 x 2048, W4A16) against one bf16 forward of
  # the source plus one of the export; its GPU tests; NVFP4's static scales on 4 layers (ours and oneshot)
  rm -rf /tmp/calib-bench /tmp/cold-bench /tmp/cb-awq /tmp/cb-nvfp4
  timeout 240 python3 bench/quality_bench.py --layers 8 --work /tmp/qb 2>&1 | quiet > "$OUT/quality_bench.txt"
  tail -20 "$OUT/quality_bench.txt"; rm -rf /tmp/qb
  CUDA_VISIBLE_DEVICES=0 t 150 quality_gpu tests/gpu/test_quality_gpu.py
  timeout 170 python3 bench/calib_bench.py --layers 4 --method rtn --scheme NVFP4 --workdir /tmp/cb-nvfp4 \
    --skip kill,retry 2>&1 | quiet > "$OUT/floor_nvfp4.txt"
  tail -24 "$OUT/floor_nvfp4.txt"
  ;;
floor3)  # issue 34, seventeenth session: GPTQ W4A16 on 8 layers of the 8B shape, 128 x 2048: ours by default (the
  # calibrated non-layer part copied ahead), ours with match_oneshot = false, and oneshot; then cold34
  timeout 300 python3 bench/calib_bench.py --layers 8 --fast --skip kill,retry 2>&1 | quiet > "$OUT/floor_gptq.txt"
  tail -70 "$OUT/floor_gptq.txt"
  timeout 230 python3 bench/cold_start.py --tree before=.whl/before --tree after=. --rounds 2 --oneshot-rounds 1 \
    --skip imports --device cuda:0 2>&1 | quiet > "$OUT/cold_start.txt"
  tail -16 "$OUT/cold_start.txt"
  ;;
cold34)  # issue 34 part 3, one H200: the data-free cold start of the packages before it (bench/before, made before
  # the call: `mkdir -p bench/before && git archive b4cb009 child shared supervisor | tar -x -C bench/before`)
  # against this tree's, alternating, two rounds: the warm parent's imports, 8B FP8_DYNAMIC cold and warm; oneshot once
  timeout 280 python3 bench/cold_start.py --tree before=bench/before --tree after=. --rounds 2 --oneshot-rounds 1 \
    --skip imports --device cuda:0 2>&1 | quiet > "$OUT/cold_start.txt"
  tail -16 "$OUT/cold_start.txt"
  ;;
s29)  # issue 29, on a machine of N GPUs (nvidia-h200-x2/-x4/-x8; NOT RUN yet: no such kind was lent so far): the
  # calibrated group on every GPU against W = 1 and llm-compressor's distributed oneshot at the same W (8 layers
  # of the 8B shape, 128 x 2048 random ids, GPTQ W4A16), then the NCCL group's tests
  N=$(nvidia-smi -L | wc -l)
  timeout 560 python3 bench/calib_bench.py --device cuda --world "$N" --layers 8 --skip oneshot,kill,retry \
    2>&1 | quiet > "$OUT/calib_group_$N.txt"
  tail -16 "$OUT/calib_group_$N.txt"
  ;;
s29b)  # issue 29, second call: a rank SIGKILLed mid-layer on the NCCL group (retried in the run; the bytes equal
  # the uninterrupted run's, the time lost at most one layer plus the restart), reusing s29's workdir
  N=$(nvidia-smi -L | wc -l)
  timeout 560 python3 bench/calib_bench.py --device cuda --world "$N" --layers 8 --kill-at 4 --keep \
    --skip supervisor,oneshot,kill,w1,dist 2>&1 | quiet > "$OUT/calib_group_kill_$N.txt"
  tail -6 "$OUT/calib_group_kill_$N.txt"
  ;;
s14b)  # fourteenth session, call 2: the data-free GPU tests after the protocol's version 5 and the worker's stage
  # clock (nothing data-free changed otherwise)
  CUDA_VISIBLE_DEVICES=0 t 300 export_gpu tests/gpu/test_export_gpu.py tests/test_staging.py
  CUDA_VISIBLE_DEVICES=0 t 230 moe_gpu tests/gpu/test_moe_gpu.py
  ;;
s14a)  # fourteenth session, call 1 (one H200): the calibrated GPU tests after the group's changes to the calibrated
  # worker (stage clock, library stage wrappers, losses), then 8 layers of the 8B shape with GPTQ on one rank (W = 1
  # must not be slower than before the group: 72.9 s measured by the issue), ours only
  CUDA_VISIBLE_DEVICES=0 t 230 calibrated_gpu tests/gpu/test_calibrated_gpu.py
  CUDA_VISIBLE_DEVICES=0 timeout 330 python3 bench/calib_bench.py --layers 8 --skip oneshot,kill,retry \
    --threads 16 2>&1 | quiet > "$OUT/calib_w1.txt"
  tail -12 "$OUT/calib_w1.txt"
  ;;
s13a)  # thirteenth session, call 2: the GPU tests of what the twelfth session changed (datasets left unloaded in a
  # data-free warm parent, a calibrated run's warm profile of its own): the export tests, then the calibrated ones
  # (200 s was too short for the export tests on a fresh machine, which compiles the kernels first: 4 of 11 ran)
  CUDA_VISIBLE_DEVICES=0 t 300 export_gpu tests/gpu/test_export_gpu.py tests/test_staging.py
  CUDA_VISIBLE_DEVICES=0 t 270 calibrated_gpu tests/gpu/test_calibrated_gpu.py
  ;;
s13b)  # call 3: the export tests s13a's 200 s did not reach (a fresh machine compiles the kernels first), the MoE
  # tests on cuda, then 8B FP8_DYNAMIC cold against oneshot and model_free_ptq once more
  CUDA_VISIBLE_DEVICES=0 t 150 export_gpu_rest tests/gpu/test_export_gpu.py tests/test_staging.py -k "busy_gpu or staged or buffer or pinned or host_tensors"
  CUDA_VISIBLE_DEVICES=0 t 230 moe_gpu tests/gpu/test_moe_gpu.py
  eb 200 export_fp8 16 --skip kill,1w,warm
  ;;
s13c)  # call 4: 8B FP8_DYNAMIC cold against oneshot once more (the last device time of the session)
  eb 240 export_fp8 16 --skip kill,1w,warm,model_free_ptq
  ;;
s12a)  # next session, call 1: the final form of the Triton key (its module imported on the warm parent's main
  # thread) checked, then 8B W4A16 and FP8_DYNAMIC cold against oneshot and model_free_ptq, part by part
  triton_key_check
  eb 250 export_w4a16 40 --scheme W4A16 --skip kill,1w,warm --per-layer
  eb 250 export_fp8 40 --skip kill,1w,warm --per-layer
  ;;
s11e)  # call 5, two GPUs: 8B FP8_DYNAMIC with the default workers (three, over both GPUs) against oneshot
  rm -rf /tmp/export-bench
  timeout 250 python3 bench/export_bench.py --device cuda --measure-error false --skip kill,1w,warm,model_free_ptq \
    2>&1 | quiet > "$OUT/export_fp8_2gpu.txt"
  tail -14 "$OUT/export_fp8_2gpu.txt"
  ;;
s11c)  # call 3: after the read-ahead's own stream and the warm parent's Triton key: 8B W4A16 and FP8_DYNAMIC cold
  # against oneshot and model_free_ptq, part by part, one worker beside the default three
  eb 290 export_w4a16 80 --scheme W4A16 --skip kill,1w,warm --workers 0,1 --per-layer
  eb 290 export_fp8 80 --skip kill,1w,warm --workers 0,1 --per-layer
  ;;
s11d)  # call 4: the read-ahead's copy after the quantize stage instead of beside it: 8B W4A16 and FP8_DYNAMIC cold
  # against oneshot, part by part; then the GPU export and staging tests
  eb 190 export_w4a16_2 80 --scheme W4A16 --skip kill,1w,warm,model_free_ptq --per-layer
  eb 190 export_fp8_2 80 --skip kill,1w,warm,model_free_ptq --per-layer
  CUDA_VISIBLE_DEVICES=0 t 200 export_gpu tests/gpu/test_export_gpu.py tests/test_staging.py
  ;;
s11b)  # call 2: a fresh worker's first part and a read-ahead copy beside the quantize stage (bench/first_part.py)
  # (each scheme twice: a fresh machine's first process compiles the Triton kernels, the second finds them cached)
  for run in W4A16.1 W4A16.2 FP8_DYNAMIC.1 FP8_DYNAMIC.2; do
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/first_part.py --device cuda:0 --scheme ${run%.*} 2>&1 | quiet \
      > "$OUT/first_part_$run.txt"
    echo "== $run"; grep "imports\|context\|LayerQuantizer\|first quantize\|alone\|with the next" "$OUT/first_part_$run.txt"
  done
  ;;
s11a)  # eleventh session, call 1: where W4A16's quantize stage goes with three workers on one GPU, part by part
  # (a per-process first-part cost, or a steady pace slowed by the other workers), against one worker; then FP8_DYNAMIC
  eb 300 export_w4a16 90 --scheme W4A16 --skip kill,1w,warm,model_free_ptq --workers 0,1 --per-layer
  eb 200 export_fp8 50 --skip kill,1w,warm,model_free_ptq,oneshot --per-layer
  ;;
s10a)  # tenth session, call 1: the non-layer part written by the supervisor during the imports
  # (supervisor/run/verbatim.py): 8B FP8_DYNAMIC and W4A16 cold against oneshot and model_free_ptq, kernels warmed
  eb 280 export_fp8 16 --skip kill,1w,warm
  eb 280 export_w4a16 16 --scheme W4A16 --skip kill,1w,warm
  ;;
s10b)  # call 2: the GPU export tests (the copy on cuda runs among them), then FP8_DYNAMIC again
  CUDA_VISIBLE_DEVICES=0 t 240 export_gpu tests/gpu/test_export_gpu.py
  eb 280 export_fp8_2 16 --skip kill,1w,warm
  ;;
s10c)  # call 3: the GPU export tests after their fix (six layers for the busy GPU; the planner's context allowed),
  # then W4A16 again
  CUDA_VISIBLE_DEVICES=0 t 240 export_gpu tests/gpu/test_export_gpu.py
  eb 280 export_w4a16_2 16 --scheme W4A16 --skip kill,1w,warm
  ;;
s10d)  # call 4: the MoE families on cuda against oneshot, their non-layer parts now the supervisor's copy
  CUDA_VISIBLE_DEVICES=0 t 230 moe_gpu tests/gpu/test_moe_gpu.py
  ;;
s9d)  # call 4: the same benches with the quantization's triton kernels compiled before any tool runs (export_bench's
  # warm step): 8B FP8_DYNAMIC and W4A16 cold against oneshot and model_free_ptq
  eb 280 export_fp8 14 --skip kill,1w,warm
  eb 280 export_w4a16 14 --scheme W4A16 --skip kill,1w,warm
  ;;
s9c)  # call 3: 8B W4A16 cold (default three workers) against oneshot and model_free_ptq in one bench
  eb 400 export_w4a16 14 --scheme W4A16 --skip kill,1w,warm
  ;;
s9b)  # call 2, one H200: the GPU tests whose workers the default count sets (MoE on cuda; a live model released
  # for the workers: studio, offload), after the left-out worker's change
  CUDA_VISIBLE_DEVICES=0 t 230 moe_gpu tests/gpu/test_moe_gpu.py
  t 330 studio tests/gpu/test_studio_gpu.py tests/gpu/test_offload_gpu.py
  ;;
s9a)  # ninth session, call 1: an extra worker a busy GPU cannot hold is left out (tests/gpu/test_export_gpu.py),
  # then 8B FP8_DYNAMIC cold with the default three workers and with four, against oneshot
  CUDA_VISIBLE_DEVICES=0 t 240 export_gpu tests/gpu/test_export_gpu.py
  eb 320 export_fp8 18 --workers 0,4 --skip kill,1w,model_free_ptq
  ;;
s8e)  # call 5: 8B W4A16 cold (default workers) against model_free_ptq
  eb 200 export_w4a16 10 --scheme W4A16 --skip kill,1w,oneshot,warm
  ;;
s8d)  # call 4: with peft marked absent where it is installed: the calibrated exports (llm-compressor's sequential
  # pipeline, which checks for it) and torchao's, against their references on cuda
  CUDA_VISIBLE_DEVICES=0 t 330 calibrated_gpu tests/gpu/test_calibrated_gpu.py
  CUDA_VISIBLE_DEVICES=0 t 150 torchao_gpu tests/gpu/test_torchao_gpu.py
  ;;
s8c)  # call 3, two GPUs: 8B FP8_DYNAMIC with the default workers (three: two on the first GPU) and with one per GPU,
  # against oneshot; then the MoE tests on cuda (most of them with the default workers)
  rm -rf /tmp/export-bench
  timeout 260 python3 bench/export_bench.py --device cuda --measure-error false \
    --workers 0,2 --skip kill,1w,model_free_ptq 2>&1 | quiet > "$OUT/export_fp8_2gpu.txt"
  tail -16 "$OUT/export_fp8_2gpu.txt"
  CUDA_VISIBLE_DEVICES=0 t 220 moe_gpu tests/gpu/test_moe_gpu.py
  ;;
s8b)  # call 2: three workers by default and the parts' workers started while the planner's finishes starting:
  # 8B FP8_DYNAMIC cold (and with two workers) against oneshot and model_free_ptq, W4A16 cold, tests/gpu/test_export_gpu.py
  eb 300 export_fp8 18 --workers 0,2 --skip kill,1w
  eb 130 export_w4a16 10 --scheme W4A16 --skip kill,1w,model_free_ptq,warm
  CUDA_VISIBLE_DEVICES=0 t 120 export_gpu tests/gpu/test_export_gpu.py
  ;;
s8a)  # eighth session, call 1: the final code as a whole on one H200, peft out of the warm parent: its imports
  # (twice), 8B FP8_DYNAMIC cold against oneshot and model_free_ptq with the default two workers and with three,
  # then W4A16 the same (the work against the disk's write floor by worker count)
  rm -rf /tmp/export-bench
  warm_parent_imports peft triton sympy datasets pandas sklearn scipy
  eb 300 export_fp8 18 --workers 0,3 --skip kill,1w
  eb 160 export_w4a16 14 --scheme W4A16 --workers 0,3 --skip kill,1w,model_free_ptq,warm
  ;;
s7e)  # call 5: the export plan judged while the first parts run: 8B FP8_DYNAMIC and W4A16 against oneshot, and the
  # NVFP4 MoE refusal on cuda (the layers written meanwhile removed)
  rm -rf /tmp/export-bench
  CUDA_VISIBLE_DEVICES=0 t 60 moe_refused tests/gpu/test_moe_gpu.py -k refused
  eb 170 export_fp8 14 --skip kill,1w,model_free_ptq
  eb 130 export_w4a16 10 --scheme W4A16 --skip kill,1w,model_free_ptq,warm
  ;;
s7d)  # call 4: what the marking of transformers' optional extras could break where they are installed: the
  # calibrated exports (datasets, the sequential pipeline) and torchao's, against their references on cuda
  CUDA_VISIBLE_DEVICES=0 t 420 calibrated_gpu tests/gpu/test_calibrated_gpu.py
  CUDA_VISIBLE_DEVICES=0 t 150 torchao_gpu tests/gpu/test_torchao_gpu.py
  ;;
s7b)  # call 2: the warm parent's imports without transformers' optional extras; 8B FP8_DYNAMIC against oneshot and
  # model_free_ptq (cold, then forking from the kept parent), and W4A16, with the shorter start-up and tail
  rm -rf /tmp/export-bench
  warm_parent_imports triton sympy datasets pandas sklearn scipy torchvision
  eb 280 export_fp8 14 --skip kill,1w
  eb 200 export_w4a16 13 --scheme W4A16 --skip kill,1w,model_free_ptq
  ;;
s7c)  # call 3, two GPUs: 8B FP8_DYNAMIC with one worker per GPU against oneshot, then the GPU tests that need two
  rm -rf /tmp/export-bench
  timeout 300 python3 bench/export_bench.py --device cuda --measure-error false \
    --skip kill,1w,model_free_ptq 2>&1 | quiet > "$OUT/export_fp8_2gpu.txt"
  tail -14 "$OUT/export_fp8_2gpu.txt"
  t 200 offload_gpu tests/gpu/test_offload_gpu.py
  ;;
s7a)  # seventh session, call 1: where the warm parent's imports go now, the pinned buffer's fallback, the MoE tests
  # (not run since the buffer), and one 8B FP8_DYNAMIC cold run with its start-up and tail timed
  preload_profile
  CUDA_VISIBLE_DEVICES=0 t 60 staging tests/test_staging.py
  CUDA_VISIBLE_DEVICES=0 t 220 moe_gpu tests/gpu/test_moe_gpu.py
  eb 230 export_fp8 12 --skip kill,1w,model_free_ptq,warm
  ;;
s6f)  # call 6: the first and second release again, the second lease taking the first one's places
  CUDA_VISIBLE_DEVICES=0 timeout 110 python3 bench/offload_bench.py --rounds 3 2>&1 | quiet > "$OUT/offload.txt"
  tail -10 "$OUT/offload.txt"
  ;;
s6e)  # call 5: the pool made ready in several memfds side by side: the first release, and the GPU tests it touches
  CUDA_VISIBLE_DEVICES=0 timeout 110 python3 bench/offload_bench.py 2>&1 | quiet > "$OUT/offload.txt"
  tail -9 "$OUT/offload.txt"
  CUDA_VISIBLE_DEVICES=0 t 150 offload_gpu tests/gpu/test_offload_gpu.py
  CUDA_VISIBLE_DEVICES=0 t 100 memfree tests/gpu/test_export_gpu.py -k memory_is_free
  ;;
s6c)  # call 3: the DeepSeek-V3-shaped MoE bench, outputs through the pinned buffer
  rm -rf /tmp/export-bench /tmp/calib-bench
  CUDA_VISIBLE_DEVICES=0 timeout 570 python3 bench/moe_bench.py 2>&1 | quiet > "$OUT/moe.txt"
  tail -30 "$OUT/moe.txt"
  ;;
s6d)  # call 4: 8B FP8_DYNAMIC; W4A16 with two and three workers; the first release of a 16 GB model
  rm -rf /tmp/moe-bench
  eb 200 export_fp8 14 --skip kill,1w,model_free_ptq
  eb 150 w4a16_3w 9 --scheme W4A16 --workers 0,3 --skip kill,1w,model_free_ptq,oneshot,warm
  rm -rf /tmp/export-bench
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/offload_bench.py 2>&1 | quiet > "$OUT/offload.txt"
  tail -12 "$OUT/offload.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 80 python3 bench/pool_fill_bench.py --gib 16 --pair 2>&1 | quiet | tail -4
  ;;
s6b)  # call 2: the output's pinned buffer: profiles (dense and MoE), W4A16 8B bench, the tests it touches
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_staging.py 2>&1 | tail -2
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/layer_profile.py --device cuda:0 --moe --schemes FP8_DYNAMIC \
    --rounds 2 2>&1 | quiet > "$OUT/moe_profile.txt"; grep "==\|MoE layer" "$OUT/moe_profile.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 bench/layer_profile.py --device cuda:0 2>&1 | quiet > "$OUT/layer_profile.txt"
  grep "==" "$OUT/layer_profile.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 bench/pool_fill_bench.py --gib 16 --pair 2>&1 | quiet | tail -4
  CUDA_VISIBLE_DEVICES=0 t 120 export_gpu tests/gpu/test_export_gpu.py -k equals_oneshot
  eb 260 export_w4a16 16 --scheme W4A16 --skip kill,1w,model_free_ptq
  ;;
s6a)  # sixth session, call 1: where a first release's time goes (host memory made ready), where a layer's
  # quantize stage goes (W4A16 and FP8_DYNAMIC, one 8B-shaped layer on the GPU)
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 bench/pool_fill_bench.py --gib 16 2>&1 | quiet > "$OUT/pool_fill.txt"
  cat "$OUT/pool_fill.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/layer_profile.py --device cuda:0 2>&1 | quiet > "$OUT/layer_profile.txt"
  grep "==" "$OUT/layer_profile.txt"
  ;;
s5a)  # fifth session, call 1: the warm parent's imports as it does them, then the GPU tests of what changed
  # (quantization error measured per module on the device, previews on the device, two workers per GPU)
  warm_imports
  export OMP_NUM_THREADS=10
  (CUDA_VISIBLE_DEVICES=1 t 300 report_export tests/gpu/test_report_gpu.py tests/gpu/test_export_gpu.py \
     -k "not memory_is_free") &
  (CUDA_VISIBLE_DEVICES=0 t 300 moe tests/gpu/test_moe_gpu.py) &
  wait
  unset OMP_NUM_THREADS
  t 60 memfree tests/gpu/test_export_gpu.py -k memory_is_free
  ;;
s5b)  # call 2: the DeepSeek-V3-shaped MoE bench on one GPU (two workers taking turns on it)
  rm -rf /tmp/export-bench /tmp/calib-bench
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 bench/moe_bench.py 2>&1 | quiet > "$OUT/moe.txt"
  tail -30 "$OUT/moe.txt"
  ;;
s5c)  # call 3: 8B FP8_DYNAMIC on one GPU: cold, oneshot, model_free_ptq, and a run forking from the kept parent
  rm -rf /tmp/moe-bench
  warm_imports
  eb 560 export_fp8 26 --skip kill,1w
  ;;
s5d)  # call 4: the same for W4A16
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 bench/export_bench.py --device cuda:0 --scheme W4A16 \
    --measure-error false --skip kill,1w 2>&1 | quiet > "$OUT/export_w4a16.txt"
  tail -26 "$OUT/export_w4a16.txt"
  ;;
s5e)  # call 5: the MoE bench again (oneshot's wall varies run to run), then W4A16 with two and three workers
  rm -rf /tmp/export-bench
  CUDA_VISIBLE_DEVICES=0 timeout 330 python3 bench/moe_bench.py 2>&1 | quiet > "$OUT/moe2.txt"
  tail -12 "$OUT/moe2.txt"
  rm -rf /tmp/moe-bench
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 bench/export_bench.py --device cuda:0 --scheme W4A16 \
    --measure-error false --workers 0,3 --skip kill,1w,warm,oneshot,model_free_ptq 2>&1 | quiet > "$OUT/w4a16_3w.txt"
  tail -12 "$OUT/w4a16_3w.txt"
  ;;
s4a)  # fourth session, call 1: what changed since the last GPU tests, while the 32-layer GPTQ checkpoint is built
  imports_check
  export OMP_NUM_THREADS=10
  (CUDA_VISIBLE_DEVICES=1 t 300 others tests/gpu/test_report_gpu.py tests/gpu/test_export_gpu.py \
     -k "not memory_is_free"
   CUDA_VISIBLE_DEVICES=1 t 120 moe tests/gpu/test_moe_gpu.py -k memory_flat) &
  (CUDA_VISIBLE_DEVICES=0 t 300 calibrated tests/gpu/test_calibrated_gpu.py -k kill) &
  (timeout 300 python3 bench/calib_bench.py --build-only 2>&1 | quiet > "$OUT/calib_build.txt") &
  wait
  unset OMP_NUM_THREADS
  t 60 memfree tests/gpu/test_export_gpu.py -k memory_is_free
  cat "$OUT/calib_build.txt"
  ;;
s4b)  # call 2: ours, uninterrupted, on the built checkpoint (cold: its warm parent ends with it)
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 bench/calib_bench.py --keep --skip oneshot,kill,retry 2>&1 \
    | quiet > "$OUT/calib_ours.txt"
  tail -14 "$OUT/calib_ours.txt"
  ;;
s4c)  # call 3: oneshot on the same checkpoint and data
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 bench/calib_bench.py --keep --skip supervisor,kill,retry 2>&1 \
    | quiet > "$OUT/calib_oneshot.txt"
  tail -14 "$OUT/calib_oneshot.txt"
  ;;
s4d)  # call 4: the worker killed at layer 20 with no retry left, then a second run forking from the kept parent
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 bench/calib_bench.py --keep --skip supervisor,oneshot,retry 2>&1 \
    | quiet > "$OUT/calib_kill.txt"
  tail -8 "$OUT/calib_kill.txt"
  ;;
s4e)  # call 5: 8B FP8_DYNAMIC on one GPU: cold, oneshot, model_free_ptq, and a run forking from the kept parent
  rm -rf /tmp/calib-bench
  eb 560 export_fp8_warm 24 --skip kill,1w
  ;;
s1)  # third session, call 1: import profile, report recheck (GPU 1), offload bench, then the 32-layer GPTQ bench (ours)
  importtime
  (CUDA_VISIBLE_DEVICES=1 t 200 report tests/gpu/test_report_gpu.py -k "FP8 or W4A16") &
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/offload_bench.py 2>&1 | quiet > "$OUT/offload.txt"
  tail -12 "$OUT/offload.txt"
  wait
  CUDA_VISIBLE_DEVICES=0 timeout ${CALIB_SECONDS:-400} python3 bench/calib_bench.py --skip oneshot,kill,retry 2>&1 \
    | quiet > "$OUT/calib_ours.txt"
  tail -12 "$OUT/calib_ours.txt"
  ;;
s2)  # call 2, on the same warm machine: oneshot on the same checkpoint and data, then the kill at layer 20 + re-run
    # (all three do not fit in one 600 s call: add "kill" to --skip here and run it as a call of its own)
  CUDA_VISIBLE_DEVICES=0 timeout ${CALIB_SECONDS:-560} python3 bench/calib_bench.py --keep --skip supervisor,retry \
    2>&1 | quiet > "$OUT/calib_rest.txt"
  tail -24 "$OUT/calib_rest.txt"
  ;;
s3)  # call 3: 8B FP8_DYNAMIC on one GPU (1 and 2 workers, oneshot, model_free_ptq, re-run, kill), then the MoE bench
  rm -rf /tmp/calib-bench  # the disk holds the MoE checkpoint and one output at a time, not the GPTQ bench's too
  CUDA_VISIBLE_DEVICES=0 timeout 270 python3 bench/export_bench.py --device cuda:0 --workers 0,2 \
    --measure-error false 2>&1 | quiet > "$OUT/export_fp8_1gpu.txt"
  tail -24 "$OUT/export_fp8_1gpu.txt"
  rm -rf /tmp/export-bench
  CUDA_VISIBLE_DEVICES=0 timeout ${MOE_SECONDS:-300} python3 bench/moe_bench.py 2>&1 | quiet > "$OUT/moe_bench.txt"
  tail -20 "$OUT/moe_bench.txt"
  ;;
recheck)  # the GPU tests that failed in `final` on 2026-11-30, after their fixes
  (t 150 torchao tests/gpu/test_torchao_gpu.py -k "PerTensor or int4") &
  (t 150 report tests/gpu/test_report_gpu.py -k "FP8 or W4A16") &
  wait
  ;;
final)  # what the first `tests` run did not reach or failed, then the 2-GPU FP8 export bench
  imports_check
  export OMP_NUM_THREADS=10
  (CUDA_VISIBLE_DEVICES=0 t 240 torchao tests/gpu/test_torchao_gpu.py --tb=long) &
  (CUDA_VISIBLE_DEVICES=1 t 240 others tests/gpu/test_export_gpu.py tests/gpu/test_report_gpu.py \
     tests/gpu/test_moe_gpu.py -k "not memory_is_free and not family_equals and not cli_fp8") &
  (t 240 studio tests/gpu/test_studio_gpu.py) &
  wait
  unset OMP_NUM_THREADS
  timeout ${BENCH_SECONDS:-200} python3 bench/export_bench.py --workers 0 --measure-error false --skip kill,1w 2>&1 \
    | quiet > "$OUT/export_fp8.txt"
  tail -20 "$OUT/export_fp8.txt"
  ;;
tests)
  # The warm parent imports like this (triton's device detection off): does any import initialise CUDA?
  imports_check
  export OMP_NUM_THREADS=10
  (CUDA_VISIBLE_DEVICES=0 t 420 calibrated tests/gpu/test_calibrated_gpu.py) &
  (CUDA_VISIBLE_DEVICES=1 t 200 moe tests/gpu/test_moe_gpu.py
   CUDA_VISIBLE_DEVICES=1 t 200 others tests/gpu/test_torchao_gpu.py tests/gpu/test_report_gpu.py \
     tests/gpu/test_export_gpu.py -k "not memory_is_free and not busy_gpu"
   CUDA_VISIBLE_DEVICES=1 timeout 60 python3 bench/lora_merge_fidelity.py --device cuda:0 2>&1 | quiet > "$OUT/lora_fidelity.txt") &
  (t 420 studio tests/gpu/test_studio_gpu.py tests/gpu/test_offload_gpu.py) &
  wait
  # alone on the machine: it compares free memory as two processes see it (and busy_gpu, already run by s9a, fills
  # a GPU on purpose)
  t 60 memfree tests/gpu/test_export_gpu.py -k memory_is_free
  tail -2 "$OUT/lora_fidelity.txt"
  ;;
calib)
  timeout ${CALIB_SECONDS:-300} python3 bench/calib_bench.py --layers 8 --kill-at 4 --skip retry 2>&1 | quiet > "$OUT/calib_bench.txt"
  tail -16 "$OUT/calib_bench.txt"
  timeout ${MOE_SECONDS:-260} python3 bench/moe_bench.py 2>&1 | quiet > "$OUT/moe_bench.txt"
  tail -16 "$OUT/moe_bench.txt"
  ;;
floor1)  # issue 34, part 1: GPTQ W4A16 on 8 layers of the 8B shape, 128 x 2048: ours before (the tree in
  # .whl/before: git archive of the commit before the change) and after, and oneshot, each in its own process
  timeout ${FLOOR_SECONDS:-540} python3 bench/calib_bench.py --layers 8 --before .whl/before --skip kill,retry 2>&1 \
    | quiet > "$OUT/floor_gptq.txt"
  tail -60 "$OUT/floor_gptq.txt"
  ;;
floor2)  # issue 34: AWQ W4A16 and NVFP4's static scales (4 layers each, ours and oneshot), then the calibrated tests
  timeout 200 python3 bench/calib_bench.py --layers 4 --method awq --workdir /tmp/cb-awq --skip kill,retry 2>&1 \
    | quiet > "$OUT/floor_awq.txt"
  tail -24 "$OUT/floor_awq.txt"
  timeout 150 python3 bench/calib_bench.py --layers 4 --method rtn --scheme NVFP4 --workdir /tmp/cb-nvfp4 \
    --skip kill,retry 2>&1 | quiet > "$OUT/floor_nvfp4.txt"
  tail -24 "$OUT/floor_nvfp4.txt"
  t 200 calibrated tests/gpu/test_calibrated_gpu.py
  ;;
export)
  timeout 300 python3 bench/export_bench.py --workers 1,0 --measure-error false 2>&1 | quiet > "$OUT/export_fp8.txt"
  tail -24 "$OUT/export_fp8.txt"
  timeout 90 python3 bench/offload_bench.py 2>&1 | quiet > "$OUT/offload.txt"
  tail -12 "$OUT/offload.txt"
  timeout 170 python3 bench/export_bench.py --scheme W4A16 --workers 0 --measure-error false --skip kill,1w 2>&1 \
    | quiet > "$OUT/export_w4a16.txt"
  tail -16 "$OUT/export_w4a16.txt"
  ;;
esac
