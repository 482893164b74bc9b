"""Release and restore the accelerator memory of a live model handed to the supervisor.

This module owns one thing: taking a model that a studio (or any caller) holds on its GPUs, moving every
accelerator-resident parameter, buffer and gradient into reusable host buffers so a quantizer child can use
the GPU, and later putting the exact same model back. It must never re-dispatch from scratch (accelerate's
`dispatch_model` would hook modules added since, such as LoRA layers, and drop forwards installed after
dispatch), never create new Parameter objects for plain tensors (ties and optimizer references hang on
identity), never touch meta or disk-offloaded tensors, never touch CPU tensors unless asked to share them
(`share_host`, for a live model exported from its pool), and never leave a model half-moved. The host memory
itself is supervisor/live/hostpool.py's.

```
release(model)                                      restore(handle)
  plan: hf_device_map check, walk model.modules()     copy: host buffers -> fresh device storages
        -> slots, grads, hooks, forwards                    (all or nothing; on failure still released)
  copy: accelerator storages -> PinnedPool buffers    install: t.data = device view; stack objects
        (the model is not touched yet; a quantized          back into their slots; on failure roll back
        tensor whose own .to() refuses -> NotReleased) attach: the recorded _hf_hook/_old_forward/
  detach: accelerate hooks (remove_hook_from_module         forward objects, hf_device_map
        semantics, without detach_hook)               verify: same objects, same devices, same hooks
  install: t.data = host view (rolled back on failure)
  free: drop device storages, empty_cache, measure
```
Plain tensors move by storage: one byte copy per device storage, then `t.data` is pointed at a view with the
recorded offset, size and stride, so views, strides and storage sharing survive. Tensor subclasses (bnb
Params4bit/Int8Params, torchao) keep state outside `.data`, so they move through their own `.to()`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import accelerate.hooks
import torch
from torch import nn

from supervisor.errors import OffloadError  # noqa: F401 - re-exported; the hierarchy lives in errors.py
from supervisor.live.hostpool import PinnedPool  # noqa: F401 - re-exported: callers keep one across releases

# Device types whose memory release() frees. Tests on CPU-only machines swap in {"cpu"} so the whole
# path (hooks, pools, ties, rollback) runs for real; only the host<->device transfer itself needs a GPU.
ACCELERATOR_TYPES: frozenset[str] = frozenset({"cuda", "xpu", "mps"})

_HOST = torch.device("cpu")
_PLAIN_TYPES = (torch.Tensor, nn.Parameter)
# What dispatch_model/add_hook_to_module put in a module's __dict__; remove_hook_from_module pops these.
_ADDED_ATTRS = tuple(
    getattr(accelerate.hooks, "_accelerate_added_attributes", ("to", "cuda", "npu", "xpu", "mlu", "sdaa", "musa"))
)
_HOOK_ATTRS = ("_hf_hook", "_old_forward", "forward", *_ADDED_ATTRS)


@dataclass(frozen=True)
class NotReleased:
    """release() moved nothing; `reason` says why (the model is exactly as it was)."""

    reason: str


# --------------------------------------------------------------------------------------------------------
# What release() records


@dataclass(eq=False)
class _Slot:
    """One entry of a module's _parameters or _buffers table, as it was before release."""

    name: str
    module: nn.Module
    table: str
    key: str
    tensor: torch.Tensor
    device: torch.device


@dataclass(eq=False)
class _Grad:
    name: str
    param: torch.Tensor
    grad: torch.Tensor
    device: torch.device


@dataclass(eq=False)
class _Member:
    """A plain tensor living in a moved storage, with the geometry to rebuild it on either side."""

    tensor: torch.Tensor
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(eq=False)
class _StorageMove:
    name: str
    device: torch.device
    nbytes: int
    members: list[_Member]
    source: torch.Tensor | None = None  # uint8 alias of the device storage, kept until the swap is final
    host: torch.Tensor | None = None  # uint8 view in the pool


