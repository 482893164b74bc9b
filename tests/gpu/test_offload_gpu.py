"""Release/restore on real GPUs (supervisor/live/offload.py): one GPU, two GPUs, a CPU spill, a PEFT wrapper.

The model is a ~310 MB bf16 Llama (hidden 1024, 8 layers, vocab 32000, untied) built from its config, so the
suite needs no hub access and runs in seconds. Every test checks the same contract: while released the GPU
memory is really gone (torch.cuda.memory_allocated drops by the model's bytes) and the tensors sit in pinned
host memory; after restore the same hf_device_map, the same hook objects, the same Parameter objects on the
same devices, bit-identical tensors and bit-identical logits.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model, infer_auto_device_map
from accelerate.utils import get_balanced_memory
from transformers import AutoModelForCausalLM, LlamaConfig

from supervisor.live import offload
from supervisor.live.offload import NotReleased, OffloadError, PinnedPool, Released, release, restore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
NO_SPLIT = ["LlamaDecoderLayer"]


def build(device: str = "cpu") -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def ids(model) -> torch.Tensor:
    device = next(p.device for p in model.parameters() if p.device.type == "cuda")
    return torch.randint(0, 32000, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)


def logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float().cpu()


def snapshot(model) -> dict[str, tuple]:
    """name -> (object, device, CPU copy or None for meta) for every parameter and buffer."""
    out = {}
    for mname, module in model.named_modules():
        for table in ("_parameters", "_buffers"):
            for key, t in getattr(module, table).items():
                if t is not None:
                    out[f"{mname}.{key}"] = (t, t.device, None if t.is_meta else t.detach().cpu().clone())
    return out


def hooks(model) -> dict[str, dict]:
    keys = ("_hf_hook", "_old_forward", "forward")
    return {
        name: {k: m.__dict__[k] for k in keys if k in m.__dict__}
        for name, m in model.named_modules()
        if "_hf_hook" in m.__dict__
    }


def gpu_bytes(model) -> dict[str, int]:
    """Bytes of distinct CUDA storages per device: what release must free."""
    storages: dict[tuple, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "cuda":
            storages[(str(t.device), t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()
    per_device: dict[str, int] = {}
    for (device, _), nbytes in storages.items():
        per_device[device] = per_device.get(device, 0) + nbytes
    return per_device


def round_trip(model, pool: PinnedPool | None = None) -> Released:
    """Release and restore `model`, asserting the whole contract; returns the handle."""
    tokens = ids(model)
    ref, before, hooked = logits(model, tokens), snapshot(model), hooks(model)
    device_map, expected = getattr(model, "hf_device_map", None), gpu_bytes(model)
    allocated = {dev: torch.cuda.memory_allocated(dev) for dev in expected}
    pool = pool or PinnedPool()
    handle = release(model, buffers=pool)
    assert isinstance(handle, Released), handle
    for dev, nbytes in expected.items():
        # empty_cache() also drops cuBLAS workspaces made by the forward above (measured on an H200: 2-3 MiB more
        # than the model's bytes); never less than the model's bytes.
        assert nbytes <= handle.freed[dev] <= nbytes + 64 * 2**20, (dev, handle.freed, expected)
        assert allocated[dev] - torch.cuda.memory_allocated(dev) >= nbytes * 99 // 100
    moved = [obj for obj, device, _ in before.values() if device.type == "cuda"]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in moved)
    assert hooks(model) == {}
    restore(handle)
    assert_restored(model, before, hooked, device_map)
    assert torch.equal(logits(model, tokens), ref)
    return handle


def assert_restored(model, before, hooked, device_map) -> None:
    now = snapshot(model)
    assert now.keys() == before.keys()
    for name, (obj, device, value) in before.items():
        t = now[name][0]
        if device.type == "meta":
            assert t.is_meta, name  # accelerate swaps meta placeholders on every forward: only the device counts
            continue
        assert t is obj and t.device == device, name
        assert torch.equal(now[name][2], value), name
    assert hooks(model).keys() == hooked.keys()
    for name, attrs in hooked.items():
        assert all(model.get_submodule(name).__dict__[k] is v for k, v in attrs.items()), name
    assert getattr(model, "hf_device_map", None) == device_map


def test_single_gpu_model_without_hooks():
    """A model moved to one GPU with .to() is freed and comes back bit-identical."""
    model = build("cuda:0")
    handle = round_trip(model)
    assert handle.moved_bytes == sum(gpu_bytes(model).values())


def test_single_gpu_dispatched_model():
    """A model dispatched to one GPU with hooks forced comes back with the same hooks and logits."""
    model = dispatch_model(build(), {"": 0}, force_hooks=True)
    assert hooks(model)
    round_trip(model)


@two_gpus
def test_balanced_over_two_gpus():
    """A device_map="balanced"-style dispatch over two GPUs frees both and restores the same map and logits."""
    model = build()
    memory = get_balanced_memory(model, no_split_module_classes=NO_SPLIT, max_memory={0: "40GiB", 1: "40GiB"})
    device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=NO_SPLIT)
    assert {0, 1} <= set(device_map.values())
    model = dispatch_model(model, device_map)
    handle = round_trip(model)
    assert set(handle.freed) == {"cuda:0", "cuda:1"}


def test_cpu_spill_is_left_on_the_host():
    """With some layers spilled to the CPU, only GPU-resident tensors move; the spilled weights stay put."""
    model = build()
    device_map = infer_auto_device_map(
        model, max_memory={0: "250MiB", "cpu": "8GiB"}, no_split_module_classes=NO_SPLIT
    )
    assert "cpu" in device_map.values() and 0 in device_map.values()
    model = dispatch_model(model, device_map)
    spilled = [m for m in model.modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    maps = [m._hf_hook.weights_map for m in spilled]
    handle = round_trip(model)
    assert set(handle.freed) == {"cuda:0"}
    assert all(m._hf_hook.weights_map is w for m, w in zip(spilled, maps))


@pytest.mark.parametrize("gpus", [1, pytest.param(2, marks=two_gpus)])
def test_peft_wrapped_dispatched_model(gpus):
    """A PeftModel over a dispatched model is released through the base model's hooks; LoRA weights come back."""
    peft = pytest.importorskip("peft")
    model = build()
    if gpus == 1:
        model = dispatch_model(model, {"": 0}, force_hooks=True)
    else:
        memory = {0: "40GiB", 1: "40GiB"}
        balanced = get_balanced_memory(model, no_split_module_classes=NO_SPLIT, max_memory=memory)
        model = dispatch_model(
            model, infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=NO_SPLIT)
        )
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(model, config)
    lora = [p for n, p in wrapped.named_parameters() if "lora_" in n]
    assert lora and all(p.device.type == "cuda" for p in lora)
    round_trip(wrapped)


