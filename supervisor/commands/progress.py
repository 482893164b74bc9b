"""How the CLI shows a run: a rich progress bar (layers done / total, MB/s, ETA, worker RSS) or JSON lines.

Owns presentation only; it consumes `supervisor.events` and never changes the run.
"""
from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from supervisor import events as ev


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


class Display:
    def __init__(self, json_lines: bool, total_hint: int):
        self.json_lines = json_lines
        self.console = Console(stderr=True)
        if not self.console.is_terminal:
            self.console = Console(stderr=True, soft_wrap=True)  # into a file or pipe: one line per notice
        self.progress: Progress | None = None
        self.task = None
        self.total_hint = total_hint

    def __enter__(self) -> "Display":
        if not self.json_lines:
            self.progress = Progress(
                TextColumn("[bold]export"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TextColumn("ETA {task.fields[eta]}"),
                TextColumn("worker {task.fields[rss]}"), TextColumn("{task.fields[stage]}"), TimeElapsedColumn(),
                console=self.console, transient=False)
            self.task = self.progress.add_task("export", total=self.total_hint, rate="- MB/s", eta="-", rss="-",
                                               stage="")
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def show(self, e: ev.Event) -> None:
        if self.json_lines:
            sys.stdout.buffer.write(ev.to_json(e) + b"\n")
            sys.stdout.flush()
            return
        p, task = self.progress, self.task
        match e:
            case ev.Started():
                p.update(task, total=e.total, completed=e.total - e.todo)
                if e.world > 1:
                    p.console.print(f"calibrating each layer on a group of {e.world} ranks (one torch.distributed "
                                    "process group)")
                if e.world_note:
                    p.console.print(e.world_note, style="yellow")
                if e.source_note:
                    p.console.print(e.source_note, style="yellow")
                if e.resumed:
                    p.console.print(f"resuming: {e.resumed} of {e.total} shards verified from an earlier run"
                                    + (f", redoing {e.redo}" if e.redo else ""))
            case ev.MemoryReleased():
                if e.released:
                    p.console.print(f"released the live model: {_mb(e.moved_bytes)} in {e.seconds:.2f}s")
                else:
                    p.console.print(f"live model not released: {e.reason}")
            case ev.PoolStarted():
                if e.reused:
                    p.console.print(f"warm parent reused (pid {e.pid}, kept from an earlier run): ready in "
                                    f"{e.seconds:.1f}s")
                else:
                    p.console.print(f"libraries imported in {e.seconds:.1f}s (workers are forked from pid {e.pid})")
                if e.kept:
                    p.console.print(f"the warm parent stays {e.kept:.0f}s after this run for the next one "
                                    "(resources.keep_warm; `supervisor warm --stop` ends it)", style="dim")
            case ev.ClusterJoined():
                p.console.print(f"Ray cluster {e.address}: {len(e.agents)} workers on {e.nodes} node(s); they "
                                f"connect to {e.host}:{e.port}")
                for why in e.left_out:
                    p.console.print(f"[yellow]a worker left out on {why}")
            case ev.ConnectionRefused():
                p.console.print(f"[yellow]refused a connection to the run's port from {e.peer}: {e.reason}")
            case ev.WorkerStarted():
                again = "" if e.since_death is None else f", {e.since_death:.1f}s after the last one was lost"
                on = f"{e.where}, {e.device}" if e.where else e.device
                p.console.print(f"worker {e.worker} (pid {e.pid}) on {on} ready in {e.seconds:.1f}s{again}")
            case ev.WorkerLeftOut():
                p.console.print(f"[yellow]worker {e.worker} on {e.device} left out: {e.reason}")
            case ev.CopyDeclined():
                p.console.print(f"{_part(e.index)}: a worker exports it, its copy made ahead is not used: {e.reason}",
                                style="dim")
            case ev.Progress():
                rate = f"{e.mb_per_s:,.1f} MB/s"
                eta = "-" if e.eta_s is None else f"{e.eta_s:,.0f}s"
                stage = "" if e.index is None else f"{_part(e.index)}: {e.stage}"
                if e.ranks and e.index is not None:
                    stage += f" ({e.ranks} ranks)"
                p.update(task, completed=e.done, rate=rate, eta=eta, rss=_mb(e.worker_rss) if e.worker_rss else "-",
                         stage=stage)
            case ev.LayerWritten() if e.where:  # on a cluster: which node (and GPU) wrote it
                p.console.print(f"{_part(e.index)} written on {e.where}", style="dim")
            case ev.Retrying():
                p.console.print(f"[yellow]retrying {e.what or _part(e.index)} (attempt {e.attempt}) in {e.delay:.1f}s: "
                                f"{e.reason}")
            case ev.ModelRestored():
                p.console.print(f"restored the live model in {e.seconds:.2f}s")
            case ev.Cancelled():
                p.console.print(f"[yellow]{e.message}")
            case ev.QualityLayer():
                p.update(task, stage=f"quality: layer {e.index + 1}/{e.total}")
            case ev.QualityMeasured():
                p.console.print(f"quality ({e.samples} held-out samples, {e.tokens} tokens): kl {e.kl:.6g}, top-1 "
                                f"{e.top1:.4f}, perplexity {e.ppl_source:.4f} -> {e.ppl_export:.4f} (docs/quality.md)")
            case ev.Finished():
                p.update(task, completed=e.parts, stage="done")


def _part(index: int | None) -> str:
    if index is None:
        return "config.json"  # the only part without an index: written at finalize
    return "non-layer shard" if index == -1 else f"layer {index}"