@dataclass(eq=False)
class _StackMove:
    """A tensor subclass (quantized weights) moved by its own .to(), installed in every slot that held it."""

    name: str
    device: torch.device
    slots: list[_Slot]
    original: torch.Tensor | None
    host: torch.Tensor | None = None


@dataclass(eq=False)
class _Snapshot:
    model: nn.Module
    slots: list[_Slot]
    grads: list[_Grad]
    hooks: list[tuple[nn.Module, dict[str, Any]]]
    map_owner: nn.Module | None
    device_map: dict | None
    storages: list[_StorageMove] = field(default_factory=list)
    stacks: list[_StackMove] = field(default_factory=list)
    pool: PinnedPool | None = None
    own_pool: bool = False
    share_host: bool = False  # host-resident parameters and buffers move into the pool too

    @property
    def devices(self) -> set[torch.device]:
        return {m.device for m in self.storages} | {m.device for m in self.stacks}


@dataclass(eq=False)
class Released:
    """A released model: pass it to restore(). `freed` is accelerator bytes freed per device."""

    freed: dict[str, int]
    moved_bytes: int
    seconds: float
    unmanaged: list[str]
    _state: _Snapshot = field(repr=False)
    restored: bool = False
    restore_seconds: float | None = None


# --------------------------------------------------------------------------------------------------------
# Public API


def release(model: nn.Module, *, buffers: PinnedPool | None = None, share_host: bool = False) -> Released | NotReleased:
    """Move `model`'s accelerator tensors to host memory; a Released handle, or NotReleased(reason).

    share_host=True (a live model exported from its pool): CPU-resident parameters and buffers move into the pool
    as well, by the same storage swap, so every tensor of the model is in shared memory a child can map; restore()
    copies them back into private memory. Cost: those bytes are copied once each way (peak: twice the host-resident
    part while a copy runs). Disk/meta-offloaded and quantized (subclass) tensors are refused in this mode."""
    start = time.perf_counter()
    if buffers is not None:
        buffers.check_usable()
    state = _snapshot(model)
    state.share_host = share_host
    refusal = (_share_refusal(state) if share_host else map_refusal(state.device_map)) or _choose_moves(state)
    if refusal:
        return NotReleased(refusal)
    before = _allocated(state.devices)
    state.pool, state.own_pool = (buffers, False) if buffers is not None else (PinnedPool(), True)
    refusal = _copy_down(state)
    if refusal:
        return NotReleased(refusal)
    _install_down(state)
    _empty_cache(state.devices)
    after = _allocated(state.devices)
    return Released(
        freed={dev: before[dev] - after[dev] for dev in before},
        moved_bytes=sum(m.nbytes for m in state.storages) + sum(_stack_bytes(m) for m in state.stacks),
        seconds=time.perf_counter() - start,
        unmanaged=_unmanaged_tensors(model),
        _state=state,
    )


def restore(handle: Released) -> Released:
    """Put a released model back exactly as it was; idempotent; raises OffloadError if it is not."""
    state = handle._state
    if not handle.restored:
        start = time.perf_counter()
        fresh = _copy_up(state)
        _install_up(state, fresh)
        _attach_hooks(state.hooks)
        _put_back_device_map(state)
        handle.restored = True
        handle.restore_seconds = time.perf_counter() - start
        _return_pool(state)
    _verify(state)
    return handle


def map_refusal(device_map: dict | None) -> str | None:
    """Why a model with this hf_device_map cannot be released, or None when it can (or has no map)."""
    if not device_map:
        return None
    offloaded = sorted(name or "<root>" for name, dev in device_map.items() if str(dev) in ("disk", "meta"))
    if offloaded:
        return (
            f"hf_device_map offloads {', '.join(offloaded[:5])} to disk/meta: accelerate pages those weights in "
            "per forward, so release is not supported; load the model without disk offload"
        )
    if not any(_is_accelerator_target(dev) for dev in device_map.values()):
        return f"hf_device_map places every module on the host: no accelerator memory to free ({_types()})"
    return None


