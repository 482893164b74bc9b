"""The embedding API: `Supervisor(job, model=...)`, its events and cancel; the CLI calls the same thing.

    caller ──job──▶ Supervisor.__init__   validate job, source, output, fingerprint (prepare: writes nothing);
                                          warm_now (the CLI): the warm parent launched first, importing meanwhile
                    .start / __enter__    the run (supervisor.run.sequence.Run): lock OUT, release the live model's GPU
                                          memory, start its thread (journal → parts → worker(s) → finalize)
                    .events()             typed events (supervisor.events) until Finished | Failed | Cancelled
                    .cancel()             from any thread: stop soon, leave a resumable state
                    __exit__              cancel if still running, join, restore (idempotent) on every path
                    describe(job)         the export plan and the loader's verdict, from one CPU worker
                    export(job)           a Supervisor run to the end, blocking

Owns the public surface and the validation before anything is written (prepare). The run's steps, its retry
policy and its clean-up are supervisor.run's (describe's one worker: supervisor.run.launch.forecast); this module
never drives a scheduler or a worker itself.
"""
from __future__ import annotations

import os
import queue
from typing import TYPE_CHECKING

import msgspec

from shared import layout
from shared.job import Job, JobSyntaxError, is_calibrated, parse_toml, warm_profile
from shared.messages import Described
from supervisor import events as ev
from supervisor.checks import calibration
from supervisor.output import journal
from supervisor.errors import (Cancelled, ClusterError, FingerprintMismatch, InputError, JobError, OutputError,
                               SourceError)
from supervisor.output.lock import probe
# Plan and the LOG_* bounds are the run's; importable from here as they were before it had a module of its own
from supervisor.run.feed import LOG_KEEP, LOG_QUEUED_MAX  # noqa: F401 - what recent_logs() and events() keep
from supervisor.run.launch import forecast
from supervisor.run.plan import Plan
from supervisor.run.sequence import Run
from supervisor.checks.source import SourceInfo, inspect

if TYPE_CHECKING:  # supervisor.live.model imports torch; a plan for a checkpoint never needs it
    from supervisor.live.model import Saved
    from supervisor.workers.zygote import EarlyStart


