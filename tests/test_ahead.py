"""child/ahead.py's LayerAhead on its own: the stages run ahead are clocked there and replayed in order when the
layer is taken over; nothing past the gate runs before that; a drop ends the thread at the gate; a failure before
the takeover hands the layer back, one after it is the layer's. Every ordering is made by events, never a sleep."""
import threading
from concurrent.futures import Future

import pytest

from child.ahead import LayerAhead

TIMEOUT = 60  # seconds a test waits for an event before it fails (never reached unless something is broken)


class Harness:
    """A backend's quantize_layer as the worker's thread sees it: stages through the worker's `_stage`, which hands
    them to the layer ahead while it runs ahead (as child/exporter.py does)."""

    def __init__(self, fail_in: str | None = None):
        self.log: list[tuple[str, str]] = []  # (who clocked it: "ahead" | "worker", stage)
        self.in_forward = threading.Event()
        self.finish_forward = threading.Event()
        self.fail_in = fail_in
        self.ahead: LayerAhead | None = None
        self.started = threading.Event()  # self.ahead is set
        self.clock = None  # the worker's (handed over)

    def stage(self, name: str) -> None:
        ahead = LayerAhead.here()
        if ahead is not None and ahead.stage(name, lambda: None):
            self.log.append(("ahead", name))
        else:
            self.log.append(("worker", name))
        if name == self.fail_in:
            raise RuntimeError(f"failed in {name}")

    def run(self, tensors: dict) -> dict:
        assert self.started.wait(TIMEOUT)
        self.stage("setup")
        self.stage("forward")
        self.in_forward.set()
        assert self.finish_forward.wait(TIMEOUT)
        self.stage("calibrate")
        self.stage("propagate")
        self.stage("quantize")
        return {"out": tensors["w"] * 2}

    def start(self) -> LayerAhead:
        read = Future()
        read.set_result(({"w": 21}, "digest:1"))
        self.ahead = LayerAhead(3, read, self.run, nbytes=lambda t: 8)
        self.started.set()
        return self.ahead


def hand_over_to(h: Harness):
    def hand_over(clock, substages, peaks):
        h.clock = (clock, substages)
    return hand_over


def test_stages_run_ahead_up_to_the_gate_and_are_replayed_in_order_when_taken():
    h = Harness()
    ahead = h.start()
    assert ahead.read_facts() == ("digest:1", 8)
    h.finish_forward.set()
    ahead.parked()  # at the gate: nothing past it ran
    assert h.log == [("ahead", "setup"), ("ahead", "forward")]
    replayed = []
    assert ahead.take(replayed.append, hand_over_to(h))
    assert replayed == ["setup", "forward"]
    assert ahead.result() == {"out": 42}
    # the gate's stage and the rest on the worker's clock, which got the stages run ahead
    assert h.log == [("ahead", "setup"), ("ahead", "forward"), ("worker", "calibrate"), ("worker", "propagate"),
                     ("worker", "quantize")]
    clock, substages = h.clock
    # the wait for the part's read (onto the device), then the stages run ahead; forward ended at the gate
    assert clock is None and set(substages) == {"onto-device", "setup", "forward"}


def test_taken_mid_stage_the_worker_clock_goes_on_from_the_stage_in_progress():
    h = Harness()
    ahead = h.start()
    assert h.in_forward.wait(TIMEOUT)
    replayed = []
    assert ahead.take(replayed.append, hand_over_to(h))  # while forward runs
    assert replayed == ["setup", "forward"]
    clock, substages = h.clock
    assert clock[0] == "forward" and set(substages) == {"onto-device", "setup"}
    h.finish_forward.set()
    assert ahead.result() == {"out": 42}
    assert [who for who, name in h.log if name in ("calibrate", "propagate", "quantize")] == ["worker"] * 3


def test_a_drop_ends_it_at_the_gate_and_nothing_past_it_runs():
    h = Harness()
    ahead = h.start()
    assert h.in_forward.wait(TIMEOUT)
    h.finish_forward.set()
    ahead.drop()  # returns once the thread has ended
    assert h.log == [("ahead", "setup"), ("ahead", "forward")]
    assert not ahead._thread.is_alive()


def test_a_failure_before_the_takeover_hands_the_layer_back():
    h = Harness(fail_in="forward")
    ahead = h.start()
    ahead._thread.join(TIMEOUT)
    replayed = []
    assert not ahead.take(replayed.append, hand_over_to(h))  # the caller runs the layer itself
    assert replayed == ["setup", "forward"]  # their points fired: the caller's run does not fire them again
    assert h.clock is None


def test_a_failure_after_the_takeover_is_the_layers():
    h = Harness(fail_in="propagate")
    ahead = h.start()
    h.finish_forward.set()
    assert ahead.take(lambda name: None, hand_over_to(h))
    with pytest.raises(RuntimeError, match="failed in propagate"):
        ahead.result()


def test_a_replayed_point_that_raises_leaves_the_gate_shut():
    h = Harness()
    ahead = h.start()
    assert h.in_forward.wait(TIMEOUT)
    h.finish_forward.set()

    def replay(name):
        if name == "forward":
            raise RuntimeError("injected at forward")

    with pytest.raises(RuntimeError, match="injected"):
        ahead.take(replay, hand_over_to(h))
    ahead.drop()
    assert h.log == [("ahead", "setup"), ("ahead", "forward")] and h.clock is None


def test_a_failed_read_is_reported_as_no_facts():
    read = Future()
    read.set_exception(OSError("disk gone"))
    ahead = LayerAhead(1, read, lambda tensors: {}, nbytes=lambda t: 0)
    assert ahead.read_facts() is None
    assert not ahead.take(lambda name: None, lambda *a: None)


def test_a_dropped_layer_stops_at_its_gate_after_the_worker_let_go_of_it():
    """child/exporter.py's stage hook on a layer's own thread: the worker clears its hold on the layer before it drops
    it (drop_ahead), and the thread, still in its forward, must then stop at its gate (Dropped), never go on as the
    worker's part in progress (its stages clocked, shown and fault-checked under the worker's current part)."""
    from types import SimpleNamespace

    from child.exporter import Exporter

    shown, passed = [], threading.Event()
    in_forward, finish = threading.Event(), threading.Event()
    worker = SimpleNamespace(_layer_ahead=None, _clock=None, _sync_stages=False, _stage_peaks=None, _reached=set(),
                             _index=1, _writer=None, beat=SimpleNamespace(set=lambda *a: shown.append(a)),
                             _reading=lambda: None)

    def run(tensors):
        Exporter._stage(worker, "setup")
        Exporter._stage(worker, "forward")
        in_forward.set()
        assert finish.wait(TIMEOUT)
        Exporter._stage(worker, "calibrate")
        passed.set()
        return {}

    read = Future()
    read.set_result(({}, ""))
    ahead = LayerAhead(2, read, run, nbytes=lambda t: 0)
    worker._layer_ahead = ahead
    assert in_forward.wait(TIMEOUT)
    worker._layer_ahead = None  # as drop_ahead: the hold goes first
    finish.set()
    ahead.drop()
    assert not passed.is_set()
    assert shown == [] and worker._reached == set() and worker._clock is None