# --------------------------------------------------------------------------------------------------------
# Planning (reads the model, changes nothing)


def _snapshot(model: nn.Module) -> _Snapshot:
    named = list(model.named_modules())
    slots = [
        _Slot(_qualify(mname, key), module, table, key, tensor, tensor.device)
        for mname, module in named
        for table in ("_parameters", "_buffers")
        for key, tensor in getattr(module, table).items()
        if tensor is not None
    ]
    owner = next((module for _, module in named if "hf_device_map" in module.__dict__), None)
    return _Snapshot(
        model=model,
        slots=slots,
        grads=_grads(slots),
        hooks=_record_hooks(module for _, module in named),
        map_owner=owner,
        device_map=dict(owner.hf_device_map) if owner is not None else None,
    )


def _grads(slots: list[_Slot]) -> list[_Grad]:
    seen: dict[int, _Grad] = {}
    for slot in slots:
        grad = slot.tensor.grad if slot.table == "_parameters" else None
        if grad is not None and id(slot.tensor) not in seen:
            seen[id(slot.tensor)] = _Grad(slot.name + ".grad", slot.tensor, grad, grad.device)
    return list(seen.values())


def _record_hooks(modules) -> list[tuple[nn.Module, dict[str, Any]]]:
    # Only modules accelerate touched: their own __dict__ entries, never a PEFT wrapper's proxied _hf_hook.
    records = []
    for module in modules:
        own = module.__dict__
        if "_hf_hook" in own or "_old_forward" in own or any(attr in own for attr in _ADDED_ATTRS):
            records.append((module, {attr: own[attr] for attr in _HOOK_ATTRS if attr in own}))
    return records


def _share_refusal(state: _Snapshot) -> str | None:
    """Why a model cannot be shared whole with a child (share_host), or None."""
    where = "a live model exported without a checkpoint must have every weight in memory"
    offloaded = sorted(name or "<root>" for name, dev in (state.device_map or {}).items() if str(dev) in ("disk", "meta"))
    if offloaded:
        return f"hf_device_map offloads {', '.join(offloaded[:5])} to disk/meta: {where}; load it without disk offload"
    for slot in state.slots:
        if slot.device.type == "meta" and offloaded_value(slot.module, slot.key) is None:
            return f"{slot.name} is on the meta device with no copy in host memory: {where}"
        if type(slot.tensor) not in _PLAIN_TYPES:
            return (f"{slot.name} is a {type(slot.tensor).__name__} (quantized), not a plain tensor: a quantized live "
                    "model cannot be exported; export the checkpoint it came from")
    return None


def offloaded_value(module: nn.Module, key: str) -> torch.Tensor | None:
    """The host tensor an accelerate hook keeps for a CPU-offloaded (meta) parameter or buffer of `module`, or
    None. Only an in-memory value counts: a weights_map that loads from disk returns a new tensor every time."""
    hooks = [module.__dict__.get("_hf_hook")]
    hooks += list(getattr(hooks[0], "hooks", ()))  # a SequentialHook holds several
    for hook in hooks:
        weights = getattr(hook, "weights_map", None) if getattr(hook, "offload", False) else None
        if weights is None or key not in weights:
            continue
        value = weights[key]
        if isinstance(value, torch.Tensor) and value is weights[key] and value.device.type == "cpu" \
                and type(value) in _PLAIN_TYPES:
            return value
    return None


def _moves(state: _Snapshot, tensor: torch.Tensor, slot: _Slot | None) -> bool:
    return _on_accelerator(tensor) or (state.share_host and slot is not None and tensor.device.type == "cpu")


