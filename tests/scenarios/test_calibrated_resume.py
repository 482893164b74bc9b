"""Calibrated exports resume at every layer: after a killed child, a killed supervisor or a corrupted boundary, the
re-run ends byte-identical to an uninterrupted run; AWQ runs on CPU, resumes identically, equals oneshot, loads.

Kills are triggered by events (child/faults.py points inside a layer: calibrate, propagate, forward; a marker
file written when a fault fires), never by a sleep, and leave layers after them.
"""
import json
import os
import re
import signal
import subprocess

import psutil
import pytest
import torch

from shared import layout
from tests.models import assert_errors_equal_loading, assert_same_tensors, load_tensors
from tests.ref_calib import oneshot_calibrated, token_rows, write_jsonl
from tests.scenarios import cli, faultkit

LAYERS, N, SEQ = 4, 20, 40


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama", layers=LAYERS, hidden=256, seed=3)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("calib") / "ids.jsonl", token_rows(N, seed=5))


def _job(tmp_path, model, dataset, out, export=None, **resources):
    return cli.write_job(tmp_path / "job.toml", model, out, "W4A16", method="gptq", torch_threads=1, export=export,
                         calibration={"dataset": dataset, "samples": N, "seq_len": SEQ}, **resources)


@pytest.fixture(scope="module")
def reference(model, dataset, tmp_path_factory):
    """An uninterrupted GPTQ export (each module's quantization error measured, as on a GPU by default): its
    files' bytes, its events and its folder."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    proc = cli.run("run", _job(tmp, model, dataset, tmp / "out", export={"measure_error": True}), "--json")
    return cli.output_bytes(tmp / "out"), cli.events(proc), tmp / "out"


def test_a_calibrated_layers_errors_equal_transformers_loading_of_the_export(model, reference):
    """Each calibrated module's error equals ||W_loaded - W_source|| / ||W_source||, W_loaded from transformers'
    from_pretrained of the export (on the CPU the layer's parameters are the source tensors, which calibration
    changes in place: the worker measures against a copy)."""
    errors = {k: v for e in reference[1] if e["type"] == "LayerWritten" for k, v in e["quant_error"].items()}
    assert len(errors) == LAYERS * 7, sorted(errors)
    assert_errors_equal_loading(errors, model, str(reference[2]))


def _fault(marker, **spec):
    return {"SUPERVISOR_TEST_FAULT": json.dumps({**spec, "once": str(marker)})}


# The export plan judged before layer 0 (supervisor/run/sequence.py; by default one calibrating worker's plan is judged
# beside its first layers, whose records wait for the verdict): for the runs a kill ends, whose journal the tests read
# (the supervisor's copy of the non-layer part lands after the verdict, which a plan judged beside could give after
# the kill). The plan judged beside: test_the_plan_judged_beside_the_first_layers_*.
PLAN_FIRST = {"SUPERVISOR_TEST_PLAN_BESIDE": "0"}


def _boundaries(out):
    """The boundary files left, each named for the layer it feeds (the attempt's fence in the name left out)."""
    names = sorted(os.listdir(os.path.join(out, layout.STATE_DIR, layout.BOUNDARY)))
    assert all(re.fullmatch(r"inputs-layer-\d{5}\.[0-9a-f]{16}\.bin", n) for n in names), names
    return [re.sub(r"\.[0-9a-f]{16}\.bin$", ".bin", n) for n in names]


def test_child_peak_rss_is_flat_across_calibrated_layers(reference):
    """GPTQ layers between the first (embeddings) and the last (no next boundary): peak RSS within 8%."""
    peaks = [e["peak_rss"] for e in reference[1] if e["type"] == "LayerWritten" and 0 < e["index"] < LAYERS - 1]
    assert len(peaks) == LAYERS - 2 and peaks[0] > 100 * 2**20
    assert max(peaks) <= peaks[0] * 1.08, peaks


def _journaled(out):
    """The layers whose journaled records name a boundary (the newest record per layer), and those boundaries' files."""
    from supervisor.output import journal

    st = journal.read(str(out))
    named = {i: journal.boundaries(r) for i, r in st.shards.items() if journal.boundaries(r)}
    return sorted(named), sorted(os.path.basename(b.file) for bs in named.values() for b in bs)


def test_child_killed_while_calibrating_resumes_from_the_newest_durable_boundary(model, dataset, reference, tmp_path):
    """SIGKILL in layer 2's calibration (no retries left) fails the run with layers 0 and 1 journaled and the inputs
    of layer 1 the newest journaled boundary (layer 2's were being made durable beside layer 2, named in no reply
    yet); re-running (activations on disk this time; two workers, a group of two ranks, refused as another W) redoes
    layer 1 from it on one worker and ends identical. A copy whose boundary file was corrupted is detected and
    recomputed from layer 0, and ends identical too."""
    out = tmp_path / "out"
    job = _job(tmp_path, model, dataset, out, max_attempts=1)
    first = cli.run("run", job, "--json", check=False,
                    env={**PLAN_FIRST, **_fault(tmp_path / "fired", point="calibrate", action="sigkill", index=2)})
    assert first.returncode == 1 and "layer 2" in first.stderr, first.stderr
    assert _journaled(out)[0] == [0]  # layer 0's record names layer 1's inputs; layer 1's names none yet
    assert "inputs-layer-00001.bin" in _boundaries(out)  # (layer 2's may be on disk too: never named, pruned)
    # the non-layer part is the supervisor's copy, journaled once the plan was judged (supervisor/run/verbatim.py)
    assert json.loads(cli.run("status", out, "--json").stdout)["left"] == [1, 2, 3]

    corrupt = tmp_path / "corrupt"
    subprocess.run(["cp", "-a", str(out), str(corrupt)], check=True)
    path, = (corrupt / layout.STATE_DIR / layout.BOUNDARY).glob("inputs-layer-00001.*.bin")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))

    # workers = 2 would calibrate on a group of 2 ranks: not the W this folder was started with, refused
    refused = cli.run("run", _job(tmp_path, model, dataset, out, workers=2), check=False)
    assert refused.returncode == 2 and "started with W = 1" in refused.stderr, refused.stderr
    second = cli.events(cli.run("run", _job(tmp_path, model, dataset, out, activation_ram_gb=1e-6, workers=1),
                                "--json"))
    assert second[0]["type"] == "Started" and second[0]["resumed"] == 2 and second[0]["todo"] == 3
    assert [e["index"] for e in second if e["type"] == "LayerStarted"] == [1, 2, 3]
    assert {e["worker"] for e in second if e["type"] == "WorkerStarted"} == {0}
    assert cli.output_bytes(out) == reference[0]
    # on disk, layer 3's inputs were written over layer 1's spent file (a spare); none is left behind
    assert os.listdir(out / layout.STATE_DIR / layout.TMP) == []

    (tmp_path / "c").mkdir()
    third = cli.events(cli.run("run", _job(tmp_path / "c", model, dataset, corrupt), "--json"))
    assert third[0]["resumed"] == 1 and third[0]["redo"] == [0, 1]  # the non-layer part kept
    assert [e["index"] for e in third if e["type"] == "LayerStarted"] == [0, 1, 2, 3]
    assert cli.output_bytes(corrupt) == reference[0]


