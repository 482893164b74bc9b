"""The child's errors: what a worker raises on purpose about its input, as opposed to what it runs into.

    ValueError
     └── Refused   the job asks for something this source cannot give: bad input, not a crash

An exception never crosses the pipe as itself: child/exporter.py's `_failed` sends it as `Failed(kind, message,
traceback, refused=isinstance(exc, Refused))`, and the supervisor makes a refused one a SourceError (exit code 2,
never retried; supervisor/run/scheduler.py `for_good`). Owns these classes only, and imports nothing: the backends
(child/backends/quantize.py, child/backends/name_only.py, ...) and child/backends/backend.py, which picks among them, all import it without
importing one another.
"""
from __future__ import annotations


class Refused(ValueError):
    """The job asks for something this source cannot give (bad input, not a crash): never retried, exit code 2."""
