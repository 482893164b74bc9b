"""Supervisor-side checks of a `format = "torchao"` job, before anything is written (all exit code 2).

    scheme on the device ─▶ a GPU-only scheme on a CPU device is refused
    source tensors        ─▶ fused MoE experts are refused, naming the module
    [export.torchao]      ─▶ torchao builds the config (its own checks run here, not in a worker)
    Int4 plain packing    ─▶ needs the mslk package importable

Names and spellings were already checked by shared.job (no torch needed); the checks that need no torch come
first. Building the config imports torchao (and so torch), so `prepare` calls this only for torchao jobs: a compressed-tensors job never pays for that import. It
never initialises CUDA (a context costs ~0.5 GB of the memory the worker needs) and never writes anything.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import re

from shared import torchao_schemes
from shared.job import Job
from supervisor.errors import JobError, SourceError
from supervisor.checks.source import SourceInfo

# transformers 5.17 stores every MoE it ships with fused experts ("...mlp.experts" holding 3D parameters), which
# its torchao path leaves dense. The child refuses any layer whose checkpoint names the model holds otherwise
# (the general rule); this catches the common case by name, before a worker starts.
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")


def check(job: Job, source: SourceInfo, device: str) -> None:
    scheme, keywords = job.export.scheme, job.export.torchao or {}
    spec = torchao_schemes.SCHEMES[scheme]
    if device == "cpu" and spec.gpu_only:
        cpu = ", ".join(torchao_schemes.CPU_SCHEMES)
        raise JobError(f"[export] scheme {scheme} {spec.gpu_only}, and this job runs on the CPU; set [resources] "
                       f"device to a CUDA device, or use a scheme that runs on a CPU: {cpu}")
    for name in source.tensor_names:
        m = _EXPERT.match(name)
        if m and name.startswith(source.layer_prefix):
            raise SourceError(f"{m[1]}: MoE experts are stored fused by transformers, whose torchao path leaves them "
                              "unquantized, and vLLM's torchao loader refuses them; export this model with "
                              'format = "compressed-tensors"')
    try:
        with _quiet_import():
            torchao_schemes.build(scheme, keywords)
    except ImportError as exc:
        raise JobError(f'format = "torchao" needs torchao ({exc}); pip install "torchao==0.18.0"') from exc
    except ValueError as exc:
        raise JobError(f"[export.torchao] {exc}") from exc
    packing = {**spec.defaults, **keywords}.get("int4_packing_format")
    if packing == "plain" and importlib.util.find_spec("mslk") is None:
        raise JobError("[export.torchao] int4_packing_format = 'plain' needs the mslk package (pip install "
                       "mslk-cuda, for a CUDA build of torch); or leave it out to use 'tile_packed_to_4d'")


@contextlib.contextmanager
def _quiet_import():
    """Keep torchao's first import from printing on the CLI's stderr, where errors must be one line: on a CPU
    build it logs a warning per CUDA extension it cannot load, and torch warns about its enum registrations."""
    import torch  # noqa: F401 - torch configures its loggers on import; quiet them after that

    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