def test_second_cycle_reuses_the_pinned_pool():
    """A kept pool is pinned, does not grow on the second cycle, and both cycles restore exactly."""
    model = build("cuda:0")
    pool = PinnedPool()
    round_trip(model, pool)
    capacity = pool.capacity
    assert pool.pinned and capacity >= sum(gpu_bytes(model).values())
    round_trip(model, pool)
    assert pool.capacity == capacity and not pool.leased
    pool.close()


def test_failed_copy_leaves_gpu_model_untouched(monkeypatch):
    """A D2H copy failing midway raises OffloadError and leaves every tensor on its GPU storage."""
    model = dispatch_model(build(), {"": 0}, force_hooks=True)
    tokens = ids(model)
    ref, hooked = logits(model, tokens), hooks(model)
    ptrs = {n: (t.device, t.data_ptr()) for n, t in model.state_dict().items()}
    allocated = torch.cuda.memory_allocated(0)
    real, calls = offload._copy_tensor, []

    def failing(dst, src):
        calls.append(1)
        if len(calls) == 10:
            raise RuntimeError("injected copy failure")
        real(dst, src)

    monkeypatch.setattr(offload, "_copy_tensor", failing)
    with pytest.raises(OffloadError, match="not changed"):
        release(model)
    assert {n: (t.device, t.data_ptr()) for n, t in model.state_dict().items()} == ptrs
    assert torch.cuda.memory_allocated(0) == allocated
    assert all(model.get_submodule(n).__dict__["_hf_hook"] is a["_hf_hook"] for n, a in hooked.items())
    assert torch.equal(logits(model, tokens), ref)


def test_cpu_model_is_not_released():
    """A model on the CPU is NotReleased on a GPU machine too."""
    assert isinstance(release(build()), NotReleased)