def test_child_killed_before_the_next_inputs_are_durable_redoes_one_more_layer(model, dataset, reference, tmp_path):
    """Layer 1's shard journaled, its outputs (layer 2's inputs) held before their fsync, the child SIGKILLed in layer
    2 (faults on events: the write thread holds, layer 2 waits for it, then dies): the journal names layer 1's inputs
    as the newest durable boundary, never layer 2's; the re-run redoes layer 1 and ends identical."""
    out, held = tmp_path / "out", tmp_path / "held"
    faults = [{"point": "boundary_sync", "action": "stall", "index": 2, "once": str(held)},
              {"point": "forward", "action": "await", "index": 2, "path": str(held), "timeout": 60},
              {"point": "calibrate", "action": "sigkill", "index": 2, "once": str(tmp_path / "killed")}]
    first = cli.run("run", _job(tmp_path, model, dataset, out, max_attempts=1), "--json",
                    env={**PLAN_FIRST, "SUPERVISOR_TEST_FAULT": json.dumps(faults)}, check=False)
    assert first.returncode == 1 and "layer 2" in first.stderr, first.stderr
    events = cli.events(first)
    # the non-layer part (the supervisor's copy), then layer 1 journaled before the kill
    assert [e["index"] for e in events if e["type"] == "LayerWritten"] == [-1, 0, 1]
    named, files = _journaled(out)
    assert named == [0] and _boundaries(out) == ["inputs-layer-00001.bin"]  # layer 2's never reached its name
    assert sorted(os.listdir(os.path.join(out, layout.STATE_DIR, layout.BOUNDARY))) == files
    second = cli.events(cli.run("run", _job(tmp_path, model, dataset, out), "--json"))
    assert second[0]["resumed"] == 2  # layer 0 and the non-layer part
    assert [e["index"] for e in second if e["type"] == "LayerStarted"] == [1, 2, 3]
    assert cli.output_bytes(out) == reference[0]


