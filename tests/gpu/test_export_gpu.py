"""On a GPU: the CLI export on cuda equals oneshot, and a live GPU model's memory is free while the child runs."""
import json

import pytest
import torch

from shared.job import parse_job
from supervisor import Supervisor, events as ev
from tests.models import assert_same_tensors, load_tensors
from tests.scenarios import cli

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "W4A16", "NVFP4A16"])
def test_cuda_export_equals_oneshot(scheme, tiny_models, oneshot_ref, tmp_path):
    """`supervisor run` with device=cuda writes the tensors and config.json oneshot writes (oneshot on the GPU too)."""
    ref = oneshot_ref("llama", scheme)
    job = cli.write_job(tmp_path / "job.toml", tiny_models("llama"), tmp_path / "out", scheme, device="cuda")
    done = cli.events(cli.run("run", job, "--json"))
    assert done[-1]["type"] == "Finished"
    started = [e for e in done if e["type"] == "WorkerStarted"]
    assert started[0]["device"] == "cuda:0" and started[0]["gpu_total"] > 0
    # the warm parent's imports (torchao's capability checks included) left CUDA alone, so workers are forked
    pool = next(e for e in done if e["type"] == "PoolStarted")
    assert pool["forking"], pool
    assert_same_tensors(load_tensors(ref), load_tensors(str(tmp_path / "out")))
    with open(f"{ref}/config.json") as a, open(tmp_path / "out" / "config.json") as b:
        assert json.load(a) == json.load(b)


def test_live_model_memory_is_free_for_the_child(tiny_models, tmp_path):
    """The child sees the live model's bytes as free GPU memory; afterwards the model is back, logits equal."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000)
    with torch.device("cuda:0"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, 32000, (1, 16), device="cuda:0")
    with torch.no_grad():
        before = model(ids).logits.clone()
    job = parse_job({"source": {"path": tiny_models("llama")},
                     "export": {"scheme": "FP8_DYNAMIC", "output": str(tmp_path / "out")},
                     "resources": {"device": "cuda:0", "workers": 1}})  # one child: its view of free memory
    # What a child sees without the release: the baseline to compare with.
    free_with_model = torch.cuda.mem_get_info(0)[0]
    with Supervisor(job, model=model) as run:
        seen = list(run.events())
        run.wait()
    released = next(e for e in seen if isinstance(e, ev.MemoryReleased))
    started = next(e for e in seen if isinstance(e, ev.WorkerStarted))
    assert released.released and released.freed.get("cuda:0", 0) >= 0.99 * model_bytes
    # The child's own measurement: the model's bytes are free for it, less the CUDA contexts started by then: its own
    # and the export plan's worker's, which starts beside it on a GPU (~0.5 GB each; measured on an H200: 5.7 GB
    # more free than with the 6.2 GB model resident in one run, 5.05 GB in another, tenth session).
    context = 3 << 29
    assert started.gpu_free - free_with_model >= model_bytes - context, (started.gpu_free, free_with_model)
    assert all(p.device.type == "cuda" for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_extra_workers_a_busy_gpu_cannot_hold_are_left_out(tmp_path):
    """The default worker count (three on one GPU for layers up to 1 GiB) on a GPU that another process keeps nearly
    full: the first worker starts, the two extra ones each measure less free memory than three workers' layers need
    and are left out (WorkerLeftOut, killed), and the run finishes on the first worker with the bytes of a run that
    asked for one worker.

    Six layers, so that each of the three slots takes a part at once (the non-layer part is the supervisor's own,
    supervisor/run/verbatim.py). Sizes: layers of 0.534 GiB on average (the checkpoint over its layers), so a worker needs
    1.34 GiB (2.5 layers) and an extra one 4.01 GiB (three workers'); this process leaves 4.2 GiB free, so the first
    worker sees at least 2.2 GiB however many CUDA contexts (~0.5 GiB each: three workers' and the export plan's)
    start beside it, and an extra one at most 3.7 GiB."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=6, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "model")
    del model
    reference = cli.write_job(tmp_path / "one.toml", tmp_path / "model", tmp_path / "one", "FP8_DYNAMIC",
                              device="cuda:0", workers=1)
    job = cli.write_job(tmp_path / "job.toml", tmp_path / "model", tmp_path / "out", "FP8_DYNAMIC", device="cuda:0")
    free, _ = torch.cuda.mem_get_info(0)
    hog = torch.empty(free - int(4.2 * 2**30), dtype=torch.uint8, device="cuda:0")
    try:
        done = cli.events(cli.run("run", job, "--json"))
        cli.run("run", reference)
    finally:
        del hog
        torch.cuda.empty_cache()
    assert done[-1]["type"] == "Finished", done[-1]
    left = [e for e in done if e["type"] == "WorkerLeftOut"]
    assert sorted(e["worker"] for e in left) == [1, 2], left
    assert all("3 workers' layers there need" in e["reason"] for e in left), left
    assert {e["worker"] for e in done if e["type"] == "WorkerStarted"} == {0}
    assert {e["worker"] for e in done if e["type"] == "LayerStarted"} == {0}
    assert cli.output_bytes(tmp_path / "out") == cli.output_bytes(tmp_path / "one")
