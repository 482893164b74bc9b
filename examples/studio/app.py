"""A studio backend a GUI can copy: FastAPI, one model held in memory, exports through the supervisor.

    pip install 'layerwise-supervisor[studio]'
    STUDIO_MODEL=path/to/checkpoint [STUDIO_ADAPTER=path/to/lora] [STUDIO_DEVICE=cuda:0] \\
        uvicorn --app-dir examples/studio app:app --host 127.0.0.1 --port 8000

    POST /exports               job as JSON (job.toml's schema; without "source" it exports the held model,
                                LoRA merged per layer) -> 202 {"id": ...}; 409 while this model is exporting;
                                422 {"detail": "<one-line message>"} for a bad job, nothing written
    GET  /exports/{id}          {"id", "state": running|finished|failed|cancelled, "output", "progress", "error"}
    GET  /exports/{id}/events   server-sent events from the first one: MemoryReleased, Started, LayerStarted,
                                LayerWritten, Progress, LogLine, ModelRestored, ... and one terminal event last
    POST /exports/{id}/cancel   stop soon; the output stays resumable (POST the same job again to resume)
    GET  /health                the held model and whether an export is running

The model stays loaded (on its GPU(s) when there is one) and is usable again after every export: the supervisor
releases its accelerator memory while the child quantizes and restores it exactly, on every exit path.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import threading
from dataclasses import dataclass, field

import torch
from fastapi import Body, FastAPI, HTTPException
from fastapi.responses import StreamingResponse

from shared.job import JobSyntaxError, parse_job
from supervisor import Supervisor, events as ev
from supervisor.errors import InputError, LockedError

LOG_EVENTS_KEPT = 2000  # LogLine events kept per export for late SSE readers (the worker log has them all)


@dataclass
class Export:
    id: str
    run: Supervisor
    events: list[bytes] = field(default_factory=list)  # SSE-ready JSON, in order
    kinds: list[str] = field(default_factory=list)
    state: str = "running"
    progress: dict = field(default_factory=dict)
    error: str = ""
    logs_dropped: int = 0
    done: threading.Event = field(default_factory=threading.Event)


class Studio:
    """The held model and its exports; one export at a time for the model."""

    def __init__(self, model, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer
        self.exports: dict[str, Export] = {}
        self.running: Export | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def start(self, data: dict) -> Export:
        try:
            job = parse_job(data)
        except JobSyntaxError as exc:
            raise HTTPException(422, str(exc)) from None
        with self._lock:
            if self.running is not None:
                raise HTTPException(409, f"export {self.running.id} of this model is still running; wait for it or "
                                         f"POST /exports/{self.running.id}/cancel")
            try:
                run = Supervisor(job, model=self.model, tokenizer=self.tokenizer)
                run.start()
            except (InputError, LockedError) as exc:
                raise HTTPException(409 if isinstance(exc, LockedError) else 422, str(exc)) from None
            export = Export(id=f"e{next(self._ids)}", run=run)
            self.exports[export.id] = self.running = export
        threading.Thread(target=self._follow, args=(export,), daemon=True, name=f"follow-{export.id}").start()
        return export

    def _follow(self, export: Export) -> None:
        for event in export.run.events():
            if isinstance(event, ev.LogLine) and export.kinds.count("LogLine") >= LOG_EVENTS_KEPT:
                export.logs_dropped += 1
                continue
            if isinstance(event, ev.Progress):
                export.progress = {"done": event.done, "total": event.total, "eta_s": event.eta_s}
            export.events.append(ev.to_json(event))
            export.kinds.append(type(event).__name__)
        try:
            export.run.wait()
            export.state = "finished"
        except BaseException as exc:  # noqa: BLE001 - the state a UI shows
            export.state = "cancelled" if export.kinds[-1:] == ["Cancelled"] else "failed"
            export.error = str(exc)
        with self._lock:
            if self.running is export:
                self.running = None
        export.done.set()

    def get(self, export_id: str) -> Export:
        export = self.exports.get(export_id)
        if export is None:
            raise HTTPException(404, f"no export {export_id!r}")
        return export


def create_app(model, tokenizer=None) -> FastAPI:
    studio = Studio(model, tokenizer)
    app = FastAPI(title="studio export backend")
    app.state.studio = studio

    @app.get("/health")
    def health():
        return {"model": type(model).__name__, "exporting": studio.running.id if studio.running else None}

    @app.post("/exports", status_code=202)
    def create(job: dict = Body(...)):
        return {"id": studio.start(job).id}

    @app.get("/exports/{export_id}")
    def status(export_id: str):
        e = studio.get(export_id)
        return {"id": e.id, "state": e.state, "output": e.run.plan.output, "progress": e.progress, "error": e.error}

    @app.post("/exports/{export_id}/cancel", status_code=202)
    def cancel(export_id: str):
        e = studio.get(export_id)
        e.run.cancel()
        return {"id": e.id, "state": e.state}

    @app.get("/exports/{export_id}/events")
    async def events(export_id: str):
        e = studio.get(export_id)

        async def stream():
            sent = 0
            while True:
                finished = e.done.is_set()
                while sent < len(e.events):
                    yield f"id: {sent}\nevent: {e.kinds[sent]}\ndata: {e.events[sent].decode()}\n\n"
                    sent += 1
                if finished and sent == len(e.events):
                    return
                await asyncio.sleep(0.05)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def _load_from_env():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.environ["STUDIO_MODEL"]
    device = os.environ.get("STUDIO_DEVICE") or ("cuda:0" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device).eval()
    if os.environ.get("STUDIO_ADAPTER"):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, os.environ["STUDIO_ADAPTER"])
    tokenizer = AutoTokenizer.from_pretrained(path) if os.path.exists(os.path.join(path, "tokenizer_config.json")) \
        else None
    return model, tokenizer


def __getattr__(name: str):
    # `uvicorn app:app` loads the model named by the environment; importing create_app alone loads nothing
    if name != "app":
        raise AttributeError(name)
    if not os.environ.get("STUDIO_MODEL"):
        raise RuntimeError("set STUDIO_MODEL to the checkpoint folder the studio should hold (and STUDIO_ADAPTER to "
                           "a LoRA adapter folder, optionally)")
    globals()["app"] = create_app(*_load_from_env())
    return globals()["app"]