def test_child_killed_is_retried_from_the_newest_durable_boundary_in_the_same_run(model, dataset, reference, tmp_path):
    """SIGKILL in layer 2's calibration with retries left: the fresh worker holds no inputs and layer 2's are not
    journaled, so layer 1 is exported again first (no attempt charged to it), then 2 and 3: identical output."""
    out = tmp_path / "out"
    events = cli.events(cli.run("run", _job(tmp_path, model, dataset, out), "--json",
                                env=_fault(tmp_path / "fired", point="calibrate", action="sigkill", index=2)))
    assert [e["index"] for e in events if e["type"] == "Retrying"] == [2]
    assert [e["index"] for e in events if e["type"] == "LayerStarted"] == [0, 1, 2, 1, 2, 3]  # non-layer: copied
    assert [(e["index"], e["retries"]) for e in events if e["type"] == "LayerWritten" and e["index"] >= 0] == \
        [(0, 0), (1, 0), (1, 0), (2, 1), (3, 0)]
    progress = [e for e in events if e["type"] == "Progress"]
    assert progress[-1]["done"] == progress[-1]["total"] == LAYERS + 1  # the layer written twice counted once
    assert cli.output_bytes(out) == reference[0]


def test_a_recycled_worker_settles_its_pending_inputs_and_no_layer_is_redone(model, dataset, reference, tmp_path):
    """recycle_after_layers = 1 on a calibrated export: before each worker is stopped it makes the next layer's
    inputs durable and they are journaled (Settle), so every layer is exported once, each by a fresh worker, and the
    bytes are the uninterrupted run's."""
    out = tmp_path / "out"
    events = cli.events(cli.run("run", _job(tmp_path, model, dataset, out, recycle_after_layers=1), "--json"))
    assert [e["index"] for e in events if e["type"] == "LayerStarted"] == [*range(LAYERS)]  # non-layer: copied
    assert len([e for e in events if e["type"] == "WorkerStarted"]) >= LAYERS
    assert not [e for e in events if e["type"] == "Retrying"]
    assert cli.output_bytes(out) == reference[0]


def test_the_last_layers_inputs_stay_in_ram_and_a_kill_in_it_redoes_the_layer_before(model, dataset, reference,
                                                                                       tmp_path):
    """The last layer's inputs are kept in the worker's RAM only (no file to make durable beside it and unlink after
    it): SIGKILL in the last layer's calibration (no retries left) leaves layer 2's inputs, named by layer 1's record,
    the newest journaled boundary, and no file of layer 3's inputs anywhere in the folder's state; the re-run redoes
    layers 2 and 3 (the one more layer a crash may cost) and ends identical."""
    out = tmp_path / "out"
    first = cli.run("run", _job(tmp_path, model, dataset, out, max_attempts=1), "--json", check=False,
                    env={**PLAN_FIRST, **_fault(tmp_path / "fired", point="calibrate", action="sigkill",
                                                index=LAYERS - 1)})
    assert first.returncode == 1 and f"layer {LAYERS - 1}" in first.stderr, first.stderr
    assert _journaled(out)[0] == [LAYERS - 4, LAYERS - 3]  # layers 0 and 1 name their outputs; layer 2's none
    assert _boundaries(out) == [f"inputs-layer-{LAYERS - 2:05d}.bin"]
    state = [f for _, _, files in os.walk(out / layout.STATE_DIR) for f in files]
    assert not [f for f in state if f"layer-{LAYERS - 1:05d}" in f], state
    second = cli.events(cli.run("run", _job(tmp_path, model, dataset, out), "--json"))
    assert [e["index"] for e in second if e["type"] == "LayerStarted"] == [LAYERS - 2, LAYERS - 1]
    assert cli.output_bytes(out) == reference[0]


