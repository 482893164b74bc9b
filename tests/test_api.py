"""supervisor/api.py: the embedding API releases a live model and restores it exactly on every exit path."""
from __future__ import annotations

import json
import threading

import msgspec
import psutil
import pytest
import torch
from accelerate import dispatch_model
from transformers import AutoModelForCausalLM, LlamaConfig

from shared.job import parse_job
from supervisor import Supervisor, events as ev
from supervisor.live import offload
from supervisor.errors import Cancelled, ExportFailed

GPU = torch.device("cpu")  # stand-in accelerator: tests/test_offload.py explains the trick
IDS = torch.tensor([[1, 5, 9, 3, 120, 64, 2, 8]])


@pytest.fixture
def cpu_accelerator(monkeypatch):
    monkeypatch.setattr(offload, "ACCELERATOR_TYPES", frozenset({"cpu"}))


@pytest.fixture
def live_model(cpu_accelerator):
    """A tiny accelerate-dispatched model with tied weights and a forward replaced after dispatch."""
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    names = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "model.rotary_emb", "lm_head"]
    model = dispatch_model(model, {n: GPU for n in names}, main_device=GPU, force_hooks=True)
    mlp = model.model.layers[0].mlp
    original = mlp.forward
    mlp.forward = lambda x: original(x)  # a "fused kernel" installed after dispatch: must survive
    return model


def _snapshot(model):
    with torch.no_grad():
        logits = model(IDS).logits.clone()
    tensors = {n: (t, t.device, t.detach().clone()) for n, t in
               list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())}
    hooks = sum("_hf_hook" in m.__dict__ for m in model.modules())
    return logits, tensors, hooks, model.model.layers[0].mlp.forward, dict(model.hf_device_map)


def _assert_restored(model, snap):
    logits, tensors, hooks, fwd, dmap = snap
    now = dict(list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()))
    assert set(now) == set(tensors)
    for name, (obj, device, value) in tensors.items():
        assert now[name] is obj, f"{name} is a new object"
        assert now[name].device == device, name
        assert torch.equal(now[name], value), f"{name} changed"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tie kept
    assert sum("_hf_hook" in m.__dict__ for m in model.modules()) == hooks
    assert model.model.layers[0].mlp.forward is fwd
    assert model.hf_device_map == dmap
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, logits)


@pytest.fixture
def job(tiny_models, tmp_path):
    return parse_job({"source": {"path": tiny_models("llama")},
                      "export": {"scheme": "W8A16", "output": str(tmp_path / "out")},
                      "resources": {"device": "cpu", "max_attempts": 2, "heartbeat_timeout": 20}})


def _fault(monkeypatch, tmp_path, **spec):
    monkeypatch.setenv("SUPERVISOR_TEST_FAULT", json.dumps(spec))


def test_success_releases_then_restores_before_finishing(job, live_model):
    """A finished export releases the model first and restores it, bit-identical, before Finished."""
    snap = _snapshot(live_model)
    before_ptr = live_model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    ptr_during_run = []
    with Supervisor(job, model=live_model) as run:
        seen = []
        for e in run.events():
            seen.append(e)
            if isinstance(e, ev.LayerWritten) and not ptr_during_run:
                ptr_during_run.append(live_model.model.layers[0].self_attn.q_proj.weight.data_ptr())
        result = run.wait()
    assert ptr_during_run and ptr_during_run[0] != before_ptr  # the weights lived in host buffers meanwhile
    kinds = [type(e).__name__ for e in seen]
    assert kinds[0] == "MemoryReleased" and seen[0].released and seen[0].moved_bytes > 0
    assert kinds[-2:] == ["ModelRestored", "Finished"] and result.parts == 3
    assert json.loads(ev.to_json(seen[-1]))["type"] == "Finished"  # events serialize for SSE
    # the steps after the last part, timed: each one, none longer than the run
    assert list(result.stages) == ["config", "files", "load", "workers", "journal"]
    assert all(0 <= v for v in result.stages.values()) and sum(result.stages.values()) <= result.seconds
    _assert_restored(live_model, snap)


def test_failure_restores_and_raises(job, live_model, monkeypatch, tmp_path):
    """A layer that fails every attempt ends with Failed naming it; the model is restored all the same."""
    snap = _snapshot(live_model)
    _fault(monkeypatch, tmp_path, point="quantize", action="raise", index=1)
    with Supervisor(job, model=live_model) as run:
        seen = list(run.events())
        with pytest.raises(ExportFailed, match="layer 1 failed 2 times"):
            run.wait()
    assert isinstance(seen[-1], ev.Failed) and seen[-1].index == 1 and "injected fault" in seen[-1].traceback
    assert isinstance(seen[-2], ev.ModelRestored)
    _assert_restored(live_model, snap)


def test_cancel_from_another_thread_restores_and_is_resumable(job, live_model, monkeypatch, tmp_path):
    """cancel() mid-export stops the child, restores the model, and leaves journaled layers for a resume."""
    snap = _snapshot(live_model)
    # the child holds at layer 1 (heartbeats on) until cancelled: the cancel lands mid-export on any machine
    _fault(monkeypatch, tmp_path, point="quantize", action="stall", index=1, once=str(tmp_path / "held"))
    with Supervisor(job, model=live_model) as run:
        for e in run.events():
            if isinstance(e, ev.LayerWritten):
                threading.Thread(target=run.cancel).start()
            last = e
        with pytest.raises(Cancelled):
            run.wait()
    assert isinstance(last, ev.Cancelled)
    _assert_restored(live_model, snap)
    with open(f"{job.export.output}/.export/journal.jsonl") as f:
        assert sum('"Shard"' in line for line in f) >= 1


