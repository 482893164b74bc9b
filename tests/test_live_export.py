"""A live model exported without a checkpoint (job without [source]) equals the export of its save_pretrained.

The reference's model comes from transformers and PEFT alone (tests/ref_studio.py): `live.save_pretrained(tmp)`
(PEFT: `merge_and_unload()` first, on a copy), exported as a plain checkpoint by the checkpoint path, whose output
tests/scenarios/test_export_matches_oneshot.py holds equal to oneshot's. What these tests isolate is the live path
(the pool, the names, the merge) against the checkpoint path. The live model is checked afterwards for
the same objects, devices, values, hooks, hf_device_map, and (PEFT) unmerged, trainable adapters.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from accelerate import dispatch_model
from transformers import AutoTokenizer

from shared.job import parse_job
from supervisor import Supervisor, events as ev
from supervisor.live import offload
from tests.ref_studio import load, lora_model
from tests.scenarios.cli import output_bytes

SCHEME = "FP8_DYNAMIC"
STAND_IN_GPU = torch.device("cpu")  # tests/test_offload.py explains the stand-in accelerator


def _job(out, **resources) -> object:
    return parse_job({"export": {"scheme": SCHEME, "output": str(out)},
                      "resources": {"device": "cpu", "max_attempts": 3, **resources}})


def _export(job, **kwargs) -> list:
    with Supervisor(job, retry_delay=0.05, **kwargs) as run:
        seen = list(run.events())
        run.wait()
    return seen


def _export_checkpoint(path, out) -> dict:
    job = parse_job({"source": {"path": str(path)}, "export": {"scheme": SCHEME, "output": str(out)},
                     "resources": {"device": "cpu"}})
    _export(job)
    return output_bytes(out)


def _state(model) -> dict:
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return {n: (t, t.device, t.requires_grad, t.detach().clone()) for n, t in named}


def _assert_same_model(model, before: dict) -> None:
    now = _state(model)
    assert set(now) == set(before)
    for name, (obj, device, grad, value) in before.items():
        if obj.is_meta:  # accelerate puts a new meta placeholder in an offloaded module after every forward
            assert now[name][0].is_meta, name
            continue
        assert now[name][0] is obj, f"{name} is a new object"
        assert now[name][1] == device and now[name][2] == grad, name
        assert torch.equal(now[name][3], value), f"{name} changed"


def test_cpu_model_equals_its_saved_checkpoint_and_resumes_after_a_child_sigkill(tiny_models, saved_export,
                                                                                 tmp_path, monkeypatch):
    """An all-CPU live model + tokenizer exports byte-identical to `save_pretrained` then export, although the child
    is SIGKILLed mid-export (the next child reads the pool again); the model is unchanged afterwards."""
    model, tok = load(tiny_models("llama")), AutoTokenizer.from_pretrained(tiny_models("llama"))
    before = _state(model)
    monkeypatch.setenv("SUPERVISOR_TEST_FAULT", json.dumps(
        {"point": "quantize", "action": "sigkill", "index": 1, "once": str(tmp_path / "killed")}))
    seen = _export(_job(tmp_path / "out"), model=model, tokenizer=tok)
    monkeypatch.delenv("SUPERVISOR_TEST_FAULT")
    retries = [e for e in seen if isinstance(e, ev.Retrying)]
    assert len(retries) == 1 and "SIGKILL" in retries[0].reason
    assert seen[0].released and seen[0].moved_bytes > 0  # the CPU tensors went into the shared pool
    _assert_same_model(model, before)
    assert output_bytes(tmp_path / "out") == saved_export("llama", SCHEME)  # this checkpoint's save_pretrained


def test_failed_live_export_restores_the_model(tiny_models, tmp_path, monkeypatch):
    """A live export whose layer fails every attempt ends Failed, and the model (moved into the pool for the export)
    is back: same objects, values and devices."""
    model = load(tiny_models("llama"))
    before = _state(model)
    monkeypatch.setenv("SUPERVISOR_TEST_FAULT", json.dumps({"point": "read", "action": "raise", "index": 0}))
    with Supervisor(_job(tmp_path / "out", max_attempts=1), model=model) as run:
        seen = list(run.events())
        with pytest.raises(Exception, match="layer 0 failed"):
            run.wait()
    assert [type(e).__name__ for e in seen[-2:]] == ["ModelRestored", "Failed"]
    _assert_same_model(model, before)


@pytest.fixture
def cpu_accelerator(monkeypatch):
    monkeypatch.setattr(offload, "ACCELERATOR_TYPES", frozenset({"cpu"}))


def test_peft_wrapped_dispatched_model_equals_merge_then_export(tiny_models, tmp_path, cpu_accelerator):
    """A dispatched model (hooks, a CPU-spilled lm_head) wrapped by PEFT with an unmerged LoRA (rsLoRA, rank_pattern)
    exports like merge_and_unload + save_pretrained + export; afterwards the hooks, hf_device_map and weights are the
    same objects and values, and the adapter is still unmerged and trainable."""
    base = load(tiny_models("qwen3"))
    # a spilled module's weights live in its hook (meta in the module); PEFT cannot put LoRA weights on such a
    # module (it moves them to meta too), so the spilled one here is the untargeted lm_head
    device_map = {"model.embed_tokens": STAND_IN_GPU, "model.layers.0": STAND_IN_GPU, "model.layers.1": STAND_IN_GPU,
                  "model.norm": STAND_IN_GPU, "model.rotary_emb": STAND_IN_GPU, "lm_head": "cpu"}
    base = dispatch_model(base, device_map, main_device=STAND_IN_GPU, force_hooks=True)
    assert base.lm_head.weight.is_meta
    live = lora_model(base, r=8, lora_alpha=16, use_rslora=True, rank_pattern={"k_proj": 4},
                      targets=["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"])
    hooks = {id(m): m.__dict__["_hf_hook"] for m in live.modules() if "_hf_hook" in m.__dict__}
    device_map_before = dict(base.hf_device_map)
    before = _state(live)
    spilled = base.lm_head._hf_hook.weights_map["weight"]
    spilled_value = spilled.clone()
    ids = torch.tensor([[1, 5, 9, 3, 120, 64, 2, 8]])
    with torch.no_grad():
        logits = live(ids).logits.clone()

    _export(_job(tmp_path / "out"), model=live)

    _assert_same_model(live, before)
    assert {id(m): m.__dict__["_hf_hook"] for m in live.modules() if "_hf_hook" in m.__dict__} == hooks
    assert base.hf_device_map == device_map_before
    assert base.lm_head._hf_hook.weights_map["weight"] is spilled and torch.equal(spilled, spilled_value)
    lora_layers = [m for m in live.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert len(lora_layers) == 10 and not any(m.merged for m in lora_layers)
    assert all(p.requires_grad for n, p in live.named_parameters() if "lora_" in n)
    with torch.no_grad():
        assert torch.equal(live(ids).logits, logits)

    merged = copy.deepcopy(live).merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    assert output_bytes(tmp_path / "out") == _export_checkpoint(tmp_path / "merged", tmp_path / "ref")


CRASHING_STUDIO = textwrap.dedent("""
    import os, signal, sys
    from shared.job import parse_job
    from supervisor import Supervisor, events as ev
    from tests.ref_studio import load
    model = load(sys.argv[1])
    job = parse_job({"export": {"scheme": "%s", "output": sys.argv[2]},
                     "resources": {"device": "cpu", "workers": 1}})  # one worker: layer 0 is the first part written
    with Supervisor(job, model=model) as run:
        for e in run.events():
            if isinstance(e, ev.LayerWritten) and e.index == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # the studio (and its supervisor) dies mid-export
