"""On GPUs: a live PEFT model dispatched over one or two GPUs exported without a checkpoint (the studio path).

The reference is PEFT + transformers on the CPU: the same base weights and adapter, merge_and_unload() on CPU,
save_pretrained, exported with the same job. The child merges on the CPU (child/sources/adapter.py), so the export must be
bit-identical to it; whether PEFT's merge on a GPU would be is measured by bench/lora_merge_fidelity.py
(docs/fidelity.md). Peak GPU memory in the child is one layer's work, not the model.
"""
import copy

import pytest
import torch

from shared.job import parse_job
from supervisor import Supervisor, events as ev
from tests.ref_studio import lora_model
from tests.scenarios.cli import output_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _export(job_dict, **kwargs):
    with Supervisor(parse_job(job_dict), **kwargs) as run:
        seen = list(run.events())
        run.wait()
    return seen


@pytest.mark.parametrize("gpus", [1, 2])
def test_live_lora_model_exports_without_a_checkpoint(gpus, tmp_path):
    """A PEFT model dispatched over `gpus` GPUs is released into the shared pool and exported on cuda:0 from it, the
    LoRA merged per layer: bytes equal the CPU merge-then-export, the child's peak GPU memory is a layer's work, the
    model is off the GPUs meanwhile and comes back with the same logits."""
    from accelerate import dispatch_model

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    cpu_live = lora_model(_model(), r=16, lora_alpha=32, use_rslora=True)
    reference = copy.deepcopy(cpu_live).merge_and_unload()  # PEFT's merge on CPU: the reference
    reference.save_pretrained(tmp_path / "merged")
    half = 4 if gpus == 2 else 8
    last = gpus - 1
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": last, "lm_head": last,
                  **{f"model.layers.{i}": 0 if i < half else 1 for i in range(8)}}
    live = copy.deepcopy(cpu_live)
    dispatch_model(live.base_model.model, device_map)
    model_bytes = sum(p.numel() * p.element_size() for p in live.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for p in live.base_model.model.model.layers[0].parameters())
    ids = torch.randint(0, 32000, (1, 16), device="cuda:0")
    with torch.no_grad():
        before = live(ids).logits.clone()
    on_device = [sum(p.numel() * p.element_size() for p in live.parameters() if p.device == torch.device("cuda", d))
                 for d in range(gpus)]
    # what stays allocated besides the model: the logits above and cuBLAS's workspace (32 MiB per GPU on an H200,
    # allocated through torch's allocator by the first matmul)
    allocated_before = [torch.cuda.memory_allocated(d) for d in range(gpus)]

    job = {"export": {"scheme": "FP8_DYNAMIC", "output": str(tmp_path / "out")}, "resources": {"device": "cuda:0"}}
    allocated_during = []

    seen = []
    with Supervisor(parse_job(job), model=live) as run:
        for e in run.events():
            seen.append(e)
            if isinstance(e, ev.LayerWritten) and not allocated_during:
                allocated_during.append([torch.cuda.memory_allocated(d) for d in range(gpus)])
        run.wait()
    released = next(e for e in seen if isinstance(e, ev.MemoryReleased))
    assert released.released and sum(released.freed.values()) >= 0.99 * model_bytes
    for d in range(gpus):  # the live model is off its GPUs during the export
        assert allocated_before[d] - allocated_during[0][d] >= 0.99 * on_device[d], (d, allocated_before,
                                                                                       allocated_during, on_device)
    peaks = [e.peak_gpu for e in seen if isinstance(e, ev.LayerWritten) and e.index >= 0]
    assert max(peaks) < 4 * layer_bytes < model_bytes, (max(peaks), layer_bytes, model_bytes)

    assert {p.device for p in live.base_model.model.model.layers[0].parameters()} == {torch.device("cuda:0")}
    assert {p.device for p in live.base_model.model.model.layers[7].parameters()} == {torch.device(f"cuda:{last}")}
    assert not any(m.merged for m in live.modules() if hasattr(m, "merged"))
    with torch.no_grad():
        assert torch.equal(live(ids).logits, before)

    _export({"source": {"path": str(tmp_path / "merged")}, "export": {**job["export"], "output": str(tmp_path / "ref")},
             "resources": job["resources"]})
    assert output_bytes(tmp_path / "out") == output_bytes(tmp_path / "ref")


