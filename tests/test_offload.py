"""Release/restore of a live model (supervisor/live/offload.py) on CPU-only machines.

CI has no GPU, so most tests declare the CPU an accelerator device type (the `cpu_accelerator` fixture):
release() then runs its real path on a dispatched model with real accelerate hooks -- planning, pool leases,
byte copies into host buffers, `.data` swaps, hook removal and re-attachment, rollback and verification.
Only the host<->device transfer itself is left to tests/gpu/test_offload_gpu.py. In device maps the
stand-in GPU is `torch.device("cpu")`, which accelerate does not equate with the string "cpu" (its spill
target), so a map can hold both "GPU" modules and real CPU-offloaded ones.
"""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
from accelerate import dispatch_model
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from supervisor.live import offload
from supervisor.live.offload import NotReleased, OffloadError, PinnedPool, Released, map_refusal, release, restore

GPU = torch.device("cpu")  # the stand-in accelerator in device maps (see the module docstring)
TOP = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "model.rotary_emb", "lm_head"]
IDS = torch.tensor([[1, 5, 9, 3, 127, 64, 2, 8]])


@pytest.fixture
def cpu_accelerator(monkeypatch):
    monkeypatch.setattr(offload, "ACCELERATOR_TYPES", frozenset({"cpu"}))


def tiny_model() -> nn.Module:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def dispatched(spill=(), disk=(), offload_dir=None) -> nn.Module:
    device_map = {name: "cpu" if name in spill else "disk" if name in disk else GPU for name in TOP}
    return dispatch_model(tiny_model(), device_map, main_device=GPU, force_hooks=True, offload_dir=offload_dir)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def tensors(model) -> dict[str, tuple]:
    """name -> (object, device, data_ptr, clone or None for meta) for every parameter and buffer slot."""
    out = {}
    for mname, module in model.named_modules():
        for table in ("_parameters", "_buffers"):
            for key, t in getattr(module, table).items():
                if t is not None:
                    clone = None if t.is_meta else t.detach().clone()
                    out[f"{mname}.{key}"] = (t, t.device, t.data_ptr(), clone)
    return out


def hooks(model) -> dict[str, dict]:
    """Each module's own accelerate attributes (not proxied ones), by module name."""
    keys = ("_hf_hook", "_old_forward", "forward")
    return {
        name: {k: m.__dict__[k] for k in keys if k in m.__dict__}
        for name, m in model.named_modules()
        if "_hf_hook" in m.__dict__
    }


def current(model, name) -> torch.Tensor:
    mname, key = name.rsplit(".", 1)
    module = model.get_submodule(mname)
    return module._parameters.get(key, module._buffers.get(key))


def assert_unchanged(model, before: dict, *, same_storage: bool = False) -> None:
    now = tensors(model)
    assert now.keys() == before.keys()
    for name, (obj, device, ptr, clone) in before.items():
        t = now[name][0]
        assert t is obj, name
        assert t.device == device, name
        if clone is not None:
            assert torch.equal(t, clone), name
        if same_storage:
            assert t.data_ptr() == ptr, name


def assert_same_hooks(model, before: dict) -> None:
    now = hooks(model)
    assert now.keys() == before.keys()
    for name, attrs in before.items():
        assert now[name].keys() == attrs.keys(), name
        assert all(now[name][k] is v for k, v in attrs.items()), name


def in_pool(pool: PinnedPool, t: torch.Tensor) -> bool:
    return any(c.data_ptr() <= t.data_ptr() < c.data_ptr() + c.numel() for c in pool._chunks)


def fail_on_call(n: int, real):
    """A stand-in for a tensor helper that raises on its n-th call and behaves normally otherwise."""
    calls = {"n": 0}

    def wrapper(*args):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError(f"injected failure on call {n}")
        return real(*args)

    wrapper.calls = calls
    return wrapper


# ---------------------------------------------------------------------------------------------------------
# Which models are released


