"""The torchao job table (shared/torchao_schemes.py), the ignore-list translation and the sorted shard header,
checked against the libraries: torchao's configs and enums, transformers' and compressed-tensors' matchers."""
import json
import struct

import pytest
import torch
from torch import nn

from shared import torchao_schemes as ts
from shared.job import DEFAULT_IGNORE, JobSyntaxError, parse_job


def _job(scheme, table=None, fmt="torchao"):
    export = {"scheme": scheme, "output": "out", "format": fmt}
    if table is not None:
        export["torchao"] = table
    return parse_job({"source": {"path": "src"}, "export": export})


def test_table_matches_torchao_configs_and_enums():
    """Every scheme is a torchao config, every keyword one of its fields, every enum spelling one of its members."""
    import dataclasses
    import importlib

    import torchao.quantization as tq

    for name, spec in ts.SCHEMES.items():
        assert spec.config == name + "Config"
        fields = {f.name for f in dataclasses.fields(getattr(tq, spec.config))}
        assert set(spec.keywords) <= fields, (name, set(spec.keywords) - fields)
        for kw in spec.keywords.values():
            if kw.kind == "enum":
                module, cls = kw.enum.split(":")
                members = {m.name.lower() for m in getattr(importlib.import_module(module), cls)}
                assert set(kw.choices) <= members, (name, kw.choices, members)
            if kw.kind == "float8_dtype":
                assert all(isinstance(getattr(torch, c), torch.dtype) for c in kw.choices)


def test_build_spells_objects_and_dtypes():
    """TOML strings become torchao objects and torch dtypes; Int4 packs tile_packed_to_4d unless told otherwise."""
    from torchao.quantization import PerRow, PerTensor

    c = ts.build("Float8WeightOnly", {"granularity": "PerTensor", "weight_dtype": "float8_e5m2"})
    assert c.granularity == PerTensor() and c.weight_dtype == torch.float8_e5m2
    c = ts.build("Float8DynamicActivationFloat8Weight", {"granularity": ["PerRow", "PerRow"],
                                                         "kernel_preference": "torch"})
    assert c.granularity == [PerRow(), PerRow()] and c.kernel_preference.value == "torch"
    c = ts.build("Int8DynamicActivationInt8Weight", {"act_mapping_type": "asymmetric"})
    assert c.act_mapping_type.name == "ASYMMETRIC"
    c = ts.build("Int4WeightOnly", {"group_size": 64})
    assert c.group_size == 64 and c.int4_packing_format.value == "tile_packed_to_4d"
    c = ts.build("Int4WeightOnly", {"int4_packing_format": "plain"})
    assert c.int4_packing_format.value == "plain"


@pytest.mark.parametrize("scheme,table,words", [
    ("Int8WeightOnlyy", None, "did you mean 'Int8WeightOnly'"),
    ("Int8WeightOnlyConfig", None, "did you mean 'Int8WeightOnly'"),
    ("FP8_DYNAMIC", None, "unknown torchao scheme"),
    ("Int8WeightOnly", {"granularty": "PerRow"}, "did you mean 'granularity'"),
    ("Int8WeightOnly", {"weight_dtype": "float8_e4m3fn"}, "unknown keyword 'weight_dtype' for Int8WeightOnly"),
    ("Float8WeightOnly", {"granularity": "PerRows"}, "did you mean 'PerRow'"),
    ("Float8WeightOnly", {"granularity": ["PerRow", "PerRow"]}, "not valid"),
    ("Float8WeightOnly", {"weight_dtype": "float8"}, "use one of 'float8_e4m3fn', 'float8_e5m2'"),
    ("Int4WeightOnly", {"group_size": 100}, "use one of 32, 64, 128, 256"),
    ("Int4WeightOnly", {"group_size": "128"}, "must be an integer"),
    ("Int4WeightOnly", {"int4_packing_format": "preshuffled"}, "use one of 'tile_packed_to_4d', 'plain'"),
    ("Int4WeightOnly", {"int4_packing_format": "plain", "int4_choose_qparams_algorithm": "hqq"},
     "needs int4_packing_format = 'tile_packed_to_4d'"),
    ("Int8DynamicActivationInt8Weight", {"reduce_range": 1}, "true or false"),
])
def test_bad_scheme_or_keyword_is_one_line_with_a_hint(scheme, table, words):
    """Unknown scheme, unknown keyword, a value torchao cannot take: one line, naming the closest spelling."""
    with pytest.raises(JobSyntaxError) as err:
        _job(scheme, table)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_format_typo_and_table_for_the_other_format_are_refused():
    """format = "torchoa" gets a suggestion; an [export.torchao] table on a compressed-tensors job is refused."""
    with pytest.raises(JobSyntaxError, match="did you mean 'torchao'"):
        _job("Int8WeightOnly", fmt="torchoa")
    with pytest.raises(JobSyntaxError, match=r"\[export.torchao\] applies only"):
        _job("FP8_DYNAMIC", {"granularity": "PerRow"}, fmt="compressed-tensors")