def test_live_qlora_model_exports_from_its_bf16_base_and_pairs(tmp_path):
    """A PEFT LoRA (r=16, q/v/down_proj, random B) over a real bitsandbytes nf4 base on cuda:0, exported with no
    [source]: the base is the bf16 folder it was loaded from, the pairs come from memory; the 4-bit model is off the
    GPU meanwhile and comes back equal (every state_dict entry: Params4bit data, absmax, quant_state; same logits);
    the output equals PeftModel.from_pretrained(bf16 base, saved adapter).merge_and_unload() exported."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from tests.ref_studio import merged_checkpoint

    _model().save_pretrained(tmp_path / "base")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quant, device_map={"": 0},
                                                dtype=torch.bfloat16).eval()
    live = lora_model(base, r=16, lora_alpha=32, targets=["q_proj", "v_proj", "down_proj"])
    layer0 = live.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert type(layer0).__name__ == "Params4bit" and layer0.device == torch.device("cuda:0")
    del layer0  # a reference would keep its GPU copy alive through the release
    state = {k: v.detach().to("cpu", copy=True) for k, v in live.state_dict().items()}
    ids = torch.randint(0, 32000, (1, 16), device="cuda:0")
    with torch.no_grad():
        before = live(ids).logits.clone()
    on_gpu = torch.cuda.memory_allocated(0)
    model_bytes = sum(p.numel() * p.element_size() for p in live.parameters())  # Params4bit: the packed bytes

    job = {"export": {"scheme": "FP8_DYNAMIC", "output": str(tmp_path / "out")}, "resources": {"device": "cuda:0"}}
    during = []
    seen = []
    with Supervisor(parse_job(job), model=live) as run:
        for e in run.events():
            seen.append(e)
            if isinstance(e, ev.LayerWritten) and not during:
                during.append(torch.cuda.memory_allocated(0))
        run.wait()
    released = next(e for e in seen if isinstance(e, ev.MemoryReleased))
    assert released.released and released.freed["cuda:0"] >= 0.99 * model_bytes
    assert during[0] <= on_gpu - released.freed["cuda:0"] + (1 << 20)  # off the GPU while the child works
    restored = next(e for e in seen if isinstance(e, ev.ModelRestored))
    now = live.state_dict()
    assert set(now) == set(state) and all(torch.equal(now[k].cpu(), v) for k, v in state.items())
    assert live.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.device == torch.device("cuda:0")
    with torch.no_grad():
        assert torch.equal(live(ids).logits, before)
    print(f"released {released.freed['cuda:0'] / 1e9:.2f} GB in {released.seconds:.2f} s, "
          f"restored in {restored.seconds:.2f} s")

    live.save_pretrained(tmp_path / "adapter")
    merged_checkpoint(str(tmp_path / "base"), str(tmp_path / "adapter"), str(tmp_path / "merged"))
    _export({"source": {"path": str(tmp_path / "merged")}, "export": {**job["export"], "output": str(tmp_path / "ref")},
             "resources": job["resources"]})
    assert output_bytes(tmp_path / "out") == output_bytes(tmp_path / "ref")


@pytest.mark.parametrize("quant", ["nf4-double-quant", "int8"])
def test_live_qlora_base_quantized_on_the_gpu_is_recognised_by_its_weights(tmp_path, quant):
    """A bitsandbytes base quantized on cuda:0 (nf4 with double quant, whose bytes bitsandbytes' CPU quantization
    does not reproduce: its offset and 8-bit absmax differ, measured; int8, whose rows round differently): the bf16
    folder it was loaded from is accepted, another seed's checkpoint of the same config is refused naming its
    tensor, and nothing is written."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    from supervisor.errors import SourceError

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=32000)
    for seed, name in ((0, "base"), (7, "seed7")):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / name)
    q = (BitsAndBytesConfig(load_in_8bit=True) if quant == "int8" else
         BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                            bnb_4bit_compute_dtype=torch.bfloat16))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=q, device_map={"": 0},
                                                dtype=torch.bfloat16).eval()
    live = lora_model(base, r=16, lora_alpha=32, targets=["q_proj", "v_proj", "down_proj"])
    assert live.base_model.model.model.layers[0].self_attn.v_proj.base_layer.weight.device == torch.device("cuda:0")

    def job(folder):
        return parse_job({"source": {"path": str(tmp_path / folder)},
                          "export": {"scheme": "FP8_DYNAMIC", "output": str(tmp_path / "out")},
                          "resources": {"device": "cuda:0"}})

    assert Supervisor(job("base"), model=live).plan.job.source.path == str(tmp_path / "base")
    with pytest.raises(SourceError, match="holds another checkpoint than the live model's base") as info:
        Supervisor(job("seed7"), model=live)
    assert "its model.layers.0." in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()