""" % SCHEME)


def test_changed_live_model_after_a_supervisor_crash_is_not_mixed(tiny_models, tmp_path):
    """A studio killed after layer 0 was journaled; the re-run holds a model whose layer 0 changed since: layer 0 is
    redone (never taken from the old shard), and the output equals the export of the changed model."""
    source, out = tiny_models("llama"), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CRASHING_STUDIO, source, str(out)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    with open(out / ".export" / "journal.jsonl") as f:
        # layer 0, and layer 1 when it was written ahead of the export plan's verdict and journaled with it
        journaled = [json.loads(line)["index"] for line in f if '"Shard"' in line]
    assert journaled in ([0], [0, 1]), journaled

    model = load(source)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # "trained a bit more" between the two runs
    seen = _export(_job(out), model=model)
    started = next(e for e in seen if isinstance(e, ev.Started))
    assert started.redo == [0] and started.resumed == len(journaled) - 1 and started.todo == 4 - len(journaled)

    model.save_pretrained(tmp_path / "saved")
    assert output_bytes(out) == _export_checkpoint(tmp_path / "saved", tmp_path / "ref")


def test_disk_offloaded_live_model_is_refused_before_anything_is_written(tiny_models, tmp_path, cpu_accelerator):
    """A live model with a disk-offloaded module has weights in no memory the child could map: one-line SourceError
    from Supervisor(...), no output folder, the model untouched."""
    from supervisor.errors import SourceError

    device_map = {"model.embed_tokens": STAND_IN_GPU, "model.layers.0": STAND_IN_GPU, "model.layers.1": "disk",
                  "model.norm": STAND_IN_GPU, "model.rotary_emb": STAND_IN_GPU, "lm_head": STAND_IN_GPU}
    model = dispatch_model(load(tiny_models("llama")), device_map, main_device=STAND_IN_GPU, force_hooks=True,
                           offload_dir=str(tmp_path / "offload"))
    before = _state(model)
    with pytest.raises(SourceError, match="disk-offloaded") as info:
        Supervisor(_job(tmp_path / "out"), model=model)
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
    _assert_same_model(model, before)