class _Tree(nn.Module):
    """Linear modules named like a dense model next to an MoE router, plus names that are prefixes of others."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        for _ in range(11):
            layer = nn.Module()
            layer.mlp = nn.Module()
            layer.mlp.gate = nn.Linear(4, 4)  # a router, as a Linear (Mixtral / Qwen2-MoE style)
            layer.mlp.gate_proj = nn.Linear(4, 4)
            layer.mlp.shared_expert_gate = nn.Linear(4, 1)
            layer.self_attn = nn.Module()
            layer.self_attn.q_proj = nn.Linear(4, 4)
            self.model.layers.append(layer)
        self.lm_head = nn.Linear(4, 4)


@pytest.mark.parametrize("ignore", [list(DEFAULT_IGNORE), ["lm_head", "re:.*self_attn\\.q_proj$"], ["Linear"], [],
                                    ["model.layers.1.mlp.gate", "re:model\\.layers\\.1\\."]])
def test_ignore_translation_means_the_same_to_transformers_and_vllm(ignore):
    """Our ignore list (llm-compressor semantics, compressed-tensors as the oracle) and the modules_to_not_convert
    we write select the same Linear modules in transformers' matcher; plain entries also in vLLM's rule."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    from child.backends.torchao_backend import _ignored, modules_to_not_convert

    linears = {n: m for n, m in _Tree().named_modules() if isinstance(m, nn.Linear)}
    ignored = [n for n, m in linears.items() if _ignored(n, m, ignore)]
    assert ignored == [n for n, m in linears.items() if _ct_ignored(n, m, ignore)]
    quantized = [n for n in linears if n not in ignored]
    keys = modules_to_not_convert(ignored, quantized)
    for name in linears:
        assert should_convert_module(f"{name}.weight", keys) == (name not in ignored), (name, keys)
    plain = [k for k in keys if "(" not in k]

    def vllm_skips(prefix):  # vLLM's should_skip rule: the key is the module name or one of its dotted segments
        return any(prefix == s or f".{s}." in f".{prefix}." for s in plain)

    assert [n for n in linears if vllm_skips(n)] == [n for n in ignored if n in plain]
    if ignore == list(DEFAULT_IGNORE):
        assert "model.layers.0.mlp.gate" in ignored and "model.layers.0.mlp.shared_expert_gate" in ignored
        # "model.layers.1.mlp.gate" is a regex prefix of "model.layers.1.mlp.gate_proj.weight": written exactly
        assert any(k.startswith("model\\.layers\\.1\\.mlp\\.gate(") for k in keys)


def _ct_ignored(name, module, ignore):
    from compressed_tensors.utils.match import is_match

    return any(is_match(name, module, target) for target in ignore)


def test_shard_header_is_sorted_and_deterministic(tmp_path):
    """Two writes of the same tensors and many-key metadata are byte-identical, with __metadata__ sorted;
    safetensors 0.8 alone writes the keys in a different order each time (a HashMap)."""
    from safetensors import safe_open

    from child.writer import stage_shard

    tensors = {"b.weight": torch.arange(6, dtype=torch.bfloat16), "a._weight_qdata": torch.ones(3, dtype=torch.int8)}
    meta = {f"layer.{i}.weight": json.dumps({"_type": "Tensor", "i": i}) for i in range(40)}
    meta["tensor_names"] = json.dumps(sorted(meta))
    shas = set()
    for run in range(3):
        out = tmp_path / f"o{run}"
        out.mkdir()
        stage_shard(tensors, str(out / "s.safetensors"), metadata=meta)
        shas.add((out / "s.safetensors").read_bytes())
    assert len(shas) == 1
    path = tmp_path / "o0" / "s.safetensors"
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert list(header["__metadata__"]) == sorted(meta)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == meta and torch.equal(f.get_tensor("b.weight"), tensors["b.weight"])


def test_fingerprint_holds_torchao_version_and_table_only_for_torchao_jobs():
    """A torchao job's fingerprint covers torchao's version and [export.torchao]; a compressed-tensors job's parts
    are what they were (so existing outputs still resume)."""
    from importlib.metadata import version

    from supervisor.output.journal import fingerprint

    stats = [("model.safetensors", 10, 1)]
    fp_a, parts = fingerprint(_job("Float8WeightOnly", {"granularity": "PerTensor"}), stats)
    assert parts["versions"]["torchao"] == version("torchao") and parts["torchao"] == {"granularity": "PerTensor"}
    fp_b, _ = fingerprint(_job("Float8WeightOnly", {"granularity": "PerRow"}), stats)
    assert fp_a != fp_b
    _, ct = fingerprint(_job("FP8_DYNAMIC", fmt="compressed-tensors"), stats)
    assert "torchao" not in ct and "torchao" not in ct["versions"]
    # the shard-metadata layout (every entry in every shard, for vLLM): an older torchao output is not resumed
    assert parts["torchao_shard_metadata"] == "every entry" and "torchao_shard_metadata" not in ct


def test_fingerprint_holds_the_device_kind_of_gpu_jobs():
    """A data-free export quantized on cuda is not resumed on the CPU (the arithmetic differs: Triton's float32
    division against torch's bf16 one), nor the other way round; CPU fingerprints are what they were; every GPU
    of a kind is the same kind."""
    from supervisor.output.journal import fingerprint

    stats = [("model.safetensors", 10, 1)]
    for job in (_job("FP8_DYNAMIC", fmt="compressed-tensors"), _job("Float8WeightOnly", {"granularity": "PerRow"})):
        cpu, parts = fingerprint(job, stats)
        assert "device" not in parts and fingerprint(job, stats, device="cpu")[0] == cpu
        gpu0, parts = fingerprint(job, stats, device="cuda:0")
        assert parts["device"] == "cuda" and gpu0 != cpu
        assert fingerprint(job, stats, device="cuda:1")[0] == gpu0
    # calibrated jobs hold the device in their calibration part; it is not added twice
    _, parts = fingerprint(_job("FP8_DYNAMIC", fmt="compressed-tensors"), stats, {"device": "cuda"}, device="cuda:0")
    assert "device" not in parts and parts["calibration"] == {"device": "cuda"}
