"""The supervisor: runs a layerwise quantized export in supervised child processes (see supervisor.api)."""
from shared.job import Job, parse_job
from supervisor.api import Supervisor, describe, export, load_job, prepare

__all__ = ["Job", "Supervisor", "describe", "export", "load_job", "parse_job", "prepare"]