@pytest.mark.parametrize(
    ("device_map", "refused"),
    [
        (None, None),
        ({"": 0}, None),
        ({"": "cuda:0"}, None),
        ({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}, None),
        ({"model.embed_tokens": 0, "model.layers.0": "cpu", "lm_head": "cpu"}, None),
        ({"": "mps"}, None),
        ({"model.embed_tokens": 0, "model.layers.1": "disk"}, "model.layers.1 to disk/meta"),
        ({"model.embed_tokens": 0, "lm_head": "meta"}, "lm_head to disk/meta"),
        ({"model.embed_tokens": "cpu", "lm_head": "cpu"}, "every module on the host"),
    ],
    ids=["no-map", "one-gpu-int", "one-gpu-str", "two-gpus", "cpu-spill", "mps", "disk", "meta", "all-cpu"],
)
def test_map_refusal_by_map_kind(device_map, refused):
    """Disk/meta targets and all-host maps are refused; one GPU, several GPUs and CPU spills are released."""
    reason = map_refusal(device_map)
    if refused is None:
        assert reason is None
    else:
        assert refused in reason


def test_cpu_model_is_not_released():
    """With the real accelerator types, a model living on the CPU is NotReleased and left untouched."""
    model = tiny_model()
    before = tensors(model)
    result = release(model)
    assert isinstance(result, NotReleased)
    assert "nothing to free" in result.reason
    assert_unchanged(model, before, same_storage=True)


def test_all_cpu_map_is_not_released():
    """A model dispatched entirely to "cpu" is NotReleased, hooks and tensors untouched."""
    model = dispatch_model(tiny_model(), {"": "cpu"}, force_hooks=True)
    before, hooked = tensors(model), hooks(model)
    result = release(model)
    assert isinstance(result, NotReleased) and "host" in result.reason
    assert_unchanged(model, before, same_storage=True)
    assert_same_hooks(model, hooked)


def test_disk_offloaded_model_is_not_released(cpu_accelerator, tmp_path):
    """A real accelerate disk offload is NotReleased, naming the disk module; nothing is moved or unhooked."""
    model = dispatched(disk={"model.layers.1"}, offload_dir=str(tmp_path))
    before, hooked = tensors(model), hooks(model)
    result = release(model)
    assert isinstance(result, NotReleased)
    assert "model.layers.1" in result.reason and "disk" in result.reason
    assert_unchanged(model, before, same_storage=True)
    assert_same_hooks(model, hooked)


# ---------------------------------------------------------------------------------------------------------
# Round trips


def test_round_trip_restores_every_tensor_hook_and_logit(cpu_accelerator):
    """release moves every tensor into the pool and unhooks; restore brings back the same objects, bits and hooks."""
    model = dispatched()
    before, hooked, ref = tensors(model), hooks(model), logits(model)
    device_map = dict(model.hf_device_map)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t, *_ in before.values()}
    pool = PinnedPool()
    handle = release(model, buffers=pool)
    assert isinstance(handle, Released)
    assert hooks(model) == {}
    assert all(in_pool(pool, current(model, name)) for name in before)
    assert handle.moved_bytes == sum(storages.values()) and len(storages) == 22
    assert handle.freed == {}  # CPU has no allocator accounting; tests/gpu checks the real figure
    assert restore(handle) is handle and handle.restored
    assert_unchanged(model, before)
    assert not any(in_pool(pool, current(model, name)) for name in before)
    assert_same_hooks(model, hooked)
    assert model.hf_device_map == device_map
    assert torch.equal(logits(model), ref)


def test_cpu_spill_is_left_alone(cpu_accelerator):
    """Modules spilled to "cpu" (meta params, weights in the hook's weights_map) are not touched."""
    model = dispatched(spill={"model.layers.1"})
    spilled = model.model.layers[1].self_attn.q_proj
    weights = spilled._hf_hook.weights_map
    spill_ptrs = {k: weights[k].data_ptr() for k in ("weight",)}
    assert spilled.weight.is_meta
    ref = logits(model)  # before the snapshot: accelerate swaps in new meta placeholders on every forward
    before, hooked = tensors(model), hooks(model)
    pool = PinnedPool()
    handle = release(model, buffers=pool)
    assert spilled.weight.is_meta and not in_pool(pool, weights["weight"])
    assert in_pool(pool, model.model.layers[0].self_attn.q_proj.weight)
    restore(handle)
    assert {k: weights[k].data_ptr() for k in spill_ptrs} == spill_ptrs
    assert_unchanged(model, before)
    assert_same_hooks(model, hooked)
    assert torch.equal(logits(model), ref)
    assert restore(handle) is handle  # re-verifying after a forward: new meta placeholders are not a change


