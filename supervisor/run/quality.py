"""`supervisor verify OUT --quality FILE`: how much the export lost against its source, one layer at a time.

    measure(output, dataset, samples, seq_len)
      refuse (one line, exit 2, nothing written): an unfinished export, a missing/empty/bad file, a sample longer
      than the model's positions (the worker's Refused), a source folder that is gone
      lock OUT ─▶ .export/quality/journal.jsonl: a Header (what the figures depend on: the export's files' digests,
      the held-out lines' sha256, samples, seq_len, library versions), one Layer record per decoder layer (its
      hidden-state error and the boundary file feeding the next layer, written before the record), then Result
      ─▶ a quality worker (child/backends/evaluate.py; forked from the warm parent, heartbeats watched as an export's):
         EvaluateLayer(k) for k from the newest journaled boundary (0: from the samples) to num_layers (the head)
      ─▶ a worker that dies or hangs costs the layer in progress: a fresh one resumes from the journal (the
         boundaries are not fsynced: a process's death keeps them in the page cache; after the machine's own crash
         the newest one is re-hashed, and a damaged or missing one means measuring from the samples again)
      ─▶ Result journaled; every boundary file deleted; the figures returned (and as events to `on_event`)

The quality journal is state under .export/, never part of the output: the export's files never change. A Header
that differs (another file, other settings, a re-exported folder) discards the earlier figures and boundaries.
Owns that journal and the quality worker's requests; it never reads a tensor.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from typing import Callable, Union

import msgspec

from shared import calibdata, durable, layout
from shared.job import parse_job, warm_profile
from shared.messages import (PROTOCOL_VERSION, Boundary, Evaluate, EvaluateLayer, Failed, Hello, LayerEvaluated,
                             QualityMeasured)
from supervisor import events as ev
from supervisor.errors import ExportFailed, InputError, OutputError

QUALITY = "quality"
DEFAULT_SAMPLES = 64
DEFAULT_SEQ_LEN = 2048
_PACKAGES = ("torch", "transformers", "compressed-tensors", "torchao", "safetensors")


class QualityError(InputError):
    """The held-out file or the export cannot be measured (exit 2, nothing changed)."""


class Header(msgspec.Struct, tag=True, kw_only=True):
    key: str
    parts: dict
    num_layers: int = 0


class Layer(msgspec.Struct, tag=True, kw_only=True):
    index: int
    rel_error: float
    cosine: float
    boundary: Boundary | None = None  # None: written beside the next layer (a later record for it names it)
    seconds: float = 0.0
    peak_rss: int = 0
    peak_gpu: int = 0


class Result(msgspec.Struct, tag=True, kw_only=True):
    kl: float
    top1: float
    ppl_source: float
    ppl_export: float
    samples: int
    tokens: int
    dataset: str = ""
    seq_len: int = 0
    seconds: float = 0.0  # this run's wall time, start-up included
    startup: float = 0.0  # of which the start-up: until the first worker was ready (imports, both skeletons, heads)


Record = Union[Header, Layer, Result]
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Record)


def journal_path(output: str) -> str:
    return layout.state_path(output, QUALITY, "journal.jsonl")


def read(output: str) -> tuple[Header | None, dict[int, Layer], Result | None]:
    """The quality journal: its header, the latest record per layer, and the result (a torn tail ignored)."""
    header, layers, result = None, {}, None
    try:
        with open(journal_path(output), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None, {}, None
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            rec = _dec.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            break
        match rec:
            case Header():
                header, layers, result = rec, {}, None
            case Layer():
                layers[rec.index] = rec
            case Result():
                result = rec
    return header, layers, result


def figures(output: str) -> dict | None:
    """The journaled figures of the latest finished quality run (for `supervisor report` and --json), or None."""
    header, layers, result = read(output)
    if header is None or result is None:
        return None
    return _as_dict(result, layers)


def _as_dict(result: Result, layers: dict[int, Layer]) -> dict:
    d = {k: getattr(result, k) for k in ("kl", "top1", "ppl_source", "ppl_export", "samples", "tokens",
                                         "dataset", "seq_len", "seconds", "startup")}
    d["layers"] = [{"index": i, "rel_error": layers[i].rel_error, "cosine": layers[i].cosine}
                   for i in sorted(layers)]
    return d


def _versions() -> dict[str, str]:
    from shared.versions import installed

    return installed(_PACKAGES)


def check(output: str, dataset: str, samples: int, seq_len: int):
    """Everything refused before anything is written: (the export's job, the held-out rows' sha256, num_layers)."""
    from supervisor.output import journal

    if samples < 1 or seq_len < 2:
        raise QualityError(f"--samples must be at least 1 and --seq-len at least 2 (got {samples}, {seq_len})")
    if not os.path.isdir(output):
        raise OutputError(f"{output!r} is not an export folder")
    st = journal.read(output)
    if st.header is None:
        raise OutputError(f"{output!r} holds no export (no .export/journal.jsonl)")
    if st.finalized is None or not os.path.exists(layout.state_path(output, layout.DONE)):
        raise QualityError(f"the export in {output!r} is not finished: run the job to the end, then verify --quality")
    job = parse_job(st.header.job)
    if job.source is None:
        raise QualityError("the export was made from a live model (no source folder on disk): its quality is "
                           "measured against a checkpoint; save the model and export it from there")
    if not os.path.isdir(job.source.path):
        raise QualityError(f"the export's source {job.source.path!r} is gone; quality measures against it")
    try:
        with open(os.path.join(output, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise QualityError(f"{output!r}: config.json cannot be read ({exc})") from None
    text = config.get("text_config", config)
    vocab, positions = text.get("vocab_size"), text.get("max_position_embeddings")
    try:
        rows = calibdata.read_rows(dataset, samples, vocab)
    except calibdata.CalibrationDataError as exc:
        msg = str(exc).replace("calibration dataset", "held-out file").replace("[calibration] samples", "--samples")
        raise QualityError(msg.replace("set [calibration] dataset to", "name")) from None
    for number, s in enumerate(rows.samples, start=1):
        if not isinstance(s, str) and positions and min(len(s), seq_len) > positions:
            raise QualityError(f"held-out file {dataset!r} line {number} has {min(len(s), seq_len)} tokens, more "
                               f"than the model's {positions} positions; lower --seq-len to {positions} or shorten it")
    return job, rows.sha256, st


def check_job(job) -> None:
    """A job's [evaluate] table, refused before the export writes anything (the held-out file's lines)."""
    e = job.evaluate
    if e.samples < 1 or e.seq_len < 2:
        raise QualityError(f"[evaluate] samples must be at least 1 and seq_len at least 2 (got {e.samples}, "
                           f"{e.seq_len})")
    if job.source is None:
        raise QualityError("[evaluate] needs a source folder on disk (the export of a live model has none to "
                           "measure against)")
    try:
        calibdata.read_rows(e.dataset, e.samples)
    except calibdata.CalibrationDataError as exc:
        raise QualityError(str(exc).replace("calibration dataset", "[evaluate] dataset")
                           .replace("[calibration] samples", "[evaluate] samples")
                           .replace("set [calibration] dataset to", "name")) from None


def _key(st, sha: str, samples: int, seq_len: int) -> tuple[str, dict]:
    parts = {"files": dict(sorted(st.finalized.files.items())), "held_out_sha256": sha, "samples": samples,
             "seq_len": seq_len, "versions": _versions()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32], parts


class _Appender:
    def __init__(self, output: str, fresh: Header | None):
        path = journal_path(output)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if fresh is not None:
            durable.write_bytes(path, _enc.encode(fresh) + b"\n")
        self._f = open(path, "ab")

    def append(self, rec) -> None:
        self._f.write(_enc.encode(rec) + b"\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def _start_at(output: str, layers: dict[int, Layer], num_layers: int) -> tuple[int, Boundary | None]:
    """Where a measurement continues: after the longest run of journaled layers 0..k-1, from the newest boundary
    one of them names (a layer's boundary is journaled once written, which can be beside the next layer: then that
    layer is measured again), re-hashed (a damaged one is never trusted: from the samples again)."""
    k = 0
    while k < num_layers and k in layers:
        k += 1
    k = next((j for j in range(k, 0, -1) if layers[j - 1].boundary is not None), 0)
    if k == 0:
        return 0, None
    b = layers[k - 1].boundary
    if not os.path.isfile(os.path.join(output, b.file)) or not durable.matches(os.path.join(output, b.file), b.digest):
        return 0, None
    return k, b


def _prune(output: str, keep: Boundary | None) -> None:
    """Delete the boundary files older than `keep` (every one when None); a newer one may be being written."""
    folder = layout.state_path(output, QUALITY)
    keep_name = os.path.basename(keep.file) if keep is not None else None
    for fn in os.listdir(folder) if os.path.isdir(folder) else []:
        if fn.startswith("inputs-layer-") and fn != keep_name and (keep is None or int(fn[13:18]) < keep.feeds):
            durable.unlink_quietly(os.path.join(folder, fn))


def measure(output: str, dataset: str, samples: int = DEFAULT_SAMPLES, seq_len: int = DEFAULT_SEQ_LEN, *,
            on_event: Callable[[ev.Event], None] = lambda e: None, locked: bool = False,
            cancelled: Callable[[], bool] = lambda: False) -> dict:
    """The figures (docs/quality.md) of the finished export in `output` against its source, over the first
    `samples` lines of `dataset`; resumes a measurement a crash left. `locked`: the caller holds OUT's lock."""
    from supervisor.output.lock import Lock

    output = os.path.abspath(output)
    dataset = os.path.abspath(dataset)
    job, sha, st = check(output, dataset, samples, seq_len)
    lock = None
    if not locked:
        lock = Lock(output)
        lock.acquire()
    try:
        return _measure(output, dataset, samples, seq_len, job, sha, st, on_event, cancelled)
    finally:
        if lock is not None:
            lock.release()


