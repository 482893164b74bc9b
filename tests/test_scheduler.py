"""The scheduler's own decisions, with stand-in workers: a worker the default count added beyond one per GPU that
finds no room on its GPU is left out and the run goes on; a worker the run cannot do without ends it; a part handed
off to the caller (the non-layer part the supervisor copies itself) is never given to a slot unless taken back.

The real workers' side of it (a child measuring its GPU's free memory) is tests/gpu/test_export_gpu.py's."""
from __future__ import annotations

import threading

import pytest

from shared.messages import NON_LAYER, ExportLayer, LayerWritten
from supervisor import events as ev
from supervisor.errors import NoRoom
from supervisor.run.scheduler import Scheduler, Slot

PARTS = [*range(6), NON_LAYER]


class StandIn:
    """Answers every part with a LayerWritten, as a worker that wrote it, once every slot has started a worker (so
    that the first slot cannot take every part before the others start)."""

    def __init__(self, slot: Slot, all_started: threading.Event):
        self.slot = slot
        self.all_started = all_started
        self.killed = False
        self.layers_done, self.rss = 0, 0  # the scheduler's accounting, as on a Worker

    def request(self, msg, stopping, on_heartbeat, timeout=0.0):
        assert isinstance(msg, ExportLayer)
        assert self.all_started.wait(60), "a slot never started its worker"
        return LayerWritten(index=msg.index, file=f"part-{msg.index}", fence=msg.fence, digest="x:0", nbytes=1,
                            seconds=0.0)

    def kill(self):
        self.killed = True

    def stop(self):
        pass

    def ask_to_stop(self):
        pass


def _run(slots: list[Slot], no_room: set[int], caller=None):
    """Run PARTS on `slots`; a worker started for a slot in `no_room` finds its GPU full (as launch.check_gpu_room
    says it, after the child started). `caller(scheduler, layers_written)`: handed NON_LAYER before the run, and
    called on a thread of its own (layers_written: an Event set once every layer is journaled). Returns the events,
    the parts written by each slot (None: by the caller) with their retries, and the stand-ins refused."""
    events, written, refused = [], {}, []
    lock = threading.Lock()
    tried, all_started = set(), threading.Event()

    def start_worker(slot, on_hello):
        w = StandIn(slot, all_started)
        slot.worker = w  # as Launcher.start_worker does (supervisor/run/launch.py), so that a stop or kill reaches it
        on_hello()
        with lock:
            tried.add(slot.id)
            if len(tried) == len(slots):
                all_started.set()
        if slot.id in no_room:
            refused.append(w)
            raise NoRoom(f"{slot.device} has 1.0 GiB free as the worker sees it")
        return w

    layers_written = threading.Event()

    def on_written(reply, w, retries):
        with lock:
            written.setdefault(None if w is None else w.slot.id, []).append((reply.index, retries))
            if sum(i != NON_LAYER for parts in written.values() for i, _ in parts) == len(PARTS) - 1:
                layers_written.set()

    s = Scheduler(slots, max_attempts=3, part_timeout=0.0, retry_delay=0.0, sequential=False,
                  cancel=threading.Event(), emit=events.append, start_worker=start_worker, on_written=on_written,
                  on_heartbeat=lambda hb: None, recycle=lambda w: False)
    if caller is not None:
        s.hand_off(NON_LAYER)
        threading.Thread(target=caller, args=(s, layers_written), daemon=True).start()
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


def _two_slots() -> list[Slot]:
    return [Slot(0, "cpu"), Slot(1, "cpu")]


