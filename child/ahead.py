"""The next calibrated layer, started ahead: its setup and forward run on a thread of their own while the worker
writes the layer before it, replies, and waits for the next ExportLayer (child/exporter.py).

    export(i):   quantize i ─▶ LayerAhead(i+1) ─▶ write shard i, settle, commit ─▶ LayerWritten(i) ─▶ ExportLayer(i+1)
    its thread:                read-ahead's tensors ─▶ backend.quantize_layer(i+1): setup, forward ─▶ the gate
    export(i+1): take() ─▶ the thread goes on (calibrate, propagate, quantize) ─▶ result() ─▶ write shard i+1 ...

Without it a GPU sat idle while each layer's shard was written and fsynced and the next request came (0.15-0.17 s of
an 8B GPTQ layer's 3.5 s, measured: docs/benchmarks.md). Only stages that read the layer and write nothing run
before the request ("setup", "forward": the samples through the layer with the modifiers' hooks, which change no
weight); the first other stage waits at the gate until the request has come and matched (its fence names the files
the rest writes) or the layer ahead is dropped (any other message but Settle: a retry of a failed part, Stop); the
thread knows its layer (a thread-local), so a dropped one stops at its gate whatever the worker holds. The worker's
main thread fires the fault points and heartbeats of the stages run ahead when it takes the layer over, in order,
so the supervisor and the tests see the stages as before; from there on the thread is the layer's, as the main
thread was, and the main thread waits for it. A layer that failed before it was taken over runs again as it would have
without this (the error, if it repeats, is reported then). Used only by one worker calibrating alone with its
inputs in RAM (Calibrator.inputs_ahead).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable

AHEAD_STAGES = ("setup", "forward")  # what may run before the request: reads the layer, writes nothing

_here = threading.local()  # .ahead: the LayerAhead whose thread this is (set on that thread only)


class Dropped(Exception):
    """Raised in the thread at the gate: the layer will not be asked for (or not from this start)."""


class LayerAhead:
    """Layer `index` calibrated ahead: `run(tensors)` (the backend's quantize_layer, its output on the host) on a
    thread, once `read` (the worker's read-ahead of the part: (tensors, digest)) has landed."""

    def __init__(self, index: int, read: Future, run: Callable[[dict], dict | None], nbytes: Callable[[dict], int]):
        self.index = index
        self.started = time.perf_counter()
        self._cond = threading.Condition()
        self._state = "ahead"  # ahead -> taken | dropped
        self._ended = False
        self._failed_ahead = False  # raised before it was taken: the layer runs again as usual
        self._error: BaseException | None = None  # raised after: the layer's failure
        self._out: dict | None = None
        self._read_facts: tuple[str, int] | None = None  # (digest, source bytes) once read
        # stages run ahead: their seconds, in order reached, the one in progress, and (bench) each one's peak
        self.substages: dict[str, float] = {}
        self.reached: list[str] = []
        self.clock: tuple[str, float] | None = None
        self.peaks: list[tuple[str, int]] = []
        self._thread = threading.Thread(target=self._main, args=(read, run, nbytes), name=f"layer-ahead-{index}",
                                        daemon=True)
        self._thread.start()

    # ---- its thread -------------------------------------------------------------------------------------------
    def _main(self, read: Future, run, nbytes) -> None:
        _here.ahead = self
        try:
            tensors, digest = read.result()  # bounded: the read-ahead's read and copy of one part
            with self._cond:
                self._read_facts = (digest, nbytes(tensors))
                # the wait for the read-ahead's copy onto the device, clocked as a stage run ahead
                self.substages["onto-device"] = time.perf_counter() - self.started
                self._cond.notify_all()
            out = run(tensors)
            del tensors
            with self._cond:
                self._out = out
        except Dropped:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread (or dropped with the layer)
            with self._cond:
                if self._state == "ahead":
                    self._failed_ahead = True  # its frames (the layer's tensors) are not kept
                else:
                    self._error = exc
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    @staticmethod
    def here() -> "LayerAhead | None":
        """The layer started ahead that the calling thread runs (its own thread's, whether the worker still holds
        it, has taken it over or dropped it), or None."""
        return getattr(_here, "ahead", None)

    def stage(self, name: str, reading: Callable[[], int | None]) -> bool:
        """On its thread, a stage begins: True when it was handled here (clocked while ahead); False once taken over
        (the worker's own clock goes on). A stage outside AHEAD_STAGES waits at the gate; raises Dropped there if
        the layer will not be asked for. `reading()` ends a stage: the peak GPU memory so far (a bench's), or None."""
        with self._cond:
            if self._state == "taken":
                return False
            if self.clock is not None:
                last, since = self.clock
                self.substages[last] = self.substages.get(last, 0.0) + time.perf_counter() - since
                peak = reading()
                if peak is not None:
                    self.peaks.append((last, peak))
                self.clock = None
            if self._state == "ahead" and name in AHEAD_STAGES:
                self.clock = (name, time.perf_counter())
                if name not in self.reached:
                    self.reached.append(name)
                self._cond.notify_all()
                return True
            self._cond.wait_for(lambda: self._state != "ahead")  # bounded: take() or drop() ends it
            if self._state == "dropped":
                raise Dropped()
            return False

    # ---- the worker's main thread -----------------------------------------------------------------------------
    def read_facts(self) -> tuple[str, int] | None:
        """(digest, bytes) of the part's source, once read; None if the read (or anything ahead) failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._read_facts is not None or self._ended)  # bounded: one part's read
            return None if self._failed_ahead else self._read_facts

    def take(self, replay: Callable[[str], None], hand_over: Callable[[tuple | None, dict, list], None]) -> bool:
        """Take the layer over for the request that asked for it: `replay(stage)` for each stage reached ahead, in
        order (its heartbeat and fault point, which may raise: the caller then drops it); then, while its thread is
        held between stages, `hand_over(clock, substages, peaks)` (the stage in progress and its start, the seconds
        of those done, a bench's peaks) to the worker's own stage clock, which its thread uses from then on; then
        the gate opens. False if it failed ahead (the caller runs the layer as usual, those points fired already)."""
        replayed = 0
        while True:
            with self._cond:
                pending = self.reached[replayed:]
                if not pending:
                    if self._failed_ahead:
                        return False
                    hand_over(self.clock, dict(self.substages), list(self.peaks))
                    self._state = "taken"
                    self._cond.notify_all()
                    return True
            for name in pending:
                replay(name)
            replayed += len(pending)

    def result(self) -> dict | None:
        """After take(): the layer's output once its thread is done; raises what it raised."""
        self._thread.join()  # bounded: the layer's own stages (their fault points are the tests' bounds)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        out, self._out = self._out, None
        return out

    def parked(self) -> None:
        """Wait until it waits at the gate or has ended (a test's count of live tensors must not depend on when)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ended or (self.clock is None and bool(self.reached)
                                                        and self._state == "ahead"))

    def drop(self) -> None:
        """It will not be asked for: the gate raises Dropped in its thread; returns once the thread has ended (at
        most the stage it is in), so nothing of it is left on the device."""
        with self._cond:
            if self._state == "ahead":
                self._state = "dropped"
                self._cond.notify_all()
        self._thread.join()  # bounded: the stage in progress, then Dropped at the gate
        self._out = self._error = None
