"""The supervisor: runs a layerwise quantized export in supervised child processes (see supervisor.api).

The public names are imported on first use, after `supervisor.provenance.check()` has made sure that the
`shared` and `child` packages Python would import are this distribution's (see that module for why).
"""
__distribution__ = "layerwise-supervisor"  # the marker supervisor.provenance looks for; keep this exact line

_PUBLIC = {"Job": "shared.job", "parse_job": "shared.job", "Supervisor": "supervisor.api",
           "export": "supervisor.api", "load_job": "supervisor.api", "prepare": "supervisor.api"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'supervisor' has no attribute {name!r}")
    import importlib

    from supervisor import provenance

    provenance.check()
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