def test_a_part_handed_off_is_the_callers_and_the_run_waits_for_it():
    """The caller lands the non-layer part only after every layer is journaled: no slot ever starts it, run() does not
    return before it lands, and it is journaled once, as the caller's (no worker, no retries)."""
    landed = threading.Event()

    def caller(s, layers_written):
        assert layers_written.wait(60)
        s.landed(LayerWritten(index=NON_LAYER, file="part--1", digest="x:0", nbytes=1, seconds=0.0))
        landed.set()

    events, written, _ = _run(_two_slots(), set(), caller)
    assert landed.is_set()  # run() returned after it, not before
    assert written[None] == [(NON_LAYER, 0)]
    assert sorted(i for slot in (0, 1) for i, _ in written.get(slot, [])) == list(range(len(PARTS) - 1))
    assert not any(isinstance(e, ev.LayerStarted) and e.index == NON_LAYER for e in events)


def test_a_part_taken_back_is_exported_by_a_slot_with_no_attempt_charged():
    """The caller gives the part back (its copy does not match the plan): a slot exports it, as attempt 1."""
    def caller(s, layers_written):
        assert layers_written.wait(60)
        s.take_back(NON_LAYER)

    events, written, _ = _run(_two_slots(), set(), caller)
    assert None not in written
    assert sorted(i for parts in written.values() for i, _ in parts) == sorted(PARTS)
    assert [e.attempt for e in events if isinstance(e, ev.LayerStarted) and e.index == NON_LAYER] == [1]


def test_a_calibrated_rewind_waits_for_the_plan_judged_beside_and_restarts_where_the_journal_says():
    """One calibrating worker, its plan judged beside the first layers: layer 2's first attempt fails (a lost worker,
    retried) while layers 0 and 1 are written but held for the verdict. The fresh worker holds no inputs, so the
    layers to redo come from the journal's boundaries: the retry waits for the verdict, which journals layers 0 and
    1 (layer 0's record names layer 1's inputs; layer 2's were pending), and redoes layer 1 first, as a plan judged
    before the layers would. The plan answers once the retry waits for it, or (the defect) once a layer is asked
    again without waiting: then the journal was still empty and layer 0 would be redone too."""
    from shared.messages import Boundary, Describe, Described, Failed

    asked, journaled, failed_once = [], [], threading.Event()
    waiting_or_asked_again = threading.Event()

    class Worker(StandIn):
        def request(self, msg, stopping, on_heartbeat, timeout=0.0):
            if isinstance(msg, Describe):
                assert waiting_or_asked_again.wait(60), "the retry neither waited for the plan nor asked a layer"
                return Described(backend="stand-in", layer_prefix="model.layers.")
            asked.append(msg.index)
            if failed_once.is_set():
                waiting_or_asked_again.set()
            if msg.index == 2 and not failed_once.is_set():
                failed_once.set()
                return Failed(index=2, kind="WorkerLost", message="killed")
            return LayerWritten(index=msg.index, file=f"part-{msg.index}", fence=msg.fence, digest="x:0", nbytes=1,
                                seconds=0.0)

    started = threading.Event()
    started.set()

    def start_worker(slot, on_hello):
        slot.worker = Worker(slot, started)
        on_hello()
        return slot.worker

    layer1_inputs = [Boundary(feeds=1, file="inputs-layer-00001.bin", digest="x:0", nbytes=1)]
    s = Scheduler([Slot(0, "cpu")], max_attempts=3, part_timeout=0.0, retry_delay=0.0, sequential=True,
                  cancel=threading.Event(), emit=lambda e: None, start_worker=start_worker,
                  on_written=lambda reply, w, retries: journaled.append(reply.index), on_heartbeat=lambda hb: None,
                  recycle=lambda w: False, boundary=lambda i: layer1_inputs if i == 1 and 0 in journaled else None,
                  restart=lambda i: 1 if 0 in journaled and i >= 1 else 0)
    awaited = s._await_verdict

    def await_verdict():  # the retry waits for the plan: let it answer
        waiting_or_asked_again.set()
        awaited()

    s._await_verdict = await_verdict
    s.judge_beside(lambda slot: s.request(Describe(), Described, "the export plan", slot=slot))
    try:
        s.run([0, 1, 2, 3])
    finally:
        s.close()
    assert asked == [0, 1, 2, 1, 2, 3]
    assert journaled == [0, 1, 1, 2, 3]
