"""The fault-injection matrix: every point of a layer's life x every way for a child to die, hang or babble.

For each (point, action) cell a fault fires once (a marker file) in a real `supervisor run`; the test pins that
the supervisor notices it within a bounded time, retries the part in a fresh child, and that the export ends
byte-identical to an uninterrupted one. Restarting a child costs its ~11 s import, so cells share exports
(`faultkit.plan_runs`: one layer fault per part, a start fault on the restart after it, config faults on
successive finalize attempts) and two exports run at a time.

CI runs a Latin-square subset that still covers every action at a layer point, every point with several
actions, and every action at child start (cheap: it fires before the imports). The whole 6 x 9 cross product
runs with SUPERVISOR_FAULT_MATRIX=full (about 6 minutes on 2 cores); SUPERVISOR_FAULT_REPORT=path.json writes
the measured table (docs/reliability.md shows it).
"""
from __future__ import annotations

import json
import os

import pytest

from tests.scenarios import cli, faultkit
from tests.scenarios.faultkit import ACTIONS, LAYER_POINTS, POINTS, REASON, Cell

LAYERS = 3
PARTS = [0, 1, 2, -1]  # -1: the non-layer shard
PARALLEL = int(os.environ.get("SUPERVISOR_TEST_PARALLEL", "2"))

CI_CELLS = (
    [Cell("start", a) for a in ACTIONS]
    + [Cell(LAYER_POINTS[i % 4], a) for i, a in enumerate(ACTIONS)]
    + [Cell("config", a) for a in ACTIONS[::3]]
)
FULL_CELLS = [Cell(p, a) for p in POINTS for a in ACTIONS]
CELLS = FULL_CELLS if os.environ.get("SUPERVISOR_FAULT_MATRIX") == "full" else CI_CELLS


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama", layers=LAYERS)


def _export(folder, model, env=None, flags=("--json",), **resources):
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, "out")
    job = faultkit.job_file(folder, model, out, **resources)
    r = faultkit.run("run", job, *flags, env=env, timeout=300)  # a missed fault must fail, not hang CI
    r.out = out
    r.bytes = cli.output_bytes(out) if r.rc == 0 else None
    return r


PLANS = faultkit.plan_runs(CELLS, PARTS, "<markers>")
PLAN_OF = {cell: i for i, p in enumerate(PLANS) for cell in p.expect}
NEEDS = {"test_layer_killing_its_child_every_time_fails_naming_it_with_the_child_traceback": ["segv_every_time"],
         "test_child_failing_at_every_start_shows_its_traceback_under_debug": ["raise_every_start"]}


def _needs(item) -> list[str]:
    params = getattr(item, "callspec", None)
    params = params.params if params else {}
    if "cell" in params:
        return [f"run{PLAN_OF[params['cell']]}"]
    if "i" in params:
        return [f"run{params['i']}"]
    return NEEDS.get(item.originalname, [])


@pytest.fixture(scope="module")
def runs(request, model, tmp_path_factory):
    """Every export the selected tests need, started at once, two at a time (faultkit.Background)."""
    root = tmp_path_factory.mktemp("faults")
    markers = str(root / "markers")
    os.makedirs(markers)
    plans = faultkit.plan_runs(CELLS, PARTS, markers)
    jobs = {"reference": lambda: faultkit.reference(model, str(root / "reference")),
            "segv_every_time": lambda: _export(str(root / "every-segv"), model, faultkit.fault_env(
                {"point": "quantize", "action": "sigsegv", "index": 1}), max_attempts=2),
            "raise_every_start": lambda: _export(str(root / "every-raise"), model, faultkit.fault_env(
                {"point": "start", "action": "raise"}), flags=("--json", "--debug"), max_attempts=2)}
    for i, p in enumerate(plans):
        jobs[f"run{i}"] = lambda i=i, p=p: _export(str(root / f"run{i}"), model, faultkit.fault_env(p.faults),
                                                   max_attempts=p.max_attempts)
    bg = faultkit.Background(PARALLEL, jobs)
    bg.plans = plans
    bg.start(faultkit.needed(request, _needs))
    yield bg
    bg.close()
    _write_report(bg, plans)