def _measure(output, dataset, samples, seq_len, job, sha, st, on_event, cancelled) -> dict:
    t0 = time.monotonic()
    key, parts = _key(st, sha, samples, seq_len)
    header, layers, result = read(output)
    if header is not None and header.key == key and result is not None:
        on_event(ev.QualityMeasured(**_event_fields(result, layers)))
        return _as_dict(result, layers)
    fresh = None
    if header is None or header.key != key:
        shutil.rmtree(layout.state_path(output, QUALITY), ignore_errors=True)
        fresh, layers = Header(key=key, parts=parts, num_layers=st.header.num_layers), {}
    journal = _Appender(output, fresh)
    spec = Evaluate(dataset=dataset, samples=samples, seq_len=seq_len, sha256=sha)
    attempts = 0
    worker = None
    startup = None
    runner = _Workers(output, job, spec)
    try:
        while True:
            num_layers = st.header.num_layers
            k, boundary = _start_at(output, layers, num_layers)
            try:
                if worker is None:
                    worker = runner.start(cancelled)
                    startup = round(time.monotonic() - t0, 3) if startup is None else startup
                while k <= num_layers:
                    reply = worker.request(EvaluateLayer(index=k, fence=secrets.token_hex(8), boundary=boundary),
                                           cancelled, lambda hb: None, timeout=job.resources.part_timeout)
                    if isinstance(reply, Failed):
                        raise _Failure(reply)
                    if isinstance(reply, LayerEvaluated):
                        if reply.settled is not None and reply.settled.feeds - 1 in layers:
                            done = msgspec.structs.replace(layers[reply.settled.feeds - 1], boundary=reply.settled)
                            journal.append(done)
                            layers[done.index] = done
                            _prune(output, reply.settled)
                        rec = Layer(index=reply.index, rel_error=reply.rel_error, cosine=reply.cosine,
                                    boundary=reply.boundary, seconds=reply.seconds, peak_rss=reply.peak_rss,
                                    peak_gpu=reply.peak_gpu)
                        journal.append(rec)
                        layers[rec.index] = rec
                        if rec.boundary is not None:
                            _prune(output, rec.boundary)
                        on_event(ev.QualityLayer(index=rec.index, rel_error=rec.rel_error, cosine=rec.cosine,
                                                 total=num_layers))
                        k, boundary = k + 1, rec.boundary
                        attempts = 0
                    elif isinstance(reply, QualityMeasured):
                        result = Result(kl=reply.kl, top1=reply.top1, ppl_source=reply.ppl_source,
                                        ppl_export=reply.ppl_export, samples=reply.samples, tokens=reply.tokens,
                                        dataset=dataset, seq_len=seq_len, seconds=round(time.monotonic() - t0, 3),
                                        startup=startup or 0.0)
                        journal.append(result)
                        _prune(output, None)
                        on_event(ev.QualityMeasured(**_event_fields(result, layers)))
                        return _as_dict(result, layers)
                    else:
                        raise _Failure(Failed(index=k, kind="ProtocolError",
                                              message=f"unexpected {type(reply).__name__}"))
            except _Failure as f:
                if f.failed.refused:
                    raise QualityError(f.failed.message) from None
                attempts += 1
                reason, tb = f"{f.failed.kind}: {f.failed.message}", f.failed.traceback
            except _lost() as exc:
                attempts += 1
                reason, tb = exc.reason, exc.log_tail
                if exc.failed is not None and exc.failed.refused:
                    raise QualityError(exc.failed.message) from None
            if worker is not None:
                worker.kill()
                worker = None
            if attempts >= job.resources.max_attempts:
                raise ExportFailed(f"quality measurement failed at layer {k} after {attempts} attempts: {reason}",
                                   traceback=tb)
            on_event(ev.Retrying(index=k, attempt=attempts + 1, reason=reason, delay=0.0, what=f"quality, layer {k}"))
    finally:
        if worker is not None:
            worker.stop()
        runner.close()
        journal.close()


