"""A worker's read-ahead (child/exporter.py, Exporter): the next part is read in the background while this one is
quantized, and put onto the device only once this part's quantize stage is over (beside it, on an H200, the copy
held the quantize stage up: docs/performance.md). On this CPU machine "onto the device" leaves the tensors where they
are, so the order is what is checked, by recording it; the bytes written are checked against a worker that reads
nothing ahead."""
from __future__ import annotations

import os
import threading

from child.exporter import Exporter
from child.process import Beat
from shared import layout
from shared.job import parse_job
from shared.messages import PROTOCOL_VERSION, ExportLayer, Hello


class _NoWire:
    def send(self, msg) -> None:  # faults and heartbeats would write here; none fire in these tests
        pass


def _exporter(model: str, out: str) -> Exporter:
    job = parse_job({"source": {"path": model}, "export": {"scheme": "FP8_DYNAMIC", "output": out}})
    os.makedirs(layout.state_path(out, layout.TMP), exist_ok=True)
    return Exporter(Hello(version=PROTOCOL_VERSION, job=job, output=out, device="cpu"), Beat(_NoWire(), 0))


def test_the_next_part_goes_onto_the_device_only_after_this_parts_quantize_stage(tiny_models, tmp_path):
    model = tiny_models("llama", layers=3)
    ex = _exporter(model, str(tmp_path / "ahead"))
    order: list[tuple[str, int]] = []
    copied = {i: threading.Event() for i in range(3)}
    quantize, onto_device = ex.backend.quantize_layer, ex._onto_device

    def quantize_layer(index, tensors):
        order.append(("quantize", index))
        # give a copy that (wrongly) runs beside this stage the time to start: it is never waited for in vain
        # unless the order is right, and then the wait is the test's only cost (one second, once)
        if index == 0:
            copied[1].wait(timeout=1.0)
        out = quantize(index, tensors)
        order.append(("quantized", index))
        return out

    def copy(index, tensors):
        order.append(("onto device", index))
        copied[index].set()
        return onto_device(index, tensors)

    ex.backend.quantize_layer, ex._onto_device = quantize_layer, copy
    ahead = [ex.export(ExportLayer(index=index, prefetch=index + 1 if index < 2 else None), _NoWire())
             for index in range(3)]

    # parts 1 and 2 were read ahead; each went onto the device once, after the part before it was quantized
    for index in (1, 2):
        assert order.count(("onto device", index)) == 1, order
        assert order.index(("onto device", index)) > order.index(("quantized", index - 1)), order
        assert order.index(("onto device", index)) < order.index(("quantize", index)), order
    # part 0, read when asked for, stays on the host: the backend copies it to the device as it builds the layer
    assert ("onto device", 0) not in order

    # the same bytes as a worker that reads nothing ahead
    plain = _exporter(model, str(tmp_path / "plain"))
    for index in range(3):
        reply = plain.export(ExportLayer(index=index), _NoWire())
        staged = [layout.staged_name(index, r.fence) for r in (ahead[index], reply)]  # the worker only stages
        with open(tmp_path / "ahead" / staged[0], "rb") as a, open(tmp_path / "plain" / staged[1], "rb") as b:
            assert a.read() == b.read(), staged


def test_a_part_whose_quantize_stage_failed_is_read_again_from_what_was_read_ahead(tiny_models, tmp_path):
    """A quantize stage that raises leaves the next part read ahead on the host only; asked for next, it is
    exported from that read as it is (the backend puts host tensors on its device itself)."""
    model = tiny_models("llama", layers=3)
    ex = _exporter(model, str(tmp_path / "out"))
    quantize = ex.backend.quantize_layer
    calls = []

    def quantize_layer(index, tensors):
        calls.append(index)
        if index == 0 and calls.count(0) == 1:
            raise RuntimeError("CUDA out of memory (a stand-in)")
        return quantize(index, tensors)

    ex.backend.quantize_layer = quantize_layer
    try:
        ex.export(ExportLayer(index=0, prefetch=1), _NoWire())
    except RuntimeError:
        pass
    else:
        raise AssertionError("the stand-in failure did not reach the worker loop")
    assert 1 in ex._ahead  # read ahead, not yet onto the device
    written = ex.export(ExportLayer(index=1, prefetch=2), _NoWire())
    assert written.index == 1 and os.path.exists(tmp_path / "out" / layout.staged_name(1, written.fence))
    ex.export(ExportLayer(index=0, attempt=2), _NoWire())
    assert calls == [0, 1, 0]
