"""format = "torchao" end to end on CPU: the CLI (and the Python API) equal transformers' whole-model torchao
path, a killed run resumes byte-identically, and bad tables, GPU-only schemes and MoE are refused (exit 2)."""
import json
import os
import sys

import pytest
import torch

from tests import ref_torchao as ref
from tests.scenarios import cli

# The reference configs are written out here, not built from our TOML table, so a spelling bug cannot hide in both.
REFERENCE_CONFIGS = {
    "Int8WeightOnly": lambda: _tq().Int8WeightOnlyConfig(),
    "Int8DynamicActivationInt8Weight": lambda: _tq().Int8DynamicActivationInt8WeightConfig(),
    "Float8WeightOnly": lambda: _tq().Float8WeightOnlyConfig(),
}
# What our default ignore list (lm_head, MoE routers) selects on a dense model, written by hand.
DENSE_NOT_CONVERTED = ["lm_head"]


def _tq():
    import torchao.quantization

    return torchao.quantization


def write_job(path, source, output, scheme, table=None, fmt="torchao", device="cpu", **resources) -> str:
    lines = ["[source]", f'path = "{source}"', "[export]", f'format = "{fmt}"', f'scheme = "{scheme}"',
             f'output = "{output}"']
    if table:
        lines.append("[export.torchao]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    lines += ["[resources]", f'device = "{device}"'] + [f"{k} = {json.dumps(v)}" for k, v in resources.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory):
    """exported(kind, scheme, via) -> an uninterrupted export's folder, run once per module."""
    done = {}

    def get(kind, scheme, via="cli"):
        if (kind, scheme) not in done:
            tmp = tmp_path_factory.mktemp(f"ao-{kind}-{scheme}")
            job = write_job(tmp / "job.toml", tiny_models(kind), tmp / "out", scheme)
            if via == "cli":
                proc = cli.run("run", job, "--json")
                assert "Failed to load" not in proc.stderr  # torchao's import noise stays off the CLI's stderr
            else:
                from supervisor import export, load_job

                seen = []
                finished = export(load_job(job), on_event=seen.append)
                assert finished.parts == 3 and [type(e).__name__ for e in seen][-1] == "Finished"
            done[(kind, scheme)] = str(tmp / "out")
        return done[(kind, scheme)]

    return get


CASES = [(kind, scheme) for kind in ("llama", "qwen3") for scheme in REFERENCE_CONFIGS]


@pytest.mark.parametrize("kind,scheme", CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_export_equals_whole_model_reference(kind, scheme, tiny_models, exported, tmp_path):
    """Tensors (every torchao component, bit for bit), logits, quantization_config and the merged shard metadata
    equal transformers' from_pretrained(quantization_config=TorchAoConfig(cfg)) + save_pretrained."""
    # One case through the CLI; the others through the Python API (same run loop, no second supervisor start-up).
    via = "cli" if (kind, scheme) == ("llama", "Int8WeightOnly") else "api"
    out = exported(kind, scheme, via)
    expected = ref.torchao_reference(tiny_models(kind), REFERENCE_CONFIGS[scheme](), str(tmp_path / "ref"),
                                     modules_to_not_convert=DENSE_NOT_CONVERTED)
    assert ref.quantization_config(out) == ref.quantization_config(expected)
    mine, theirs = ref.merged_metadata(out), ref.merged_metadata(expected)
    names = sorted(json.loads(theirs.pop("tensor_names")))
    assert sorted(json.loads(mine.pop("tensor_names"))) == names
    assert mine == theirs
    # and each shard alone holds all of it, as transformers' save_pretrained writes every shard (vLLM unflattens
    # file by file with that file's metadata only)
    shards = ref.shard_metadata(out)
    assert len(shards) == 3
    for shard, meta in shards.items():
        assert sorted(json.loads(meta.pop("tensor_names"))) == names and meta == theirs, shard
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    state_a, logits_a, info = ref.load_and_run(out, ids)
    state_b, logits_b, _ = ref.load_and_run(expected, ids)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    ref.assert_same_state(state_a, state_b)
    assert torch.equal(logits_a, logits_b)
    q = state_a["model.layers.0.self_attn.q_proj.weight"]
    assert type(q).__name__ in ("Int8Tensor", "Float8Tensor") and type(state_a["lm_head.weight"]) is torch.Tensor


def test_killed_child_then_rerun_is_byte_identical(tiny_models, exported, tmp_path):
    """A child SIGKILLed right after layer 0's shard is staged (synced, neither placed nor journaled) fails the run;
    `run` again redoes it and the folder is byte-identical to an uninterrupted export through the Python API (other
    processes: so the shard headers' metadata order is fixed, not left to safetensors); verify passes (and
    `verify --vllm` on the unfinished folder says it is unfinished, without starting vLLM)."""
    scheme = "Int8DynamicActivationInt8Weight"
    uninterrupted = exported("llama", scheme)
    out = tmp_path / "out"
    job = write_job(tmp_path / "job.toml", tiny_models("llama"), out, scheme, max_attempts=1, workers=1)  # in order
    fault = {"SUPERVISOR_TEST_FAULT": json.dumps({"point": "staged", "action": "sigkill", "index": 0,
                                                  "once": str(tmp_path / "fired")})}
    first = cli.run("run", job, "--json", env=fault, check=False)
    assert first.returncode == 1 and "layer 0" in first.stderr, first.stderr
    # staged on disk, but never placed: only the supervisor gives a shard its name, once it has the attempt's reply
    assert not os.path.exists(out / "model-layer-00000.safetensors")
    assert [f for f in os.listdir(out / ".export" / "tmp") if f.startswith("model-layer-00000.safetensors.")]
    assert json.loads(cli.run("status", out, "--json").stdout)["left"] == [0, 1, "non-layer"]
    # verify --vllm on an unfinished export: exit 1 saying so, vLLM never started (any Python passes the path check)
    unfinished = cli.run("verify", out, "--vllm", sys.executable, check=False)
    assert unfinished.returncode == 1 and "BAD  vLLM: the export is not finished" in unfinished.stdout, unfinished
    second = cli.events(cli.run("run", job, "--json"))
    assert second[0]["type"] == "Started" and second[-1]["type"] == "Finished"
    assert cli.output_bytes(out) == cli.output_bytes(uninterrupted)
    assert cli.run("verify", out).returncode == 0


BAD = [
    ("scheme typo", "Int8WeightOnlyy", None, "did you mean 'Int8WeightOnly'"),
    ("keyword typo", "Float8WeightOnly", {"granularty": "PerRow"}, "did you mean 'granularity'"),
    ("value typo", "Float8WeightOnly", {"granularity": "PerRows"}, "did you mean 'PerRow'"),
    ("keyword of another scheme", "Int8WeightOnly", {"group_size": 128}, "unknown keyword 'group_size'"),
    ("GPU-only on cpu: float8 dynamic", "Float8DynamicActivationFloat8Weight", {"granularity": "PerRow"},
     "needs a CUDA GPU with compute capability 8.9"),
    ("GPU-only on cpu: int4", "Int4WeightOnly", {"group_size": 128}, "needs a CUDA GPU"),
]


@pytest.mark.parametrize("scheme,table,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_table_exits_2_with_one_line_and_writes_nothing(scheme, table, words, tiny_models, tmp_path):
    """Through the CLI: exit 2, one stderr line with the reason (and the closest name), no output folder."""
    job = write_job(tmp_path / "job.toml", tiny_models("llama"), tmp_path / "out", scheme, table)
    cli.assert_refused(job, words, tmp_path)


def test_moe_is_refused_naming_the_experts_module(tiny_models, tmp_path):
    """A Qwen3-MoE source: exit 2 naming model.layers.0.mlp.experts (fused experts stay dense in transformers'
    torchao path), nothing written; the child refuses the same layer by its general rule (names it holds)."""
    src = tiny_models("qwen3moe")
    job = write_job(tmp_path / "job.toml", src, tmp_path / "out", "Int8WeightOnly")
    proc = cli.run("run", job, check=False)
    assert proc.returncode == 2 and "model.layers.0.mlp.experts" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "out")

    from child.sources.checkpoint import Checkpoint
    from child.backends.torchao_backend import TorchaoBackend
    from shared.job import DEFAULT_IGNORE

    source = Checkpoint(src)
    backend = TorchaoBackend(src, "Int8WeightOnly", {}, list(DEFAULT_IGNORE),
                             source_meta=source.meta(source.all_names()))
    with pytest.raises(NotImplementedError, match=r"model\.layers\.1\.mlp\.experts \(Qwen3MoeExperts\)"):
        backend.quantize_layer(1, source.read(source.layer_names(backend.layer_prefix, 1)))


def test_a_shard_whose_entries_differ_from_the_prediction_is_refused(tiny_models):
    """Every shard's metadata is predicted at start-up from the source's shapes and dtypes; a part whose torchao
    entries differ (here a layer handed over in float16 while the checkpoint holds bfloat16) is refused, naming the
    tensor, instead of being written with metadata that does not describe it."""
    from child.sources.checkpoint import Checkpoint
    from child.backends.torchao_backend import TorchaoBackend
    from shared.job import DEFAULT_IGNORE

    source = Checkpoint(tiny_models("llama"))
    backend = TorchaoBackend(tiny_models("llama"), "Int8WeightOnly", {}, list(DEFAULT_IGNORE),
                             source_meta=source.meta(source.all_names()))
    tensors = source.read(source.layer_names(backend.layer_prefix, 0))
    flat, meta = backend.serialize(backend.quantize_layer(0, tensors))
    assert json.loads(meta["model.layers.1.mlp.down_proj.weight"])["_type"] == "Int8Tensor"  # another layer's entry
    halved = {k: v.half() for k, v in tensors.items()}
    with pytest.raises(RuntimeError, match=r"^model\.layers\.0\.mlp\.down_proj\.weight: torchao's metadata entry"):
        backend.serialize(backend.quantize_layer(0, halved))


@pytest.mark.parametrize("scheme", list(REFERENCE_CONFIGS))
def test_prediction_from_zeros_on_the_device_equals_the_one_on_meta(scheme, tiny_models, monkeypatch):
    """Where torchao refuses the meta device (its CUDA-only paths may), the entries are predicted from a weight of
    zeros on the job's device: the same metadata as from meta (checked on the CPU schemes)."""
    from child.backends import torchao_backend
    from child.sources.checkpoint import Checkpoint
    from shared.job import DEFAULT_IGNORE

    source = Checkpoint(tiny_models("llama"))

    def make():
        return torchao_backend.TorchaoBackend(tiny_models("llama"), scheme, {}, list(DEFAULT_IGNORE),
                                              source_meta=source.meta(source.all_names()))

    on_meta = make()._metadata
    quantize, devices = torchao_backend.TorchaoBackend._quantize_weight, []

    def refuse_meta(self, name, weight, device=None):
        devices.append(weight.device.type)
        if weight.device.type == "meta":
            raise AssertionError("Torch not compiled with CUDA enabled")  # what torchao 0.18 says for Int4 on meta
        return quantize(self, name, weight, device)

    monkeypatch.setattr(torchao_backend.TorchaoBackend, "_quantize_weight", refuse_meta)
    assert make()._metadata == on_meta and "cpu" in devices


def test_torchao_refusal_of_a_combination_is_a_job_error(tiny_models):
    """A table torchao itself refuses (mixed float8 granularities) is a one-line JobError from prepare's check,
    before any worker; the device string alone decides GPU-only (CUDA is never touched here)."""
    from shared.job import parse_job
    from supervisor.errors import JobError
    from supervisor.checks.source import inspect
    from supervisor.checks.torchao_job import check

    job = parse_job({"source": {"path": tiny_models("llama")},
                     "export": {"format": "torchao", "scheme": "Float8DynamicActivationFloat8Weight", "output": "o",
                                "torchao": {"granularity": ["PerRow", "PerTensor"]}}})
    with pytest.raises(JobError, match=r"^\[export.torchao\] torchao refuses .*Unsupported granularity"):
        check(job, inspect(job.source.path), "cuda:0")