@pytest.mark.parametrize("exc", [RuntimeError("boom in the caller"), KeyboardInterrupt()])
def test_exception_in_with_body_restores_and_stops_the_child(job, live_model, exc):
    """An exception or Ctrl-C inside the `with` body stops the child and restores the model."""
    snap = _snapshot(live_model)
    pids = []
    with pytest.raises(type(exc)):
        with Supervisor(job, model=live_model) as run:
            for e in run.events():
                if isinstance(e, ev.WorkerStarted):
                    pids.append(e.pid)
                    raise exc
    assert pids and not psutil.pid_exists(pids[0])  # stopped and reaped, not orphaned
    _assert_restored(live_model, snap)


def test_child_sigkilled_mid_export_is_retried_and_model_restored(job, live_model, monkeypatch, tmp_path):
    """A child SIGKILLed mid-export is restarted; the export finishes and the model comes back intact."""
    snap = _snapshot(live_model)
    _fault(monkeypatch, tmp_path, point="quantize", action="sigkill", index=0, once=str(tmp_path / "fired"))
    with Supervisor(job, model=live_model) as run:
        seen = list(run.events())
        run.wait()
    retry = [e for e in seen if isinstance(e, ev.Retrying)]
    assert len(retry) == 1 and "SIGKILL" in retry[0].reason
    _assert_restored(live_model, snap)


def test_model_that_cannot_be_released_is_reported_and_export_runs(job, tiny_models):
    """An all-CPU model is not released (reason given) and the export still completes."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models("llama"))
    with Supervisor(job, model=model) as run:
        seen = list(run.events())
        run.wait()
    assert isinstance(seen[0], ev.MemoryReleased) and not seen[0].released and seen[0].reason
    assert not any(isinstance(e, ev.ModelRestored) for e in seen)


def test_gpu_without_room_for_a_layer_is_refused(job):
    """A worker reporting less free GPU memory than a layer needs ends the run with a DeviceError (exit 2)."""
    from shared.messages import Ready
    from supervisor.errors import DeviceError

    from supervisor.run import launch

    run = Supervisor(job)._run
    need = launch.layer_need(run.plan)
    ready = Ready(version=1, pid=1, device="cuda:0", layer_prefix="model.layers.", num_layers=2,
                  gpu_free=need - 1, gpu_total=8 * need)
    with pytest.raises(DeviceError, match="GiB free") as caught:
        launch.check_gpu_room(run.plan, ready)
    assert caught.value.exit_code == 2
    launch.check_gpu_room(run.plan, Ready(version=1, pid=1, device="cuda:0", layer_prefix="model.layers.", num_layers=2,
                                          gpu_free=need, gpu_total=8 * need))  # exactly enough is accepted
    # a worker the default count added starts only where its GPU holds every worker's layers there
    three = Ready(version=1, pid=1, device="cuda:0", layer_prefix="model.layers.", num_layers=2,
                  gpu_free=3 * need - 1, gpu_total=8 * need)
    with pytest.raises(DeviceError, match="3 workers' layers there need") as caught:
        launch.check_gpu_room(run.plan, three, "cuda:0", workers=3)
    assert caught.value.exit_code == 2
    launch.check_gpu_room(run.plan, three, "cuda:0", workers=2)


def test_only_workers_the_default_count_added_beyond_one_per_gpu_are_optional(job, monkeypatch):
    """resources.workers = 0: the second and later workers on a GPU may be left out (Slot.optional), never the first
    on each GPU; workers the job asked for by number, and CPU workers, are never optional."""
    from supervisor.run.launch import slots_for
    from supervisor.workers import devices

    monkeypatch.setattr(devices, "worker_slots", lambda devs, n, layer: ["cuda:0", "cuda:1", "cuda:0", "cuda:1"])
    run = Supervisor(job)._run
    assert [s.optional for s in slots_for(run.plan)] == [False, False, True, True]
    asked = Supervisor(msgspec.structs.replace(job, resources=msgspec.structs.replace(job.resources, workers=4)))._run
    assert not any(s.optional for s in slots_for(asked.plan))
    monkeypatch.setattr(devices, "worker_slots", lambda devs, n, layer: ["cpu", "cpu"])
    assert not any(s.optional for s in slots_for(Supervisor(job)._run.plan))


def test_enospc_in_the_supervisors_own_writes_is_a_clear_failure(job, monkeypatch):
    """ENOSPC raised by the supervisor's own writes (journal, index) ends as the disk-full ExportFailed."""
    import errno

    from supervisor.run.sequence import Run

    def full_disk(self):
        raise OSError(errno.ENOSPC, "No space left on device", "model.safetensors.index.json")

    monkeypatch.setattr(Run, "_export", full_disk)
    with Supervisor(job) as run:
        last = list(run.events())[-1]
    with pytest.raises(ExportFailed, match="disk full while writing into .*index.json.*run again to resume"):
        run.wait()
    assert isinstance(last, ev.Failed) and last.exit_code == 1
