"""A calibrated job's group size and arithmetic (supervisor/checks/calibration.py): W on CPUs and GPUs, what `supervisor plan`
says on a host whose GPUs are faked as tests/test_devices.py fakes them, and the refusal of workers that would
compute otherwise than a folder's layers were."""
from __future__ import annotations

import pytest

from shared.job import parse_job
from supervisor.checks import calibration
from supervisor.workers import devices
from supervisor.output import journal
from supervisor.checks.calibration import check_arithmetic, group_size
from supervisor.errors import ArithmeticMismatch
from tests.ref_calib import token_rows, write_jsonl

GPUS = [f"cuda:{i}" for i in range(4)]


def _job(tmp_path, model="unused", method="gptq", samples=8, **resources):
    return parse_job({"source": {"path": str(model)},
                      "export": {"scheme": "W4A16", "method": method, "output": str(tmp_path / "out")},
                      "resources": {"device": "auto", **resources},
                      "calibration": {"dataset": str(tmp_path / "ids.jsonl"), "samples": samples, "seq_len": 16}})


def test_several_gpus_calibrate_on_one_rank_unless_workers_asks(tmp_path):
    """With workers unset, a calibrated job on several GPUs runs W = 1 and says why (the NCCL group is not measured)
    and how to ask for more; workers = N asks for N ranks, one per GPU, capped by the GPUs; one GPU is W = 1."""
    w, note = group_size(_job(tmp_path), GPUS)
    assert w == 1 and "not yet measured" in note and "[resources] workers = N" in note and "4 GPUs" in note, note
    assert group_size(_job(tmp_path, workers=2), GPUS) == (2, "")
    assert group_size(_job(tmp_path, workers=8), GPUS) == (4, "")
    assert group_size(_job(tmp_path), ["cuda:0"]) == (1, "")


def test_cpu_ranks_follow_workers(tmp_path):
    """On the CPU W is resources.workers (0 and 1: one worker), capped at one rank per sample; AWQ stays on one
    rank and says why."""
    assert group_size(_job(tmp_path), ["cpu"]) == (1, "")
    assert group_size(_job(tmp_path, workers=3), ["cpu"]) == (3, "")
    w, note = group_size(_job(tmp_path, workers=3, samples=2), ["cpu"])
    assert w == 2 and "one per calibration sample" in note
    w, note = group_size(_job(tmp_path, workers=3, method="awq"), ["cpu"])
    assert w == 1 and "AWQ" in note


def test_plan_on_a_host_of_four_gpus_says_one_rank_and_why(tiny_models, tmp_path, monkeypatch, capsys):
    """`supervisor plan` for a calibrated job with device "auto" on a host whose four GPUs are faked: its group line
    says one rank calibrates, that an NCCL group is not yet measured, and which setting uses more GPUs."""
    from supervisor import cli

    write_jsonl(tmp_path / "ids.jsonl", token_rows(8, seed=1))
    model = tiny_models("llama", layers=2, hidden=128)
    path = tmp_path / "job.toml"
    path.write_text(f'[source]\npath = "{model}"\n[export]\nscheme = "W4A16"\nmethod = "gptq"\n'
                    f'output = "{tmp_path / "out"}"\n[resources]\ndevice = "auto"\n'
                    f'[calibration]\ndataset = "{tmp_path / "ids.jsonl"}"\nsamples = 8\nseq_len = 16\n')
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_cuda_count", lambda: 4)
    assert cli.main(["plan", str(path)]) == 0
    group = [line for line in capsys.readouterr().out.splitlines() if line.startswith("group")]
    assert len(group) == 1 and group[0].startswith("group    1 rank calibrate each layer;"), group
    assert "4 GPUs" in group[0] and "NCCL" in group[0] and "not yet measured" in group[0] \
        and "[resources] workers = N" in group[0], group


def _recorded(threads, models):
    return journal.Arithmetic(threads=threads, devices=models)


def test_workers_that_compute_otherwise_are_refused_with_the_fix():
    """A resume is refused, naming what the layers were computed with and the fix, when a CPU rank's thread count or
    any rank's device model differs, while the journal holds a layer; unknown values (None) and a GPU rank's thread
    count are not compared; nothing is refused before a layer exists or without a record."""
    cpu = "cpu: AMD EPYC"
    rec = _recorded([1, 1], [cpu, cpu])
    check_arithmetic("out", rec, True, [1, 1], [cpu, cpu])
    check_arithmetic("out", rec, True, [None, None], [cpu, None])
    check_arithmetic("out", rec, False, [2, 2], [cpu, cpu])
    check_arithmetic("out", None, True, [2, 2], [cpu, cpu])
    with pytest.raises(ArithmeticMismatch, match=r"computed with 1 torch thread on every rank; this run's workers "
                                                 r"would compute with 2 torch threads on every rank .*"
                                                 r"resume with \[resources\] torch_threads = 1 as before, or start "
                                                 r"fresh in a new folder"):
        check_arithmetic("out", rec, True, [2, 2], [cpu, cpu])
    gpu = _recorded([16], ["cuda: NVIDIA H200"])
    check_arithmetic("out", gpu, True, [32], ["cuda: NVIDIA H200"])
    with pytest.raises(ArithmeticMismatch, match=r"with cuda: NVIDIA H200; .* with cuda: NVIDIA H100 .* on cuda: "
                                                 r"NVIDIA H200 as before"):
        check_arithmetic("out", gpu, True, [16], ["cuda: NVIDIA H100"])


def test_planned_arithmetic_is_what_the_supervisor_gives_the_workers(tmp_path, monkeypatch):
    """Ahead of the workers, CPU ranks of a group are known to run with their share of the cores (or the count
    asked) on this CPU; one worker with torch's default, and a GPU's model, are left to the workers to tell."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    threads, models = calibration.planned_arithmetic(_job(tmp_path, workers=2), ["cpu"], 2)
    assert threads == [4, 4] and all(m.startswith("cpu: ") for m in models)
    assert calibration.planned_arithmetic(_job(tmp_path, torch_threads=3), ["cpu"], 2)[0] == [3, 3]
    assert calibration.planned_arithmetic(_job(tmp_path), ["cpu"], 1)[0] == [None]
    assert calibration.planned_arithmetic(_job(tmp_path, workers=2), GPUS, 2) == ([None, None], [None, None])
