"""examples/studio/app.py served by uvicorn on 127.0.0.1 and driven over HTTP, as a studio UI would.

One server for the module (it loads its model once, as a studio does): a whole export equal to the export of
the model's save_pretrained, a second export refused with 409 while one runs, a bad job refused with 422 and the
one-line message, a cancel then a resume to the same bytes, SSE events in order ending with the terminal one.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.scenarios import cli
from tests.scenarios.cli import output_bytes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEME = "FP8_DYNAMIC"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def markers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("markers")
    return {"arm": folder / "arm-stall", "fired": folder / "stall-fired"}


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory, markers):
    port = _free_port()
    log = tmp_path_factory.mktemp("studio") / "uvicorn.log"
    env = {**os.environ, "STUDIO_MODEL": tiny_models("llama"), "STUDIO_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    # Test-only: once the cancel test creates the "arm" marker, the next export's child holds at layer 1 (its
    # heartbeats go on) until cancelled; so the cancel lands mid-export however fast the machine is.
    env["SUPERVISOR_TEST_FAULT"] = json.dumps({"point": "quantize", "action": "stall", "index": 1,
                                               "after": str(markers["arm"]), "once": str(markers["fired"])})
    with open(log, "wb") as out:  # as a terminal starts it: SIGTERM at its default, a process group of its own
        proc = cli.start([sys.executable, "-m", "uvicorn", "--app-dir", os.path.join(REPO, "examples", "studio"),
                          "app:app", "--host", "127.0.0.1", "--port", str(port)], stdout=out,
                         stderr=subprocess.STDOUT, env=env, cwd=REPO)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        finally:
            cli.end_group(proc)  # the server, or what it left of its supervisor's workers


def _job(out) -> dict:
    # one worker: the cancel test holds its layer 1 after layer 0 is written (parts in order)
    return {"export": {"scheme": SCHEME, "output": str(out)}, "resources": {"device": "cpu", "workers": 1}}


def _events(client, export_id, stop_at=None, on_event=None) -> list[dict]:
    """Read the SSE stream to its end (the terminal event), checking each frame's shape."""
    seen = []
    with client.stream("GET", f"/exports/{export_id}/events", timeout=300) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        frame = {}
        for line in resp.iter_lines():
            if line:
                key, _, value = line.partition(": ")
                frame[key] = value
                continue
            event = json.loads(frame["data"])
            assert frame["event"] == event["type"] and int(frame["id"]) == len(seen)
            seen.append(event)
            frame = {}
            if on_event is not None:
                on_event(event)
    return seen


@pytest.fixture(scope="module")
def reference(saved_export) -> dict:
    """Bytes of exporting the studio's model after save_pretrained (+ its tokenizer) from the checkpoint: the
    reference for the live path (the checkpoint path is held equal to oneshot in test_export_matches_oneshot.py)."""
    return saved_export("llama", SCHEME)


def test_whole_export_over_http(server, reference, tmp_path):
    """POST a job, stream its events to the terminal one, GET its state: the output equals the reference; a bad job
    gets 422 with the one-line message."""
    created = server.post("/exports", json=_job(tmp_path / "out"))
    assert created.status_code == 202
    export_id = created.json()["id"]
    bad = server.post("/exports", json={"export": {"scheme": "FP9", "output": str(tmp_path / "bad")}})
    assert bad.status_code == 422 and "unknown scheme 'FP9'" in bad.json()["detail"]
    assert "\n" not in bad.json()["detail"] and not (tmp_path / "bad").exists()

    kinds = [e["type"] for e in _events(server, export_id)]
    assert kinds[0] == "MemoryReleased" and kinds[-2:] == ["ModelRestored", "Finished"]
    assert kinds.index("Started") < kinds.index("WorkerStarted") < kinds.index("LayerWritten")
    assert "LogLine" in kinds  # the child's import warnings, streamed
    state = server.get(f"/exports/{export_id}").json()
    assert state["state"] == "finished" and state["progress"]["done"] == 3
    assert output_bytes(tmp_path / "out") == reference


def test_cancel_then_resume_over_http(server, reference, markers, tmp_path):
    """Cancel after the first layer is written (the child held at layer 1): meanwhile a second export of the same
    model gets 409; the stream ends with Cancelled; the same job POSTed again resumes (the written layer is kept)
    and finishes with the reference bytes."""
    markers["arm"].touch()
    export_id = server.post("/exports", json=_job(tmp_path / "out")).json()["id"]
    cancelled, busy = [], []

    def cancel_once(event):
        if event["type"] == "LayerWritten" and not cancelled:
            busy.append(server.post("/exports", json=_job(tmp_path / "other")))  # held at layer 1: still running
            cancelled.append(server.post(f"/exports/{export_id}/cancel").status_code)

    kinds = [e["type"] for e in _events(server, export_id, on_event=cancel_once)]
    assert busy[0].status_code == 409 and export_id in busy[0].json()["detail"]
    assert not (tmp_path / "other").exists()
    assert cancelled == [202] and kinds[-2:] == ["ModelRestored", "Cancelled"]
    assert server.get(f"/exports/{export_id}").json()["state"] == "cancelled"

    again = server.post("/exports", json=_job(tmp_path / "out")).json()["id"]
    events = _events(server, again)
    started = next(e for e in events if e["type"] == "Started")
    assert started["resumed"] >= 1 and events[-1]["type"] == "Finished"
    assert output_bytes(tmp_path / "out") == reference