def test_tied_weights_stay_one_parameter(cpu_accelerator):
    """embed_tokens and lm_head share one Parameter before, during and after release."""
    model = dispatched()
    tied = model.lm_head.weight
    assert tied is model.model.embed_tokens.weight
    value = tied.detach().clone()
    pool = PinnedPool()
    handle = release(model, buffers=pool)
    assert model.lm_head.weight is model.model.embed_tokens.weight is tied and in_pool(pool, tied)
    restore(handle)
    assert model.lm_head.weight is model.model.embed_tokens.weight is tied
    assert torch.equal(tied, value)


def test_forward_replaced_after_dispatch_is_kept(cpu_accelerator):
    """A forward installed after dispatch (fused kernel, monkeypatch) is the same object after restore and runs."""
    model = dispatched()
    proj = model.model.layers[0].self_attn.q_proj
    hooked_forward, calls = proj.forward, []

    def patched(*args, **kwargs):
        calls.append(1)
        return hooked_forward(*args, **kwargs) * 1.5

    proj.forward = patched
    hook, ref = proj._hf_hook, logits(model)
    handle = release(model)
    assert "_hf_hook" not in proj.__dict__ and proj.forward.__func__ is nn.Linear.forward  # the hook's _old_forward
    restore(handle)
    assert proj.__dict__["forward"] is patched and proj._hf_hook is hook
    calls.clear()
    assert torch.equal(logits(model), ref) and calls == [1]


def test_lora_like_module_added_after_dispatch(cpu_accelerator):
    """A module added after dispatch (no hook of its own) is moved and restored like any other."""
    model = dispatched()
    attn = model.model.layers[0].self_attn
    attn.adapter = nn.Linear(64, 64, bias=False)
    nn.init.normal_(attn.adapter.weight)
    base_forward = attn.q_proj.forward
    attn.q_proj.forward = lambda x: base_forward(x) + attn.adapter(x)
    before, ref = tensors(model), logits(model)
    pool = PinnedPool()
    handle = release(model, buffers=pool)
    assert in_pool(pool, attn.adapter.weight)
    restore(handle)
    assert_unchanged(model, before)
    assert torch.equal(logits(model), ref)