def _choose_moves(state: _Snapshot) -> str | None:
    """Fill state.storages / state.stacks with the tensors to move; a refusal when that is impossible."""
    storages: dict[tuple, _StorageMove] = {}
    stacks: dict[int, _StackMove] = {}
    seen: set[int] = set()
    for name, tensor, slot in _tensors(state):
        if not _moves(state, tensor, slot):
            continue
        if type(tensor) not in _PLAIN_TYPES and slot is None:
            return f"{name} is a {type(tensor).__name__}, not a plain tensor: release cannot move it"
        if type(tensor) not in _PLAIN_TYPES:
            move = stacks.setdefault(id(tensor), _StackMove(name, tensor.device, [], tensor))
            move.slots.append(slot)
        elif id(tensor) not in seen:
            _add_member(storages, name, tensor)
        seen.add(id(tensor))
    if state.share_host:
        # CPU-spilled modules of a dispatched model: their weights live in the hooks' weights_map, not the module
        for slot in state.slots:
            value = offloaded_value(slot.module, slot.key) if slot.device.type == "meta" else None
            if value is not None and id(value) not in seen:
                _add_member(storages, slot.name, value)
                seen.add(id(value))
    state.storages = [m for m in storages.values() if m.nbytes > 0]
    state.stacks = list(stacks.values())
    if not (state.storages or state.stacks) and not state.share_host:
        return f"no parameter, buffer or gradient is on an accelerator ({_types()}): nothing to free"
    return None


def _tensors(state: _Snapshot):
    for slot in state.slots:
        yield slot.name, slot.tensor, slot
    for grad in state.grads:
        yield grad.name, grad.grad, None


def _add_member(storages: dict[tuple, _StorageMove], name: str, tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    key = (tensor.device, storage.data_ptr(), storage.nbytes())
    move = storages.setdefault(key, _StorageMove(name, tensor.device, storage.nbytes(), []))
    move.members.append(_Member(tensor, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())))


# --------------------------------------------------------------------------------------------------------
# Release


def _copy_down(state: _Snapshot) -> str | None:
    """Copy every accelerator tensor to the host; the model itself is not changed here."""
    try:
        hosts = state.pool.lease([move.nbytes for move in state.storages])
        refusal = _stack_down(state)
        if refusal is None:
            _storages_down(state, hosts)
    except Exception as exc:
        _settle(state.devices)  # async copies may still be writing into the buffers about to be freed
        _drop_copies(state)
        raise OffloadError(
            f"release failed while copying to the host ({exc!r}); the model was not changed"
        ) from exc
    if refusal is not None:
        _drop_copies(state)
    return refusal


def _stack_down(state: _Snapshot) -> str | None:
    # Subclasses go first: their .to() is where a quantization stack refuses, before any bytes are copied.
    for move in state.stacks:
        try:
            with torch.no_grad():
                move.host = move.original.to(_HOST)
        except Exception as exc:  # the stack's own refusal, whatever type it raises
            return f"the quantization stack refused to move {move.name} ({type(move.original).__name__}): {exc}"
    return None


def _storages_down(state: _Snapshot, hosts: list[torch.Tensor]) -> None:
    for device in state.devices:
        _synchronize(device)  # kernels on other streams may still be writing these weights
    with torch.no_grad():
        for move, host in zip(state.storages, hosts):
            move.source = _byte_view(move.members[0].tensor)
            move.host = host
            _copy_tensor(host, move.source)
    for device in state.devices:
        _synchronize(device)


def _drop_copies(state: _Snapshot) -> None:
    for move in state.storages:
        move.source = move.host = None
    for move in state.stacks:
        move.host = None
    _return_pool(state)


def _install_down(state: _Snapshot) -> None:
    """Detach hooks and point every tensor at its host copy; on any failure put all of it back."""
    _detach_hooks(state.hooks)
    try:
        with torch.no_grad():
            for move in state.storages:
                for member in move.members:
                    _set_data(member.tensor, _rebuild(move.host, member))
            _swap_stack_slots(state, lambda move: move.host)
    except Exception as exc:
        _rollback_down(state)
        raise OffloadError(f"release failed while swapping tensors ({exc!r}); the model was put back") from exc
    for move in state.storages:
        move.source = None  # the last reference to the device storage: this frees it
    for move in state.stacks:
        move.original = None
        for slot in move.slots:
            slot.tensor = move.host  # the snapshot must not keep the device object alive either