def load_job(path: str | os.PathLike) -> Job:
    """Read and validate a job.toml; raises JobError with a one-line message."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode()
    except FileNotFoundError:
        raise JobError(f"job file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise JobError(f"job file {str(path)!r} cannot be read: {exc}") from exc
    try:
        job = parse_toml(text)
    except JobSyntaxError as exc:
        raise JobError(f"{path}: {exc}") from exc
    # Relative paths in a job file are relative to the file, so a job runs the same from any cwd.
    base = os.path.dirname(os.path.abspath(path))
    if job.source is not None:
        job.source.path = os.path.normpath(os.path.join(base, os.path.expanduser(job.source.path)))
        if job.source.adapter is not None:
            job.source.adapter = os.path.normpath(os.path.join(base, os.path.expanduser(job.source.adapter)))
    job.export.output = os.path.normpath(os.path.join(base, os.path.expanduser(job.export.output)))
    if job.calibration is not None:
        job.calibration.dataset = os.path.normpath(os.path.join(base, os.path.expanduser(job.calibration.dataset)))
    if job.evaluate is not None:
        job.evaluate.dataset = os.path.normpath(os.path.join(base, os.path.expanduser(job.evaluate.dataset)))
    return job



def _early_start(job: Job, model) -> EarlyStart | None:
    """The run's warm parent, launched now, while prepare checks the job (supervisor.workers.zygote.EarlyStart): a
    checkpoint exported on this host. None for a live model (its warm parent inherits the model's pool, made when
    the run starts) and a cluster's job (each node starts its own), and when the job's devices cannot be named
    (prepare says why)."""
    if model is not None or job.source is None or job.resources.cluster:
        return None
    from supervisor.workers import devices
    from supervisor.workers.zygote import EarlyStart, keep_warm_seconds, run_env

    try:
        devs = devices.resolve_devices(job.resources.device)
    except Exception:  # noqa: BLE001 - prepare refuses the job with the reason
        return None
    return EarlyStart(run_env(devs), warm_profile(job), job.resources.startup_timeout,
                      keep_warm_seconds(job.resources.keep_warm))


def _is_within(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or os.path.commonpath([path, folder]) == folder


def _check_writable(output: str) -> None:
    probe_dir = output
    while not os.path.exists(probe_dir):
        probe_dir = os.path.dirname(probe_dir)
    if not os.path.isdir(probe_dir):
        raise OutputError(f"output {output!r} cannot be created: {probe_dir!r} is not a folder")
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise OutputError(f"output {output!r} is not writable ({probe_dir!r} is read-only); "
                          "choose a writable [export] output")


def prepare(job: Job, model=None, *, join: bool = False) -> Plan:
    """Validate everything about the job before anything is written; raises InputError subclasses. A job without
    [source] exports `model` itself (a live model, Python API only); a PEFT `model` over a quantized base is
    exported from its 16-bit checkpoint ([source] path, or the local folder it names) plus its LoRA pairs
    (supervisor/live/qlora.py), unless the job names a [source] adapter. `join`: a cluster job joins its Ray cluster
    once the source and output are checked (supervisor.cluster.seats: the seats placed, every node's view of the files
    probed), and its devices are the seats'; without it (`supervisor plan`) it plans as if on this host."""
    output = os.path.abspath(job.export.output)
    saved = lora = None
    if model is not None and (job.source is None or not job.source.adapter):
        from supervisor.live import qlora  # imports torch: only with a live model, which has it loaded already

        if qlora.quantized_base(model) is not None:
            # a PEFT model over a quantized base: its 16-bit checkpoint on disk + its LoRA pairs from memory
            job, lora = qlora.base_and_pairs(job, model)
    if job.resources.cluster and lora is not None:
        raise ClusterError('[resources] cluster = "ray" cannot export a live PEFT model\'s LoRA pairs: they are in this '
                           "host's memory; export it here (remove cluster) or save the adapter and name it in "
                           "[source] adapter")
    if job.source is None:
        if job.resources.cluster:
            raise ClusterError('[resources] cluster = "ray" needs [source]: a live model\'s memory is on this host; '
                               "export it here (remove cluster) or save it and name the folder in [source] path")
        source, extra, saved = _live_source(model, output)
    else:
        source, extra = _disk_source(job, output)
        if lora is not None:
            extra = qlora.check(lora, source)
    probe(output)
    cluster = None
    if job.resources.cluster and join:
        _check_writable(output)  # the file-system probe writes beside the output
        cluster = _join_cluster(job, source, output)
    try:
        plan = _plan(job, output, source, extra, saved, cluster, lora)
    except BaseException:
        if cluster is not None:
            cluster.close()
        raise
    plan.cluster = cluster
    return plan


def _plan(job: Job, output: str, source: SourceInfo, extra: dict | None, saved, cluster, lora) -> Plan:
    from supervisor.workers import devices

    if cluster is not None:  # one device per agent: the agents' GPUs, or the CPU
        devs = ["cpu"] if cluster.device == "cpu" else [cluster.device] * len(cluster.agents)
    elif job.resources.cluster:  # `supervisor plan`: as on this host
        devs = ["cpu"] if job.resources.device == "cpu" else ["cuda:0"]
    else:
        devs = devices.resolve_devices(job.resources.device)
    world, world_note = calibration.group_size(job, devs) if is_calibrated(job) else (1, "")
    calib = calibration.check(job, source, devs[0], world) if is_calibrated(job) else None
    if job.evaluate is not None:
        from supervisor.run import quality

        quality.check_job(job)  # [evaluate]: the held-out file refused now, before anything is written
    fp, parts = journal.fingerprint(job, source.stats, calib.fingerprint if calib else None, extra, devs[0])
    try:
        state = journal.check_owner(output, fp, parts)
    except FingerprintMismatch:
        if calib is not None:
            _refuse_another_world(output, job, source, calib, extra, devs, world)
        raise
    if calib is not None and not job.resources.cluster:  # on a cluster the nodes' workers tell, once ready (Run)
        calibration.check_arithmetic(output, state.arithmetic, any(i >= 0 for i in state.shards),
                                     *calibration.planned_arithmetic(job, devs, world))
    _check_writable(output)
    if job.export.format == "torchao":
        from supervisor.checks import torchao_job  # imports torchao (and torch): only for torchao jobs

        torchao_job.check(job, source, devs[0])
    fresh = not os.path.exists(output) or not os.listdir(output)
    return Plan(job, output, source, fp, state, devs[0], devs, calib, live=saved, fresh=fresh, world=world,
                world_note=world_note, lora=lora)


