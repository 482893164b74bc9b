"""GPU visibility, device specs and the free-memory check (supervisor/workers/devices.py), on any machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.workers import devices
from supervisor.workers.devices import DeviceError, check_free_memory, child_env, parse_visible_devices, resolve_device

ROOT = Path(__file__).resolve().parents[1]
UUID = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
MIG = "MIG-c7384736-a75d-5afc-978f-d89d2f2b4d2b"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("-1", []),
        ("0", ["0"]),
        ("3,5", ["3", "5"]),
        (" 3 , 05 ", ["3", "5"]),
        ("0,2,-1,3", ["0", "2"]),
        ("1,,2", ["1"]),
        ("nope,1", []),
        (f"{UUID},1", [UUID, "1"]),
        (MIG, [MIG]),
        ("MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0", ["MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0"]),
    ],
)
def test_parse_visible_devices(value, expected):
    """CUDA_VISIBLE_DEVICES parses like the CUDA runtime: unset is None, parsing stops at the first bad entry."""
    assert parse_visible_devices(value) == expected



@pytest.fixture(autouse=True)
def _no_nvml(monkeypatch):
    """These tests set the GPU count through torch; keep a real NVML (on a GPU machine) out of them."""
    monkeypatch.setattr(devices, "_nvml_count", lambda: -1)

def test_child_env_picks_the_parents_entry_for_the_device():
    """A child for cuda:1 under CUDA_VISIBLE_DEVICES=3,5 sees only physical device 5."""
    base = {"CUDA_VISIBLE_DEVICES": "3,5", "PATH": "/bin"}
    env = child_env("cuda:1", base)
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    assert env["PATH"] == "/bin"
    assert base["CUDA_VISIBLE_DEVICES"] == "3,5"


def test_child_env_keeps_uuid_and_mig_entries():
    """UUID and MIG entries are handed to the child verbatim."""
    base = {"CUDA_VISIBLE_DEVICES": f"{UUID},{MIG}"}
    assert child_env("cuda:0", base)["CUDA_VISIBLE_DEVICES"] == UUID
    assert child_env("cuda:1", base)["CUDA_VISIBLE_DEVICES"] == MIG


def test_child_env_unset_means_ordinal():
    """With CUDA_VISIBLE_DEVICES unset, the child for cuda:N gets ordinal N and CUDA_DEVICE_ORDER is kept."""
    env = child_env("cuda:2", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_child_env_bare_cuda_is_device_zero():
    """"cuda" means the parent's cuda:0."""
    assert child_env("cuda", {"CUDA_VISIBLE_DEVICES": "7,1"})["CUDA_VISIBLE_DEVICES"] == "7"


def test_child_env_cpu_hides_all_gpus():
    """A CPU worker gets an empty CUDA_VISIBLE_DEVICES so it cannot create a context on any GPU."""
    assert child_env("cpu", {"CUDA_VISIBLE_DEVICES": "0,1"})["CUDA_VISIBLE_DEVICES"] == ""


def test_child_env_device_not_visible_is_an_error():
    """Asking for a device past the parent's visible list raises DeviceError naming the valid range."""
    with pytest.raises(DeviceError, match=r"cuda:0\.\.cuda:1"):
        child_env("cuda:2", {"CUDA_VISIBLE_DEVICES": "3,5"})
    with pytest.raises(DeviceError, match="0 device"):
        child_env("cuda:0", {"CUDA_VISIBLE_DEVICES": "-1"})


def test_child_env_defaults_to_os_environ(monkeypatch):
    """Without base_env the child inherits os.environ, which itself is not modified."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.setenv("LAYERWISE_TEST_MARK", "yes")
    env = child_env("cuda:1")
    assert env["CUDA_VISIBLE_DEVICES"] == "6"
    assert env["LAYERWISE_TEST_MARK"] == "yes"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"


def test_resolve_cpu_and_hidden_auto_do_not_import_torch():
    """"cpu", and "auto" with GPUs hidden, resolve without importing torch (the CLI starts fast)."""
    code = (
        "import sys; from supervisor.workers import devices\n"
        "assert devices.resolve_device('cpu') == 'cpu'\n"
        "assert devices.resolve_device('auto') == 'cpu'\n"
        "devices.child_env('cuda:1', {'CUDA_VISIBLE_DEVICES': '3,5'})\n"
        "devices.check_free_memory('cpu', 1 << 60)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("count", "expected"), [(0, "cpu"), (2, "cuda:0")])
def test_resolve_auto(monkeypatch, count, expected):
    """"auto" is cuda:0 when a CUDA device is visible, else cpu."""
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert resolve_device("auto") == expected


@pytest.mark.parametrize(("spec", "expected"), [("cuda", "cuda:0"), ("cuda:1", "cuda:1"), (" CUDA:1 ", "cuda:1")])
def test_resolve_cuda_specs(monkeypatch, spec, expected):
    """cuda and cuda:N resolve to cuda:N when that device exists."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(spec) == expected