def test_peft_wrapped_model_unhooks_the_real_dispatch_root(cpu_accelerator):
    """A PeftModel is released through its base model's own hooks; LoRA weights and logits come back."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(dispatched(), config)
    assert hasattr(model, "_hf_hook") and "_hf_hook" not in model.__dict__  # proxied from the base model
    before, hooked, ref = tensors(model), hooks(model), logits(model)
    lora = [name for name in before if "lora_A" in name]
    assert lora
    pool = PinnedPool()
    handle = release(model, buffers=pool)
    assert isinstance(handle, Released)
    assert not hasattr(model, "_hf_hook") and hooks(model) == {}
    assert all(in_pool(pool, current(model, name)) for name in lora)
    restore(handle)
    assert_unchanged(model, before)
    assert_same_hooks(model, hooked)
    assert torch.equal(logits(model), ref)


def test_grads_move_and_come_back(cpu_accelerator):
    """Gradients move with their parameters and are the same tensors with the same values after restore."""
    model = dispatched()
    model(IDS).logits.float().pow(2).mean().backward()
    grads = {n: (p.grad, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None}
    assert grads
    pool = PinnedPool()
    handle = release(model, buffers=pool)
    params = dict(model.named_parameters())
    assert all(params[n].grad is g and in_pool(pool, g) for n, (g, _) in grads.items())
    restore(handle)
    for n, (grad, value) in grads.items():
        assert params[n].grad is grad and grad.device == GPU and torch.equal(grad, value), n


def test_restore_is_idempotent(cpu_accelerator):
    """A second restore moves nothing and returns the same handle."""
    model = dispatched()
    handle = release(model)
    restore(handle)
    ptrs, seconds = {n: t.data_ptr() for n, t in model.state_dict().items()}, handle.restore_seconds
    assert restore(handle) is handle
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == ptrs
    assert handle.restore_seconds == seconds


def test_second_cycle_reuses_pool_buffers(cpu_accelerator):
    """A pool kept across cycles serves the second release from the same host buffers, without growing."""
    model = dispatched()
    pool = PinnedPool()
    restore(release(model, buffers=pool))
    chunks, capacity = [id(c) for c in pool._chunks], pool.capacity
    assert capacity > 0 and not pool.leased
    handle = release(model, buffers=pool)
    assert pool.leased and [id(c) for c in pool._chunks] == chunks and pool.capacity == capacity
    assert in_pool(pool, model.lm_head.weight)
    restore(handle)
    pool.close()
    assert pool.capacity == 0


def test_busy_pool_is_refused(cpu_accelerator):
    """A pool holding one released model refuses a second release, which leaves its model untouched."""
    first, second = dispatched(), dispatched()
    pool = PinnedPool()
    handle = release(first, buffers=pool)
    before = tensors(second)
    with pytest.raises(OffloadError, match="already holds a released model"):
        release(second, buffers=pool)
    with pytest.raises(OffloadError, match="restore"):
        pool.close()
    assert_unchanged(second, before, same_storage=True)
    restore(handle)


def test_unmanaged_accelerator_attributes_are_reported(cpu_accelerator):
    """Plain tensor attributes on an accelerator (not params/buffers) are listed, not moved."""
    model = dispatched()
    model.model.kv_cache = torch.zeros(4)
    handle = release(model)
    assert "model.kv_cache" in handle.unmanaged
    restore(handle)


def test_shared_storage_and_strides_survive(cpu_accelerator):
    """Views sharing one storage stay views of one storage, with the same strides and offsets."""
    module = nn.Module()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    module.register_buffer("base", base)
    module.register_buffer("tail", base[1:])
    module.register_buffer("transposed", base.t())
    pool = PinnedPool()
    handle = release(module, buffers=pool)
    assert in_pool(pool, module.tail) and module.transposed.stride() == (1, 6)
    assert module.tail.untyped_storage().data_ptr() == module.base.untyped_storage().data_ptr()
    restore(handle)
    assert module.tail.untyped_storage().data_ptr() == module.base.untyped_storage().data_ptr()
    assert module.tail.storage_offset() == 6 and module.transposed.stride() == (1, 6)
    assert torch.equal(module.transposed, torch.arange(24.0).reshape(4, 6).t())
    assert handle.moved_bytes == 24 * 4


# ---------------------------------------------------------------------------------------------------------
# Failures


def test_failed_copy_during_release_leaves_model_untouched(cpu_accelerator, monkeypatch):
    """A copy failing midway raises OffloadError; every tensor, storage and hook is as before; the pool is free."""
    model = dispatched()
    before, hooked, ref = tensors(model), hooks(model), logits(model)
    failing = fail_on_call(3, offload._copy_tensor)
    monkeypatch.setattr(offload, "_copy_tensor", failing)
    pool = PinnedPool()
    with pytest.raises(OffloadError, match="not changed") as caught:
        release(model, buffers=pool)
    assert "injected failure" in str(caught.value.__cause__)
    assert failing.calls["n"] == 3
    assert_unchanged(model, before, same_storage=True)
    assert_same_hooks(model, hooked)
    assert not pool.leased and torch.equal(logits(model), ref)
    restore(release(model, buffers=pool))
    assert torch.equal(logits(model), ref)


def test_failed_swap_midway_puts_moved_tensors_back(cpu_accelerator, monkeypatch):
    """A swap failing after some tensors moved puts those back on their original storage and re-hooks."""
    model = dispatched()
    before, hooked, ref = tensors(model), hooks(model), logits(model)
    failing = fail_on_call(5, offload._set_data)
    monkeypatch.setattr(offload, "_set_data", failing)
    pool = PinnedPool()
    with pytest.raises(OffloadError, match="put back"):
        release(model, buffers=pool)
    assert failing.calls["n"] > 5  # the rollback ran through the same swap helper
    assert_unchanged(model, before, same_storage=True)
    assert_same_hooks(model, hooked)
    assert not pool.leased and torch.equal(logits(model), ref)


@pytest.mark.parametrize("helper", ["_copy_tensor", "_set_data"])
def test_failed_restore_keeps_model_released_and_retry_works(cpu_accelerator, monkeypatch, helper):
    """A restore failing midway leaves the model fully released; calling restore again succeeds."""
    model = dispatched()
    before, hooked, ref = tensors(model), hooks(model), logits(model)
    pool = PinnedPool()
    handle = release(model, buffers=pool)
    real = getattr(offload, helper)
    monkeypatch.setattr(offload, helper, fail_on_call(2, real))
    with pytest.raises(OffloadError, match="still released"):
        restore(handle)
    assert not handle.restored and pool.leased and hooks(model) == {}
    assert all(in_pool(pool, current(model, name)) for name in before)
    monkeypatch.setattr(offload, helper, real)
    restore(handle)
    assert_unchanged(model, before)
    assert_same_hooks(model, hooked)
    assert torch.equal(logits(model), ref)


# ---------------------------------------------------------------------------------------------------------
# Quantized tensors (tensor subclasses keep state outside .data)


class RefusingParams(nn.Parameter):
    """Like bnb Int8Params under a stack that forbids moving 8-bit models."""

    def to(self, *args, **kwargs):
        raise ValueError("`.to` is not supported for `8-bit` bitsandbytes models")


class MovableParams(nn.Parameter):
    """Like bnb Params4bit: .to() returns a new object and moves its quant_state along."""

    quant_state: torch.Tensor
    moves: list = []

    def to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        MovableParams.moves.append(device)
        moved = MovableParams(super().to(*args, **kwargs).clone(), requires_grad=False)
        moved.quant_state = self.quant_state.to(device).clone()
        return moved


def quantize(linear: nn.Linear, cls) -> nn.Parameter:
    param = cls(linear.weight.detach().clone(), requires_grad=False)
    param.quant_state = torch.ones(3)
    linear._parameters["weight"] = param
    return param


def test_stack_refusal_is_not_released(cpu_accelerator):
    """A quantized tensor whose own .to() refuses gives NotReleased with its reason; nothing moved or unhooked."""
    model = dispatched()
    quantize(model.model.layers[1].mlp.up_proj, RefusingParams)
    before, hooked = tensors(model), hooks(model)
    pool = PinnedPool()
    result = release(model, buffers=pool)
    assert isinstance(result, NotReleased)
    assert "model.layers.1.mlp.up_proj.weight (RefusingParams)" in result.reason
    assert "not supported for `8-bit`" in result.reason
    assert_unchanged(model, before, same_storage=True)
    assert_same_hooks(model, hooked)
    assert not pool.leased


def test_quantized_tensor_moves_through_its_own_to(cpu_accelerator):
    """A tensor subclass is moved by its own .to() both ways and comes back with its side state."""
    model = dispatched()
    proj = model.model.layers[0].mlp.down_proj
    value = quantize(proj, MovableParams).detach().clone()
    ref = logits(model)
    MovableParams.moves.clear()
    original = weakref.ref(proj.weight)
    handle = release(model)
    assert MovableParams.moves == [torch.device("cpu")]
    gc.collect()
    assert original() is None  # nothing (slot, snapshot, handle) keeps the device object alive
    restore(handle)
    assert MovableParams.moves == [torch.device("cpu"), GPU]
    assert type(proj.weight) is MovableParams and proj.weight.device == GPU
    assert torch.equal(proj.weight, value) and torch.equal(proj.weight.quant_state, torch.ones(3))
    assert torch.equal(logits(model), ref)
    assert handle.moved_bytes > proj.weight.untyped_storage().nbytes()


# ---------------------------------------------------------------------------------------------------------
# Verification


def test_restore_reports_a_parameter_replaced_while_released(cpu_accelerator):
    """A parameter swapped out while released makes restore raise OffloadError naming it."""
    model = dispatched()
    handle = release(model)
    proj = model.model.layers[0].self_attn.k_proj
    proj.weight = nn.Parameter(proj.weight.detach().clone())
    with pytest.raises(OffloadError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight was replaced"):
        restore(handle)


def test_restore_reports_a_tensor_on_the_wrong_device(cpu_accelerator):
    """Verification checks devices: a tensor moved behind the handle's back is reported on re-restore."""
    model = dispatched()
    handle = restore(release(model))
    norm = model.model.norm.weight
    torch.utils.swap_tensors(norm, nn.Parameter(torch.empty_like(norm, device="meta")))  # same object, on meta
    with pytest.raises(OffloadError, match=r"model\.norm\.weight is on meta, expected cpu"):
        restore(handle)