def _rollback_down(state: _Snapshot) -> None:
    with torch.no_grad():
        for move in state.storages:
            for member in move.members:
                _set_data(member.tensor, _rebuild(move.source, member))
        _swap_stack_slots(state, lambda move: move.original)
    _attach_hooks(state.hooks)
    _drop_copies(state)


def _swap_stack_slots(state: _Snapshot, pick) -> None:
    for move in state.stacks:
        for slot in move.slots:
            getattr(slot.module, slot.table)[slot.key] = pick(move)


# --------------------------------------------------------------------------------------------------------
# Restore


def _copy_up(state: _Snapshot) -> list[torch.Tensor | None]:
    """Fresh device copies of every moved storage and subclass; all or nothing."""
    fresh: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for move in state.storages:
                fresh.append(torch.empty(move.nbytes, dtype=torch.uint8, device=move.device))
                _copy_tensor(fresh[-1], move.host)
            for move in state.stacks:
                fresh.append(move.host.to(move.device))
        for device in state.devices:
            _synchronize(device)
    except Exception as exc:
        _settle(state.devices)
        fresh.clear()
        _empty_cache(state.devices)
        raise OffloadError(
            f"restore failed while copying back to the accelerator ({exc!r}); the model is still released "
            "on the host and unchanged: free accelerator memory and call restore() again"
        ) from exc
    return fresh


def _install_up(state: _Snapshot, fresh: list[torch.Tensor]) -> None:
    devices = fresh[: len(state.storages)]
    objects = dict(zip(map(id, state.stacks), fresh[len(state.storages) :]))
    try:
        with torch.no_grad():
            for move, device_bytes in zip(state.storages, devices):
                for member in move.members:
                    _set_data(member.tensor, _rebuild(device_bytes, member))
            _swap_stack_slots(state, lambda move: objects[id(move)])
    except Exception as exc:
        _rollback_up(state)
        raise OffloadError(
            f"restore failed while swapping tensors ({exc!r}); the model is still released: call restore() again"
        ) from exc
    for move in state.stacks:
        for slot in move.slots:
            slot.tensor = objects[id(move)]  # the subclass object is new; verify against it from now on


def _rollback_up(state: _Snapshot) -> None:
    with torch.no_grad():
        for move in state.storages:
            for member in move.members:
                _set_data(member.tensor, _rebuild(move.host, member))
        _swap_stack_slots(state, lambda move: move.host)


def _put_back_device_map(state: _Snapshot) -> None:
    if state.map_owner is not None and getattr(state.map_owner, "hf_device_map", None) != state.device_map:
        state.map_owner.hf_device_map = dict(state.device_map)


def _return_pool(state: _Snapshot) -> None:
    if state.pool is None:
        return
    state.pool.end_lease()
    if state.own_pool:
        state.pool.close()
    for move in state.storages:
        move.host = None
    state.pool = None


def _verify(state: _Snapshot) -> None:
    checks = [*map(_check_slot, state.slots), *map(_check_grad, state.grads)]
    checks += [_check_hooks(module, attrs) for module, attrs in state.hooks]
    problems = [problem for problem in checks if problem]
    if state.map_owner is not None and state.map_owner.hf_device_map != state.device_map:
        problems.append("hf_device_map differs from the recorded one")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise OffloadError(f"the restored model differs from the released one: {'; '.join(problems[:5])}{more}")


def _check_slot(slot: _Slot) -> str | None:
    now = getattr(slot.module, slot.table).get(slot.key)
    if slot.device.type == "meta" and now is not None and now.is_meta:
        return None  # accelerate installs a new meta placeholder after every forward of an offloaded module
    if now is not slot.tensor:
        return f"{slot.name} was replaced or removed while the model was released"
    if now.device != slot.device:
        return f"{slot.name} is on {now.device}, expected {slot.device}"
    return None