def _event_fields(result: Result, layers: dict[int, Layer]) -> dict:
    return dict(kl=result.kl, top1=result.top1, ppl_source=result.ppl_source, ppl_export=result.ppl_export,
                samples=result.samples, tokens=result.tokens,
                rel_error=[layers[i].rel_error for i in sorted(layers)],
                cosine=[layers[i].cosine for i in sorted(layers)])


class _Failure(Exception):
    def __init__(self, failed: Failed):
        super().__init__(failed.message)
        self.failed = failed


def _lost():
    from supervisor.workers.worker import WorkerLost

    return WorkerLost


class _Workers:
    """The quality worker: forked from a warm parent (supervisor.workers.zygote), the child seeing one device."""

    def __init__(self, output: str, job, spec: Evaluate):
        from supervisor.workers import devices

        self.output, self.job, self.spec = output, job, spec
        self.device = devices.resolve_device(job.resources.device)
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        self.env = devices.child_env(self.device, env)
        self._zygote = None

    def start(self, cancelled):
        from supervisor.workers.worker import Worker
        from supervisor.workers.zygote import Zygote, ZygoteLost, keep_warm_seconds

        r = self.job.resources
        logs = layout.state_path(self.output, layout.LOGS)
        if self._zygote is None or not self._zygote.alive:
            z = Zygote(self.env, os.path.join(logs, "quality-zygote.log"), warm_profile(self.job), r.startup_timeout,
                       keep_warm=keep_warm_seconds(r.keep_warm))
            try:
                z.start(cancelled)
                self._zygote = z
            except ZygoteLost:
                self._zygote = None  # spawn instead
        fork = None
        if self._zygote is not None and self._zygote.forkable:
            z = self._zygote
            fork = lambda env, fds, out_fds: z.fork([], env, fds, out_fds)  # noqa: E731
        hello = Hello(version=PROTOCOL_VERSION, job=self.job, output=self.output,
                      device="cpu" if self.device == "cpu" else "cuda:0", evaluate=self.spec)
        w = Worker(hello, os.path.join(logs, "quality-worker.log"), self.env, startup_timeout=r.startup_timeout,
                   heartbeat_timeout=r.heartbeat_timeout, fork=fork)
        w.start(cancelled, lambda hb: None)
        return w

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