def test_the_plan_judged_beside_the_first_layers_journals_them_after_its_verdict(model, dataset, reference, tmp_path):
    """One calibrating worker: the export plan is judged on a worker of its own while the first layers run. Here the
    plan answers only once layer 1's shard is on disk, so layers 0 and 1 are written ahead of the verdict: the run
    finishes without a retry, each layer journaled once and in order (each record naming the inputs the one before it
    left pending), the bytes the uninterrupted run's; `verify` passes."""
    out = tmp_path / "out"
    env = {"SUPERVISOR_TEST_PLAN_BESIDE": "1", **_fault(tmp_path / "plan.json", point="plan", action="await",
                                                       path=str(out / layout.shard_name(1)), timeout=120)}
    events = cli.events(cli.run("run", _job(tmp_path, model, dataset, out), "--json", env=env))
    assert (tmp_path / "plan.json").exists()  # the plan did wait for layer 1
    assert not [e for e in events if e["type"] == "Retrying"]
    assert [e["index"] for e in events if e["type"] == "LayerStarted"] == [*range(LAYERS)]  # non-layer: copied
    assert [e["index"] for e in events if e["type"] == "LayerWritten" and e["index"] >= 0] == [*range(LAYERS)]
    assert cli.output_bytes(out) == reference[0]
    assert cli.run("verify", out).returncode == 0


def test_the_plan_judged_beside_the_first_layers_then_a_killed_child_rewinds_after_the_verdict(model, dataset,
                                                                                              reference, tmp_path):
    """The child SIGKILLed in layer 2 while the plan, judged beside, still waits (for that very kill): layers 0 and 1
    are written but not yet journaled. The retry waits for the verdict, which journals them, and redoes layer 1 from
    the newest durable inputs as a plan judged first would (layer 2's inputs were pending): identical bytes."""
    out, killed = tmp_path / "out", tmp_path / "killed"
    faults = [{"point": "plan", "action": "await", "path": str(killed), "timeout": 120},
              {"point": "calibrate", "action": "sigkill", "index": 2, "once": str(killed)}]
    env = {"SUPERVISOR_TEST_PLAN_BESIDE": "1", "SUPERVISOR_TEST_FAULT": json.dumps(faults)}
    events = cli.events(cli.run("run", _job(tmp_path, model, dataset, out), "--json", env=env))
    assert [e["index"] for e in events if e["type"] == "Retrying"] == [2]
    assert [e["index"] for e in events if e["type"] == "LayerStarted"] == [0, 1, 2, 1, 2, 3]
    assert [(e["index"], e["retries"]) for e in events if e["type"] == "LayerWritten" and e["index"] >= 0] == \
        [(0, 0), (1, 0), (1, 0), (2, 1), (3, 0)]
    assert cli.output_bytes(out) == reference[0]


def test_supervisor_killed_during_propagation_resumes(model, dataset, reference, tmp_path):
    """SIGKILL the supervisor while its child propagates layer 2 (a stalled fault holds it there; the progress
    events say "layer 2: propagate"): the child exits by itself, and the re-run resumes from the newest durable
    boundary (layer 1's inputs: layer 2's were being made durable beside it), identical."""
    out, marker = tmp_path / "out", tmp_path / "fired"
    fault = _fault(marker, point="propagate", action="stall", index=2)
    with faultkit.LiveRun("run", _job(tmp_path, model, dataset, out), "--json", env=fault) as live:
        held = live.wait_for("Progress", where=lambda e: e["index"] == 2 and e["stage"] == "propagate")
        # and layer 1 journaled (with the plan judged beside the first layers: once the plan's verdict is in)
        assert live.wait_for("LayerWritten", where=lambda e: e["index"] == 1) is not None, live.stderr
        assert held is not None and faultkit.wait_marker(marker), live.stderr
        children = psutil.Process(live.pid).children(recursive=True)
        os.kill(live.pid, signal.SIGKILL)
        live.proc.wait()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"orphaned children still running: {alive}"
    assert _journaled(out)[0] == [0] and "inputs-layer-00001.bin" in _boundaries(out)
    second = cli.events(cli.run("run", _job(tmp_path, model, dataset, out), "--json"))
    assert second[0]["resumed"] == 2  # layer 0 and the non-layer part
    assert cli.output_bytes(out) == reference[0]


# ---- layers started ahead (child/ahead.py): beside the write of the layer before, until their request comes -----

def test_each_layer_after_the_first_starts_ahead_and_the_export_equals_oneshot(model, dataset, reference, tmp_path):
    """One calibrating worker starts each layer after the first beside the write of the one before (its setup and
    forward run before its request: LayerWritten.stages["ahead"]); the export is oneshot's, tensor for tensor."""
    written = {e["index"]: e for e in reference[1] if e["type"] == "LayerWritten" and e["index"] >= 0}
    assert sorted(written) == list(range(LAYERS))
    assert "ahead" not in written[0]["stages"]  # nothing before it to start beside
    assert all(written[i]["stages"]["ahead"] > 0 for i in range(1, LAYERS)), [written[i]["stages"] for i in written]
    with open(dataset) as f:
        rows = [json.loads(line)["input_ids"] for line in f]
    ref = oneshot_calibrated(model, "W4A16", "gptq", rows, SEQ, str(tmp_path / "oneshot"))
    assert_same_tensors(load_tensors(ref), load_tensors(str(reference[2])))