def test_resolve_missing_cuda_device_is_an_error(monkeypatch):
    """cuda:N past the device count, or any cuda without devices, raises DeviceError with the fix."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceError, match=r"only 2 CUDA device\(s\).*cuda:0\.\.cuda:1"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(DeviceError, match="--device cpu"):
        resolve_device("cuda")


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda:-1", "mps0", ""])
def test_resolve_unknown_spec_is_an_error(spec):
    """An unknown spec raises DeviceError listing the accepted forms."""
    with pytest.raises(DeviceError, match="auto, cpu, cuda or cuda:N"):
        resolve_device(spec)


def test_check_free_memory_cpu_is_a_no_op():
    """The CPU has no device budget to check."""
    assert check_free_memory("cpu", 1 << 62) is None


def test_check_free_memory_raises_when_short(monkeypatch):
    """Less free memory than needed raises DeviceError with both figures and the fix."""
    import torch

    asked = []

    def mem_get_info(index):
        asked.append(index)
        return 1 << 30, 80 << 30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    with pytest.raises(DeviceError, match=r"cuda:1 has 1\.0 GiB free of 80\.0 GiB, this step needs 2\.0 GiB.*release"):
        check_free_memory("cuda:1", 2 << 30)
    assert check_free_memory("cuda:1", 1 << 30) is None
    assert asked == [1, 1]


def test_device_error_is_a_runtime_error():
    """DeviceError subclasses RuntimeError so generic handlers catch it."""
    assert issubclass(devices.DeviceError, RuntimeError)


@pytest.mark.parametrize(("spec", "expected"), [("cuda", ["cuda:0", "cuda:1", "cuda:2"]),
                                                ("auto", ["cuda:0", "cuda:1", "cuda:2"]),
                                                ("cuda:1", ["cuda:1"]), ("cpu", ["cpu"])])
def test_resolve_devices_uses_every_visible_gpu_for_cuda_and_auto(monkeypatch, spec, expected):
    """"cuda" and "auto" spread the workers over every visible GPU; "cuda:N" and "cpu" name one device."""
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert devices.resolve_devices(spec) == expected


def test_worker_slots_one_per_gpu_at_least_three_or_as_asked_round_robin(monkeypatch):
    """Default on GPUs: one slot per GPU and three in all for layers up to 1 GiB (the others overlap one's writes),
    two for bigger layers (they take turns on the GPU), fewer extra ones when the host's free memory cannot hold
    them; an explicit count is spread round-robin over the devices."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 64 << 30})())
    assert devices.worker_slots(["cuda:0", "cuda:1"], 0, 1 << 30) == ["cuda:0", "cuda:1", "cuda:0"]
    assert devices.worker_slots(["cuda:0"], 0, 1 << 30) == ["cuda:0"] * 3
    assert devices.worker_slots(["cuda:0"], 0, 8 << 30) == ["cuda:0", "cuda:0"]
    assert devices.worker_slots(["cuda:0", "cuda:1"], 0, 8 << 30) == ["cuda:0", "cuda:1"]
    assert devices.worker_slots([f"cuda:{i}" for i in range(4)], 0, 1 << 30) == [f"cuda:{i}" for i in range(4)]
    assert devices.worker_slots(["cuda:0", "cuda:1"], 3, 1 << 30) == ["cuda:0", "cuda:1", "cuda:0"]
    assert devices.worker_slots(["cpu"], 2, 1 << 30) == ["cpu", "cpu"]
    # 9 GiB free holds two workers of 1 GiB + 3 layers of 1 GiB: not a third; never fewer than one per GPU
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 9 << 30})())
    assert devices.worker_slots(["cuda:0"], 0, 1 << 30) == ["cuda:0"] * 2
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 1 << 30})())
    assert devices.worker_slots(["cuda:0", "cuda:1"], 0, 1 << 30) == ["cuda:0", "cuda:1"]
    assert devices.worker_slots(["cuda:0"], 0, 1 << 30) == ["cuda:0"]


def test_workers_sharing_a_gpu_take_turns_only_when_a_layer_is_over_1_gib():
    """Two workers on one GPU both hold layers of up to 1 GiB at once; bigger layers take turns on the device (the
    GPU then holds about one layer); a GPU with one worker, and the CPU, never take turns."""
    assert not devices.device_stage_shared("cuda:0", 2, 1 << 30)
    assert devices.device_stage_shared("cuda:0", 2, (1 << 30) + 1)
    assert not devices.device_stage_shared("cuda:1", 1, 8 << 30)
    assert not devices.device_stage_shared("cpu", 2, 8 << 30)