def _check_grad(grad: _Grad) -> str | None:
    if grad.param.grad is not grad.grad:
        return f"{grad.name} was replaced or removed while the model was released"
    if grad.grad.device != grad.device:
        return f"{grad.name} is on {grad.grad.device}, expected {grad.device}"
    return None


def _check_hooks(module: nn.Module, attrs: dict[str, Any]) -> str | None:
    own = module.__dict__
    if any(own.get(attr) is not value for attr, value in attrs.items()):
        return f"accelerate hook or forward of {type(module).__name__} differs from the recorded one"
    return None


# --------------------------------------------------------------------------------------------------------
# Hooks: accelerate's remove_hook_from_module, minus detach_hook


def _detach_hooks(records: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    # detach_hook is not called: for offloaded modules it would load the spilled weights into new Parameters,
    # and the same hook objects go back on at restore with their weights_map and tied map still valid.
    for module, attrs in records:
        own = module.__dict__
        if "_old_forward" in attrs:
            own["forward"] = attrs["_old_forward"]
        for attr in ("_hf_hook", "_old_forward", *_ADDED_ATTRS):
            own.pop(attr, None)


def _attach_hooks(records: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    # The recorded objects themselves, so forwards installed after dispatch (fused kernels, patches) survive.
    for module, attrs in records:
        own = module.__dict__
        own.pop("forward", None)
        own.update(attrs)


# --------------------------------------------------------------------------------------------------------
# Tensor plumbing (module-level so tests can inject failures)


def _copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Every byte copy of a release or restore goes through here."""
    dst.copy_(src, non_blocking=True)


def _set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Swap storage under an existing tensor object, so Parameter identity, ties and references survive."""
    tensor.data = value


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _rebuild(data: torch.Tensor, member: _Member) -> torch.Tensor:
    """A tensor over `data` (a uint8 view) with the member's dtype, offset, size and stride."""
    dtype = member.tensor.dtype
    start = data.storage_offset() // dtype.itemsize + member.offset  # data starts on a hostpool.ALIGN boundary
    view = torch.empty(0, dtype=dtype, device=data.device)
    return view.set_(data.untyped_storage(), start, member.size, member.stride)


def _stack_bytes(move: _StackMove) -> int:
    tensor = move.host if move.host is not None else move.original
    return tensor.untyped_storage().nbytes() if tensor is not None else 0


def _unmanaged_tensors(model: nn.Module) -> list[str]:
    """Accelerator tensors held as plain module attributes: release cannot know they are safe to move."""
    return [
        _qualify(mname, attr)
        for mname, module in model.named_modules()
        for attr, value in vars(module).items()
        if isinstance(value, torch.Tensor) and _on_accelerator(value)
    ]


# --------------------------------------------------------------------------------------------------------
# Devices


def _on_accelerator(tensor: torch.Tensor) -> bool:
    return tensor.device.type in ACCELERATOR_TYPES


def _is_accelerator_target(target: Any) -> bool:
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        return True  # accelerate's bare ordinals name accelerator devices
    try:
        return torch.device(target).type in ACCELERATOR_TYPES
    except (RuntimeError, TypeError):
        return False


def _types() -> str:
    return "/".join(sorted(ACCELERATOR_TYPES))


def _synchronize(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(backend, "synchronize"):
        backend.synchronize()


def _settle(devices: set[torch.device]) -> None:
    """Wait for queued copies on a failure path, without masking the failure being reported."""
    for device in devices:
        try:
            _synchronize(device)
        except Exception:  # the device itself may be what failed; the original error is the one to raise
            pass


def _empty_cache(devices: set[torch.device]) -> None:
    for device_type in {device.type for device in devices} - {"cpu"}:
        backend = getattr(torch, device_type, None)
        if hasattr(backend, "empty_cache"):
            backend.empty_cache()


def _allocated(devices: set[torch.device]) -> dict[str, int]:
    # Only CUDA reports per-device allocated bytes the same way; other accelerators report nothing here.
    return {str(d): torch.cuda.memory_allocated(d) for d in sorted(devices, key=str) if d.type == "cuda"}


def _qualify(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
