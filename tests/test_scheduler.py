"""The scheduler's own decisions, with stand-in workers: a worker the default count added beyond one per GPU that
finds no room on its GPU is left out and the run goes on; a worker the run cannot do without ends it.

The real workers' side of it (a child measuring its GPU's free memory) is tests/gpu/test_export_gpu.py's."""
from __future__ import annotations

import threading

import pytest

from shared.messages import NON_LAYER, ExportLayer, LayerWritten
from supervisor import events as ev
from supervisor.errors import NoRoom
from supervisor.scheduler import Scheduler, Slot

PARTS = [*range(6), NON_LAYER]


class StandIn:
    """Answers every part with a LayerWritten, as a worker that wrote it, once every slot has started a worker (so
    that the first slot cannot take every part before the others start)."""

    def __init__(self, slot: Slot, all_started: threading.Event):
        self.slot = slot
        self.all_started = all_started
        self.killed = False

    def request(self, msg, stopping, on_heartbeat, timeout=0.0):
        assert isinstance(msg, ExportLayer)
        assert self.all_started.wait(60), "a slot never started its worker"
        return LayerWritten(index=msg.index, file=f"part-{msg.index}", digest="x:0", nbytes=1, seconds=0.0)

    def kill(self):
        self.killed = True

    def stop(self):
        pass

    def ask_to_stop(self):
        pass


def _run(slots: list[Slot], no_room: set[int]):
    """Run PARTS on `slots`; a worker started for a slot in `no_room` finds its GPU full (as api._check_gpu_room
    says it, after the child started). Returns the events, the parts written by each slot with their retries,
    and the stand-ins refused."""
    events, written, refused = [], {}, []
    lock = threading.Lock()
    tried, all_started = set(), threading.Event()

    def start_worker(slot, on_hello):
        w = StandIn(slot, all_started)
        slot.worker = w  # as api._start_worker does, so that a stop or kill reaches it
        on_hello()
        with lock:
            tried.add(slot.id)
            if len(tried) == len(slots):
                all_started.set()
        if slot.id in no_room:
            refused.append(w)
            raise NoRoom(f"{slot.device} has 1.0 GiB free as the worker sees it")
        return w

    def on_written(reply, w, retries):
        with lock:
            written.setdefault(w.slot.id, []).append((reply.index, retries))

    s = Scheduler(slots, max_attempts=3, part_timeout=0.0, retry_delay=0.0, sequential=False,
                  cancel=threading.Event(), emit=events.append, start_worker=start_worker, on_written=on_written,
                  on_heartbeat=lambda hb: None, recycle=lambda w: False)
    try:
        s.run(list(PARTS))
    finally:
        s.close()
    return events, written, refused


def test_an_extra_worker_without_room_is_left_out_and_the_others_export_every_part():
    """Slot 2 (an extra worker on cuda:0) finds no room: it is killed, one WorkerLeftOut says why, and slots 0 and 1
    export every part once, none charged an attempt for the worker that never ran."""
    slots = [Slot(0, "cuda:0"), Slot(1, "cuda:0", optional=True), Slot(2, "cuda:0", optional=True)]
    events, written, refused = _run(slots, no_room={2})
    left = [e for e in events if isinstance(e, ev.WorkerLeftOut)]
    assert [(e.worker, e.device) for e in left] == [(2, "cuda:0")] and "1.0 GiB free" in left[0].reason
    assert len(refused) == 1 and refused[0].killed
    assert 2 not in written
    done = sorted(i for parts in written.values() for i, _ in parts)
    assert done == sorted(PARTS)  # each part once
    assert all(retries == 0 for parts in written.values() for _, retries in parts)
    assert not any(isinstance(e, ev.Retrying) for e in events)
    assert not any(isinstance(e, ev.LayerStarted) and e.worker == 2 for e in events)


def test_every_extra_worker_left_out_still_finishes_on_the_first():
    """Both extra workers find no room: the first worker exports everything."""
    slots = [Slot(0, "cuda:0"), Slot(1, "cuda:0", optional=True), Slot(2, "cuda:0", optional=True)]
    events, written, _ = _run(slots, no_room={1, 2})
    assert sorted(e.worker for e in events if isinstance(e, ev.WorkerLeftOut)) == [1, 2]
    assert sorted(i for i, _ in written[0]) == sorted(PARTS)


def test_a_worker_the_run_cannot_do_without_ends_it():
    """No room for a worker that is not optional (the first on its GPU, or one the job asked for): the run ends with
    NoRoom, a DeviceError (exit 2), and nothing says a worker was merely left out."""
    slots = [Slot(0, "cuda:0"), Slot(1, "cuda:1")]
    with pytest.raises(NoRoom, match="1.0 GiB free") as caught:
        _run(slots, no_room={1})
    assert caught.value.exit_code == 2