def test_restore_reports_a_hook_changed_while_released(cpu_accelerator):
    """A hook attribute that differs from the recorded object after restore is reported."""
    model = dispatched()
    handle = release(model)
    restore(handle)
    proj = model.model.layers[0].self_attn.q_proj
    proj._hf_hook = functools.partial(print)
    with pytest.raises(OffloadError, match="hook or forward of Linear"):
        restore(handle)


def test_a_view_kept_after_close_still_reads_its_bytes():
    """close() gives the pool's memory back without unmapping what a caller still holds: a view taken from a lease
    reads the bytes written into it after the pool is closed (torch.frombuffer keeps no buffer export, so an
    explicit unmap would leave it dangling)."""
    pool = PinnedPool(pin=False)
    (view,) = pool.lease([4096])
    view.fill_(7)
    pool.end_lease()
    pool.close()
    assert int(view.sum()) == 7 * 4096


def test_bins_place_every_storage_once_and_balance_the_bytes():
    """A new chunk's storages are spread over memfds of about equal size, each storage whole, none lost."""
    from supervisor.live.hostpool import _bins

    items = [(n, i) for i, n in enumerate([900, 10, 500, 400, 300, 300, 200, 100, 50, 40])]
    bins = _bins(items, 4)
    assert sorted(it for b in bins for it in b) == sorted(items)
    totals = [sum(n for n, _ in b) for b in bins]
    assert max(totals) == 900 and min(totals) >= 600  # the biggest storage alone; the rest shared out
    assert _bins([(5, 0)], 8) == [[(5, 0)]]  # no empty memfds


