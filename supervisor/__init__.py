"""The supervisor: runs a layerwise quantized export in supervised child processes (see supervisor.api)."""
from supervisor.api import Supervisor, export, load_job, prepare

__all__ = ["Supervisor", "export", "load_job", "prepare"]
