"""Every error the supervisor raises, and the exit code each one maps to.

The hierarchy (exit code in brackets)::

    SupervisorError (Exception) ................. [1]
     ├── InputError (ValueError) ................ [2]  bad input: nothing was written
     │    ├── JobError .......................... [2]  job.toml: unknown key, wrong type, bad value
     │    ├── SourceError ....................... [2]  the source checkpoint cannot be exported
     │    ├── CalibrationError .................. [2]  the calibration dataset or settings cannot be used
     │    ├── OutputError ....................... [2]  the output folder cannot be used
     │    │    ├── FingerprintMismatch .......... [2]  it holds an export of a different job
     │    │    └── ArithmeticMismatch ........... [2]  its calibrated layers were computed with other thread
     │    │                                             counts or on another device model than this run's
     │    └── ClusterError ...................... [2]  the Ray cluster cannot run the job (no Ray, unreachable,
     │                                                  a node that cannot see the source or the output)
     ├── LockedError ............................ [3]  another supervisor is exporting into the folder
     ├── DeviceError ............................ [2]  the requested device is missing or too full
     │    └── NoRoom ............................ [2]  a worker's GPU cannot hold its layers
     ├── ExportFailed (RuntimeError) ............ [1]  a layer could not be exported after its attempts
     ├── OffloadError (RuntimeError) ............ [1]  the live model could not be released / restored
     ├── VerifyFailed ........................... [1]  `supervisor verify` found missing/corrupt shards
     ├── NameClash (ImportError) ................ [2]  `supervisor`/`child`/`shared` as imported are not ours
     └── Cancelled .............................. [130] cancel() or Ctrl-C; the state is resumable

Rules: messages are one line and say how to fix the problem; a foreign exception is translated once, at the
boundary where it enters (`raise Ours(...) from exc`); nothing here imports torch. `one_line` is how a foreign exception's message becomes one line.
"""
from __future__ import annotations


class SupervisorError(Exception):
    """Base class: everything the supervisor raises on purpose."""

    exit_code = 1


class InputError(SupervisorError, ValueError):
    """The input (job, source, output folder) is wrong; raised before anything is written."""

    exit_code = 2


class JobError(InputError):
    """job.toml is malformed or names something that does not exist."""


class SourceError(InputError):
    """The source checkpoint cannot be exported (missing, pickle-only, hostile, inconsistent)."""


class CalibrationError(InputError):
    """The calibration data cannot be used (missing, malformed, too few lines, no tokenizer, seq_len too long)."""


class OutputError(InputError):
    """The output folder cannot be used (not empty, inside the source, read-only)."""


class FingerprintMismatch(OutputError):
    """The output folder holds an export of a different job."""


class ArithmeticMismatch(OutputError):
    """The output folder's calibrated layers were computed with another torch thread count or device model than this
    run's workers would use (their bytes would differ from the layers kept)."""


class ClusterError(InputError):
    """`[resources] cluster = "ray"` cannot be used: Ray missing or unreachable, no room for the workers, or a node
    that cannot see the source or the output folder."""


class LockedError(SupervisorError):
    """Another live supervisor holds the output folder's lock."""

    exit_code = 3

    def __init__(self, message: str, pid: int | None = None):
        super().__init__(message)
        self.pid = pid


class DeviceError(SupervisorError, RuntimeError):
    """The requested device does not exist or has too little free memory."""

    exit_code = 2


class NoRoom(DeviceError):
    """A worker measured too little free memory on its GPU for its layers. A worker the default count added beyond
    one per GPU is left out instead (the run goes on with the others: Scheduler); any other ends the run."""


class ExportFailed(SupervisorError, RuntimeError):
    """A part of the export failed for good; `traceback` holds the child's last traceback as text."""

    def __init__(self, message: str, *, index: int | None = None, traceback: str = ""):
        super().__init__(message)
        self.index = index
        self.traceback = traceback


class OffloadError(SupervisorError, RuntimeError):
    """The live model could not be released or restored; the model was put back before raising if possible."""


class VerifyFailed(SupervisorError):
    """`verify` found shards that are missing or do not match the journal."""


class NameClash(SupervisorError, ImportError):
    """An import package of ours (`supervisor`, `child`, `shared`) resolves to another distribution's code."""

    exit_code = 2


CANCELLED = "export cancelled; run the same job again to resume"


class Cancelled(SupervisorError):
    """The export was cancelled (cancel() or Ctrl-C); run it again to resume."""

    exit_code = 130

    def __init__(self, message: str = CANCELLED):
        super().__init__(message)


def one_line(exc: BaseException) -> str:
    """A foreign exception's message as one line (its last non-empty one: Ray's own end with the cause)."""
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    return text[-1] if text else type(exc).__name__