def test_a_pool_split_over_several_memfds_round_trips_and_is_reused(cpu_accelerator, monkeypatch):
    """With the pool's new memory split over several memfds, release/restore keeps every bit and logit, the second
    cycle reuses the same chunks, and every chunk is shared with a child."""
    from supervisor.live import hostpool

    monkeypatch.setattr(hostpool, "MIN_BIN", 1 << 16)
    model = dispatched()
    before, ref = tensors(model), logits(model)
    pool = PinnedPool()
    handle = release(model, buffers=pool)
    chunks = [id(c) for c in pool._chunks]
    assert len(chunks) > 1 and len(pool.shared()) == len(chunks)
    assert all(in_pool(pool, current(model, name)) for name in before)
    assert torch.equal(logits(model), ref)  # the model runs from the pool's host copy
    restore(handle)
    assert_unchanged(model, before)
    restore(release(model, buffers=pool))
    assert [id(c) for c in pool._chunks] == chunks
    assert torch.equal(logits(model), ref)
    pool.close()


def test_the_same_sizes_leased_again_take_the_same_places(monkeypatch):
    """A pool made to measure for one model (its storages spread over several memfds) serves the next release of
    that model without a byte more, even when first-fit in the storages' order would not fit them (the second
    release of a 16 GB model then paid for a new 1 GB chunk: 1.23 s against 0.31 s)."""
    from supervisor.live import hostpool

    monkeypatch.setattr(hostpool, "MIN_BIN", hostpool.ALIGN)
    monkeypatch.setattr(hostpool, "FILL_THREADS", 4)
    sizes = [u * hostpool.ALIGN for u in (1, 9, 5, 4, 3, 3, 2, 1)]
    pool = PinnedPool(pin=False)
    first = pool.lease(sizes)
    chunks, capacity = [id(c) for c in pool._chunks], pool.capacity
    assert len(chunks) == 4 and capacity == sum(sizes)
    places = [v.data_ptr() for v in first]
    pool.end_lease()
    again = pool.lease(sizes)
    assert [id(c) for c in pool._chunks] == chunks and pool.capacity == capacity
    assert [v.data_ptr() for v in again] == places
    pool.end_lease()
    other = pool.lease([2 * hostpool.ALIGN, 20 * hostpool.ALIGN])  # another model: what does not fit is added
    assert [v.numel() for v in other] == [2 * hostpool.ALIGN, 20 * hostpool.ALIGN]
    assert pool.capacity == capacity + 20 * hostpool.ALIGN
    pool.end_lease()
    pool.close()