def test_a_layer_started_ahead_is_dropped_when_the_layer_before_fails_its_write(model, dataset, reference, tmp_path):
    """Layer 1's shard fails after it was written (a RuntimeError at "staged"), while layer 2 runs ahead: layer 2 is
    dropped, and the export goes on from the newest journaled inputs (layer 0's: layer 1's were to be named in its
    reply), each layer after the first started ahead again: the uninterrupted bytes."""
    out = tmp_path / "out"
    events = cli.events(cli.run("run", _job(tmp_path, model, dataset, out), "--json",
                                env=_fault(tmp_path / "fired", point="staged", action="raise", index=1)))
    assert [e["index"] for e in events if e["type"] == "Retrying"] == [1]
    assert [e["index"] for e in events if e["type"] == "LayerStarted"] == [0, 1, 0, 1, 2, 3]
    written = [e for e in events if e["type"] == "LayerWritten" and e["index"] >= 0]
    assert [e["index"] for e in written] == [0, 0, 1, 2, 3]
    assert all(e["stages"]["ahead"] > 0 for e in written[2:])
    assert cli.output_bytes(out) == reference[0]


@pytest.mark.parametrize("action", ["raise", "sigkill"])
def test_a_fault_in_a_stage_run_ahead_fires_once_the_layer_is_asked_for(model, dataset, reference, tmp_path, action):
    """A fault at layer 2's forward (a stage it runs ahead) fires when layer 2's request has come, after layer 1's
    reply, as it did before layers started ahead (fired ahead, it would fail layer 1): layer 2 is retried in the same
    run, from layer 1's journaled inputs (layer 2's were to be named in layer 2's reply), and the bytes are the
    uninterrupted run's."""
    out = tmp_path / "out"
    events = cli.events(cli.run("run", _job(tmp_path, model, dataset, out), "--json",
                                env=_fault(tmp_path / "fired", point="forward", action=action, index=2)))
    order = [(e["type"], e["index"]) for e in events if e["type"] in ("LayerWritten", "Retrying") and e["index"] >= 0]
    assert order[:3] == [("LayerWritten", 0), ("LayerWritten", 1), ("Retrying", 2)], order
    assert [e["index"] for e in events if e["type"] == "LayerStarted"] == [0, 1, 2, 1, 2, 3]
    assert cli.output_bytes(out) == reference[0]


# ---- AWQ: llm-compressor 0.14.0.1's AWQ needs an accelerator for pinning; the exporter runs it on CPU ----------

AWQ_N, AWQ_SEQ = 8, 32


def test_awq_on_cpu_equals_oneshot_resumes_identically_and_loads(tiny_models, tmp_path):
    """AWQ W4A16 on CPU: equal to oneshot (its pinning skipped on both sides); a child SIGKILLed while calibrating
    layer 2 with no retries left, then re-run from the newest durable boundary (layer 1's inputs), gives the
    uninterrupted bytes; transformers loads it."""
    source = tiny_models("llama", layers=3)
    rows = token_rows(AWQ_N, seed=7)
    dataset = write_jsonl(tmp_path / "ids.jsonl", rows)

    def job(out, **resources):
        return cli.write_job(tmp_path / f"{out.name}.toml", source, out, "W4A16", method="awq", torch_threads=1,
                             calibration={"dataset": dataset, "samples": AWQ_N, "seq_len": AWQ_SEQ}, **resources)

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    cli.run("run", job(whole), "--json")
    first = cli.run("run", job(killed, max_attempts=1), "--json", check=False,
                    env={**PLAN_FIRST, **_fault(tmp_path / "fired", point="calibrate", action="sigkill", index=2)})
    assert first.returncode == 1, first.stderr
    assert cli.events(cli.run("run", job(killed), "--json"))[0]["resumed"] == 2  # layer 0 and the non-layer part
    assert cli.output_bytes(killed) == cli.output_bytes(whole)

    ref = oneshot_calibrated(source, "W4A16", "awq", rows, AWQ_SEQ, str(tmp_path / "ref"))
    assert_same_tensors(load_tensors(ref), load_tensors(str(whole)))
    from transformers import AutoModelForCausalLM

    ids = torch.randint(4, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(str(whole), dtype=torch.bfloat16)(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.bfloat16)(ids).logits
    assert torch.isfinite(ours).all() and torch.equal(ours, theirs)
