"""What a calibrated layer's bytes depend on besides the job and the libraries: the torch thread count each rank runs
with and its device's model (docs/fidelity.md: GPTQ's solve and every layer's forward reduce in an order that
depends on them). The child reports both in Ready; the supervisor journals them and refuses a resume whose workers
would compute otherwise (supervisor.checks.calibration.check_arithmetic).

    device_model("cpu")     "cpu: <the CPU's model name>"   (/proc/cpuinfo, else the platform's processor name)
    device_model("cuda:0")  "cuda: <torch.cuda.get_device_name>"   (the child only: it initialises CUDA)

Owns these names only; it never imports torch for a CPU and never decides anything.
"""
from __future__ import annotations

import functools
import platform


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