def _join_cluster(job: Job, source: SourceInfo, output: str):
    """Join the job's Ray cluster (supervisor.cluster.seats): an agent per slot, every node's view of the files checked."""
    from shared.job import warm_profile
    from supervisor.cluster.seats import Cluster, remote_env

    files = {os.path.join(source.path, name): size for name, size, _ in source.stats}
    for folder in [job.source.adapter] if job.source.adapter else []:
        folder = os.path.abspath(folder)
        files.update({os.path.join(folder, fn): os.path.getsize(os.path.join(folder, fn))
                      for fn in sorted(os.listdir(folder)) if os.path.isfile(os.path.join(folder, fn))})
    if job.calibration is not None and os.path.isfile(job.calibration.dataset):
        files[job.calibration.dataset] = os.path.getsize(job.calibration.dataset)
    return Cluster.join(job, files, output, warm_profile(job), remote_env(job),
                        layer_bytes=source.nbytes // max(source.num_layers, 1))


def _refuse_another_world(output: str, job: Job, source: SourceInfo, calib, extra, devs: list[str], world: int) -> None:
    """A calibrated export resumed with another group size W: the one difference from the folder's job is W (the
    same fingerprint with the folder's W matches), so say that, and how to resume."""
    header = journal.read(output).header
    if header is None or header.world == world:
        return
    theirs = {k: v for k, v in calib.fingerprint.items() if k != "world"}
    if header.world > 1:
        theirs["world"] = header.world
    fp, _ = journal.fingerprint(job, source.stats, theirs, extra, devs[0])
    if fp != header.fingerprint:
        return
    how = (f"[resources] workers = {header.world}" if devs == ["cpu"] else
           f"{header.world} GPUs ([resources] device and workers)")
    raise FingerprintMismatch(
        f"output {job.export.output!r} holds a calibrated export started with W = {header.world} "
        f"rank{'s' if header.world != 1 else ''}, and this run "
        f"would use {world} (each rank calibrates its own slice of the samples, so W decides the bytes); resume it "
        f"with {how}, or delete the folder to start fresh")


def _disk_source(job: Job, output: str) -> tuple[SourceInfo, dict | None]:
    source = inspect(job.source.path)
    extra = None
    if job.source.adapter is not None:
        from supervisor.checks.adapter import inspect_adapter

        extra = {"adapter": inspect_adapter(job.source.adapter, source.path, source.files)}
    if _is_within(output, source.path):
        raise OutputError(f"output {job.export.output!r} is inside the source folder (or is it); "
                          "choose an output folder elsewhere")
    if os.path.exists(output) and _is_within(source.path, output):
        raise OutputError(f"the source folder is inside output {job.export.output!r}; choose another output")
    return source, extra


def _live_source(model, output: str) -> tuple[SourceInfo, dict, Saved]:
    if model is None:
        raise JobError("the job has no [source]: set [source] path to a checkpoint folder (only the Python API "
                       "exports a live model without one: Supervisor(job, model=...))")
    from supervisor.live import model as live, qlora

    kind = qlora.quantized(model)  # a PEFT model over a quantized base got its [source] from prepare already
    if kind is not None:
        raise SourceError(f"the live model's weights are quantized ({kind}), its 16-bit weights are in no memory: "
                          "set [source] path = \"<the 16-bit checkpoint it was loaded from>\" (the live model is "
                          "released while that is exported)")
    # named and checked now; the tensors themselves are looked at again after the release (they move)
    saved = live.saved_state(model)
    return (*live.describe(saved, layout.state_path(output, live.CONFIG_DIR)), saved)



class Supervisor:
    """Runs one export in a supervised child; see the module docstring for the life cycle."""

    def __init__(self, job: Job | str | os.PathLike, model=None, *, tokenizer=None, pool=None,
                 retry_delay: float = 0.5, warm_now: bool = False):
        """`model`: the live model to release while the child runs (and, for a job without [source], the model
        to export; a PEFT model over a quantized base: its LoRA pairs are merged over the 16-bit checkpoint,
        supervisor/live/qlora.py); `tokenizer`: saved into the output of a job without [source]; `pool`: an offload.PinnedPool to reuse
        across exports (pinning costs once), else one is made for this run and freed at its end. `warm_now`: a
        caller that starts the run right after (the CLI) has the warm parent start importing now, while the job
        is checked (EarlyStart; it ends if the job is refused, or with the run's clean-up)."""
        self.job = job if isinstance(job, Job) else load_job(job)
        early = _early_start(self.job, model) if warm_now else None
        try:
            self.plan = prepare(self.job, model, join=True)
            self._run = Run(self.plan, model, tokenizer=tokenizer, pool=pool, retry_delay=retry_delay, early=early)
        except BaseException:
            if early is not None:  # refused: its warm parent ends, and nothing of it stays behind
                early.close()
            raise
        self.model = model
        self.tokenizer = tokenizer
        self.retry_delay = retry_delay

    def __enter__(self) -> "Supervisor":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb_) -> bool:
        if self._run.running:
            self._run.cancel()
            self._run.join()  # bounded: cancelled just now; the run stops within its deadlines
        self._run.cleanup()
        return False

    def start(self) -> None:
        self._run.start()

    def events(self, timeout: float | None = None):
        """Yield events until the terminal one (Finished, Failed or Cancelled), which is yielded last."""
        while True:
            try:
                e = self._run.next_event(0.1 if timeout is None else timeout)
            except queue.Empty:
                if timeout is not None:
                    return
                continue
            yield e
            if isinstance(e, ev.TERMINAL):
                return

    def recent_logs(self) -> list[ev.LogLine]:
        """The child's last LOG_KEEP lines (stdout and stderr), oldest first, whether or not events() saw them."""
        return self._run.recent_logs()

    def cancel(self) -> None:
        """Stop the export soon (from any thread); what was written stays and a re-run resumes."""
        self._run.cancel()

    def wait(self) -> ev.Finished:
        """Block until the run ends; return Finished or raise the error that ended it."""
        self._run.join()  # bounded: the run ends on its own deadlines (docs/reliability.md)
        self._run.cleanup()
        if isinstance(self._run.terminal, ev.Finished):
            return self._run.terminal
        if self._run.error is not None:
            raise self._run.error
        raise Cancelled("export cancelled before it finished; run it again to resume")


def describe(job: Job | str | os.PathLike) -> Described:
    """What an export of `job` would write, before anything is written (`supervisor plan`): the parts, per part the
    source tensors quantized and kept, and transformers' loader verdict on the predicted output. Runs one CPU
    worker (its log in a temporary folder); validates like `run` and writes nothing."""
    job = job if isinstance(job, Job) else load_job(job)
    plan = prepare(job)
    reply = forecast(plan)
    return msgspec.structs.replace(reply, world=plan.world, world_note=plan.world_note) if plan.calibration else reply


def export(job: Job | str | os.PathLike, model=None, on_event=None, *, tokenizer=None) -> ev.Finished:
    """Run one export to the end (blocking); `on_event` sees every event. Raises the error that ended it."""
    with Supervisor(job, model=model, tokenizer=tokenizer) as run:
        for e in run.events():
            if on_event is not None:
                on_event(e)
        return run.wait()  # bounded: events() returned, so the run has ended


__all__ = ["Supervisor", "describe", "export", "load_job", "prepare", "InputError"]
