"""What a calibrated layer's bytes depend on besides the job and the libraries: the torch thread count each rank runs
with and its device's model (docs/fidelity.md: GPTQ's solve and every layer's forward reduce in an order that
depends on them). The child reports both in Ready; the supervisor journals them and refuses a resume whose workers
would compute otherwise (supervisor.checks.calibration.check_arithmetic).

    device_model("cpu")     "cpu: <the CPU's model name>"   (/proc/cpuinfo, else the platform's processor name)
    device_model("cuda:0")  "cuda: <torch.cuda.get_device_name>"   (the child only: it initialises CUDA)

And FAST, the version of `[calibration] match_oneshot = false`'s arithmetic (docs/fidelity.md): part of such an
export's fingerprint, so a folder half written by one version is never finished by another.

Owns these names only; it never imports torch for a CPU and never decides anything.
"""
from __future__ import annotations

import functools
import platform

# match_oneshot = false: 1 (until 2026-12-03) bf16 Hessian terms on tensor cores; 2: those accumulated in the GEMM
# (child/backends/hessians.FastTerm), SDPA attention (child/backends/calibrate.py), GPTQ's factor from the reversed
# Hessian's Cholesky factor (child/backends/factorize.py). AWQ took match_oneshot = false from 2026-12-06 on (SDPA
# in its grid search too); refused before, so no AWQ folder of an earlier version exists and 2 stays
FAST = 2


@functools.cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_model(device: str) -> str:
    """The model of `device` as this process sees it ("cpu" | "cuda:N")."""
    if device == "cpu":
        return f"cpu: {cpu_model()}"
    import torch

    return f"cuda: {torch.cuda.get_device_name(torch.device(device))}"