def _cell_result(runs, cell: Cell) -> dict:
    i = PLAN_OF[cell]
    plan, r = runs.plans[i], runs[f"run{i}"]
    fired = faultkit.read_marker(plan.markers[cell])
    retry = None
    if fired is not None:
        retry = next((e for e in r.of("Retrying") if e["arrived"] >= fired["time"]), None)
    return {"cell": cell, "run": r, "plan": plan, "fired": fired, "retry": retry,
            "notice_s": None if retry is None else round(retry["arrived"] - fired["time"], 3)}


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_fault_is_noticed_retried_and_output_is_identical(cell, runs):
    """A fault firing once here is noticed within its bound, retried in a fresh child, output byte-identical."""
    res = _cell_result(runs, cell)
    r, ref = res["run"], runs["reference"]
    assert res["fired"] is not None, f"the fault never fired (run exited {r.rc}): {r.stderr[-2000:]}"
    assert res["fired"]["point"] == cell.point
    assert r.rc == 0, r.stderr[-2000:]
    retry = res["retry"]
    assert retry is not None, "no Retrying event after the fault"
    assert retry["index"] in faultkit.accepted(res["plan"].expect[cell]), retry
    none = "config.json" if cell.point == "config" else "the export plan"  # a start fault may hit the plan's worker
    assert retry["what"] == (none if retry["index"] is None else
                             "the non-layer shard" if retry["index"] == -1 else f"layer {retry['index']}"), retry
    assert REASON[cell.action] in retry["reason"], retry["reason"]
    assert res["notice_s"] <= faultkit.notice_bound(cell.action), res["notice_s"]
    assert r.bytes == ref["bytes"]


@pytest.mark.parametrize("i", range(len(PLANS)))
def test_each_fault_costs_exactly_one_retry(i, runs):
    """An export with k injected faults retries exactly k times, once per fault, and never gives up early."""
    plan, r = runs.plans[i], runs[f"run{i}"]
    retries = r.of("Retrying")
    assert r.rc == 0, r.stderr[-2000:]
    assert len(retries) == len(plan.expect), [e["reason"] for e in retries]
    got = [e["index"] for e in retries]
    assert faultkit.matches_expected(got, list(plan.expect.values())), (got, list(plan.expect.values()))
    assert len(r.of("WorkerStarted")) == 1 + sum(c.point != "start" for c in plan.expect)


def test_layer_killing_its_child_every_time_fails_naming_it_with_the_child_traceback(runs):
    """A layer segfaulting its child on every attempt fails after 2: exit 1, one line, the child's traceback."""
    r = runs["segv_every_time"]
    assert r.rc == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: layer 1 failed 2 times"), r.stderr
    assert "killed by SIGSEGV" in lines[0]
    assert [e["attempt"] for e in r.of("LayerStarted") if e["index"] == 1] == [1, 2]
    assert not [e for e in r.of("LayerStarted") if e["index"] not in (0, 1)]  # nothing after the failed layer
    failed = r.events[-1]
    assert failed["type"] == "Failed" and failed["index"] == 1 and failed["exit_code"] == 1
    assert "Segmentation fault" in failed["traceback"] and "child/faults.py" in failed["traceback"]


def test_child_failing_at_every_start_shows_its_traceback_under_debug(runs):
    """A child that raises on every start ends the export after 2 attempts of the export plan (judged first, or by a
    worker of its own beside the first parts, whose starts fail too: the plan's failure is what the run reports);
    --debug prints its traceback."""
    r = runs["raise_every_start"]
    assert r.rc == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: the export plan failed 2 times; last error: worker "
                                                        "failed to start: RuntimeError: injected fault")
    assert "Traceback (most recent call last)" in r.stderr and "child/faults.py" in r.stderr
    retried = [e["index"] for e in r.of("Retrying")]
    assert None in retried and len(retried) == len(set(retried)), retried  # each request retried once, the plan's too
    assert not r.of("WorkerStarted")


def _write_report(runs, plans) -> None:
    path = os.environ.get("SUPERVISOR_FAULT_REPORT")
    if not path:
        return
    rows = []
    ref = runs["reference"]
    for cell in CELLS:
        res = _cell_result(runs, cell)
        r = res["run"]
        rows.append({"point": cell.point, "action": cell.action, "part": res["plan"].expect[cell],
                     "fired": res["fired"] is not None, "rc": r.rc,
                     "reason": res["retry"]["reason"] if res["retry"] else None, "notice_s": res["notice_s"],
                     "identical": r.bytes == ref["bytes"],
                     "bytes_differing": faultkit.bytes_differing(ref["out"], r.out)})
    with open(path, "w") as f:
        json.dump({"cells": rows, "runs": len(plans)}, f, indent=1)
