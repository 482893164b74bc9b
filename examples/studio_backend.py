"""A studio backend that keeps its model loaded and exports it with the supervisor.

What a GUI backend does: it holds a live model (on the GPU when there is one), and on "Export" it hands the
job and the model to `Supervisor`, streams typed events to its UI (here: a rich progress bar, plus the JSON a
server would send as SSE), may cancel, and afterwards keeps using the model, which is back exactly as before.

    python examples/studio_backend.py [WORKDIR]      # builds a small model in WORKDIR (default ./demo-studio)

Ctrl-C cancels the export (the model is restored, the output stays resumable); running again resumes.
"""
from __future__ import annotations

import os
import sys

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from transformers import AutoModelForCausalLM

from shared.job import parse_job
from supervisor import Supervisor, events as ev
from supervisor.demo import make_model


def main(workdir: str) -> int:
    workdir = os.path.abspath(workdir)
    source = os.path.join(workdir, "model")
    if not os.path.exists(os.path.join(source, "config.json")):
        make_model(source)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    # The studio's live model: loaded once, used for chat / eval in the studio, kept loaded across exports.
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16, device_map=device).eval()
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        before = model(ids).logits.clone()

    job = parse_job({"source": {"path": source},
                     "export": {"scheme": "W4A16", "output": os.path.join(workdir, "export-w4a16")},
                     "resources": {"device": "auto"}})
    sse = open(os.path.join(workdir, "events.jsonl"), "wb")  # what a server would stream to the browser
    columns = (TextColumn("[bold]export"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]}"))
    with Progress(*columns) as bar, Supervisor(job, model=model) as run:
        task = bar.add_task("export", total=None, note="")
        for e in run.events():
            sse.write(ev.to_json(e) + b"\n")
            match e:
                case ev.MemoryReleased(released=True):
                    bar.update(task, note=f"released {e.moved_bytes / 2**20:.0f} MiB of GPU memory")
                case ev.MemoryReleased():
                    bar.update(task, note=f"model stays put: {e.reason}")
                case ev.Started():
                    bar.update(task, total=e.total, completed=e.total - e.todo)
                case ev.Progress():
                    bar.update(task, completed=e.done, note=f"{e.mb_per_s:.1f} MB/s")
                case ev.Retrying():
                    bar.update(task, note=f"retrying: {e.reason}")
                case ev.ModelRestored():
                    bar.update(task, note="model restored")
    sse.close()
    try:
        result = run.wait()
    except Exception as exc:  # the studio shows the message; the model is back either way
        print(f"export did not finish: {exc}", file=sys.stderr)
        result = None
    with torch.no_grad():
        after = model(ids).logits
    same = torch.equal(after, before)
    print(f"live model on {next(model.parameters()).device}, logits identical to before the export: {same}")
    if result is not None:
        print(f"exported {result.parts} shards to {result.output}")
    return 0 if same and result is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "demo-studio"))