def test_cpu_worker_slots_follow_cores_and_memory(monkeypatch):
    """On CPU the default is one worker per 4 cores and at least two, fewer when memory cannot hold them, never
    none."""
    import psutil

    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 64 << 30})())
    assert devices.worker_slots(["cpu"], 0, 1 << 30) == ["cpu"] * 4  # 16 cores / 4; 64 GiB / 4 GiB = 16
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 9 << 30})())
    assert devices.worker_slots(["cpu"], 0, 1 << 30) == ["cpu"] * 2  # 9 GiB holds two workers of 4 GiB
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 13 << 30})())
    assert devices.worker_slots(["cpu"], 0, 1 << 30) == ["cpu"] * 3  # 13 GiB holds three of the four
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert devices.worker_slots(["cpu"], 0, 1 << 30) == ["cpu"] * 2  # two cores: still two workers, a thread each
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 5 << 30})())
    assert devices.worker_slots(["cpu"], 0, 1 << 30) == ["cpu"]  # room for one worker of 4 GiB only
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 1 << 30})())
    assert devices.worker_slots(["cpu"], 0, 1 << 30) == ["cpu"]  # never none


def test_the_plan_is_judged_beside_cpu_parts_only_when_memory_holds_one_worker_more(monkeypatch):
    """A worker of 1 GiB-layers wants 4 GiB: beside two CPU workers the planner needs 12 GiB free in all; on GPUs it
    always runs beside."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 12 << 30})())
    assert devices.room_for_planner(["cpu", "cpu"], 1 << 30)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": (12 << 30) - 1})())
    assert not devices.room_for_planner(["cpu", "cpu"], 1 << 30)
    assert devices.room_for_planner(["cpu"], 1 << 30)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 1 << 30})())
    assert devices.room_for_planner(["cuda:0", "cuda:0", "cuda:0"], 1 << 30)



def test_a_calibrated_export_on_a_gpu_judges_its_plan_first_and_on_the_cpu_beside_its_first_layers(monkeypatch):
    """On one H200 a planner beside the first calibrated layer slowed it by more than judging first costs (on the
    same GPU or on the host: docs/benchmarks.md, twenty-ninth session); on the CPU beside is faster. A group, a
    cluster or spawned workers judge first whatever the setting; the test setting pins either where both are
    possible; a data-free export on GPUs is judged beside."""
    from types import SimpleNamespace

    import psutil

    from supervisor.run.sequence import PLAN_BESIDE_ENV, judged_beside

    monkeypatch.delenv(PLAN_BESIDE_ENV, raising=False)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("vm", (), {"available": 64 << 30})())
    calibrated = SimpleNamespace(calibration=object(), world=1, cluster=None)
    data_free = SimpleNamespace(calibration=None, world=1, cluster=None)
    assert not judged_beside(calibrated, ["cuda:0"], True, 1 << 20)
    assert judged_beside(calibrated, ["cpu"], True, 1 << 20)
    assert judged_beside(data_free, ["cuda:0", "cuda:0", "cuda:0"], True, 1 << 20)
    assert not judged_beside(data_free, ["cpu"], False, 1 << 20)  # spawned workers
    assert not judged_beside(SimpleNamespace(calibration=object(), world=2, cluster=None), ["cpu"], True, 1 << 20)
    monkeypatch.setenv(PLAN_BESIDE_ENV, "1")
    assert judged_beside(calibrated, ["cuda:0"], True, 1 << 20)
    assert not judged_beside(SimpleNamespace(calibration=object(), world=2, cluster=None), ["cuda:0"], True, 1 << 20)
    monkeypatch.setenv(PLAN_BESIDE_ENV, "0")
    assert not judged_beside(calibrated, ["cpu"], True, 1 << 20)

def test_warm_parent_answers_gpu_capability_from_nvml_only_while_importing(monkeypatch):
    """child.zygote: while the backend's libraries import, torch.cuda.get_device_capability answers from NVML (no
    CUDA context; torchao asks at import), falls back to torch's own function where NVML cannot answer, and is
    torch's own function again afterwards."""
    import torch

    from child import zygote

    original = torch.cuda.get_device_capability
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    asked = []

    def nvml(_torch, device=None):
        asked.append(device)
        return None if device == 1 else (9, 0)

    monkeypatch.setattr(zygote, "_nvml_capability", nvml)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: ("torch", device))
    torch_own = torch.cuda.get_device_capability
    with zygote._capability_from_nvml(torch):
        assert torch.cuda.get_device_capability() == (9, 0)
        assert torch.cuda.get_device_capability(1) == ("torch", 1)  # NVML could not answer: torch's own
    assert asked == [None, 1]
    assert torch.cuda.get_device_capability is torch_own
    monkeypatch.undo()
    assert torch.cuda.get_device_capability is original
