"""child/backends/calibrate.py, child/backends/boundary.py, child/backends/samples.py: the calibrated engine layer by layer equals oneshot for
the schemes the CLI suite does not run; boundary files round-trip and refuse corruption; oneshot's sample order."""
import json
import os

import pytest
import torch

from tests.models import assert_same_tensors, load_tensors, loaded_logits
from tests.ref_calib import make_tiny_dense, make_tiny_gemma, oneshot_calibrated, threads, token_rows, write_jsonl

N, SEQ = 20, 40  # more than 16 samples: torch's unstable argsort permutes equal lengths


def _export_in_process(source, scheme, method, dataset, out, ram_gb=0.0, read_ahead=None, released=lambda: None):
    """Drive the Calibrator as the worker does (begin, quantize, shard, commit) without a child process.
    `read_ahead` (a list): each layer's tensors come as a GPU worker's read-ahead hands them over (child/exporter.py):
    copies of what the source read, those in `host` (on the CPU the copies stand for the device's), appended to it.
    `released`: the Calibrator's sources_released."""
    from child.backends.backend import ReadAhead
    from child.backends.calibrate import Calibrator
    from child.sources.checkpoint import Checkpoint
    from child.writer import stage_shard
    from shared import layout
    from shared.job import parse_job
    from shared.messages import NON_LAYER
    from supervisor.output import finalize

    job = parse_job({"source": {"path": source}, "export": {"scheme": scheme, "output": str(out), "method": method},
                     "calibration": {"dataset": dataset, "samples": N, "seq_len": SEQ},
                     "resources": {"activation_ram_gb": ram_gb}})
    tmp = os.path.join(out, ".export", "tmp")
    os.makedirs(tmp)
    src = Checkpoint(source)
    cal = Calibrator(job, source, "cpu", output=str(out), source=src, sources_released=released)
    boundary = None
    for i in [*range(cal.num_layers), NON_LAYER]:
        cal.begin(i, boundary)
        names = src.non_layer_names(cal.layer_prefix) if i == NON_LAYER else src.layer_names(cal.layer_prefix, i)
        tensors = src.read(names)
        if read_ahead is not None and i != NON_LAYER:
            tensors = ReadAhead({k: v.clone() for k, v in tensors.items()}, host=tensors)
            read_ahead.append(tensors.host)
        shard = cal.quantize_non_layer(tensors) if i == NON_LAYER else cal.quantize_layer(i, tensors)
        if read_ahead is not None and i != NON_LAYER:
            assert tensors.host == {}, "the layer still holds the source's host tensors"
        stage_shard(shard, os.path.join(out, layout.shard_name(i)))
        boundary = cal.commit(i) or boundary
    os.makedirs(layout.state_path(str(out), layout.STAGING))
    staged = cal.write_config(os.path.join(source, "config.json"), layout.state_path(str(out), layout.STAGING))
    # a folder transformers can load: config.json, the index, the tokenizer
    finalize.complete(str(out), staged, source, finalize.shard_files(cal.num_layers))
    return out


def _awq_equals_oneshot(source, dataset, tmp_path, fix_masks: bool = False) -> None:
    """AWQ W4A16 of `source`, ours layer by layer and oneshot's (one thread each): the same export."""
    rows = [json.loads(line)["input_ids"] for line in open(dataset)]
    with threads(1):
        ref = oneshot_calibrated(source, "W4A16", "awq", rows, SEQ, str(tmp_path / "ref"), fix_masks=fix_masks)
        ours = _export_in_process(source, "W4A16", "awq", dataset, tmp_path / "ours")
    _assert_same_export(ref, ours)


def _unscaled_passes(monkeypatch) -> list[tuple[int, int]]:
    """Each AWQ layer's (unscaled passes served from its forward, unscaled passes the library ran), appended as the
    layer's session ends (child/backends/awq_capture.py), once its activation hooks were found replaced, one per
    mapping, by those that keep the sums on the device, and each mapping searched by child/backends/awq_search.py's
    grid search (its waits at the grid's end, each candidate's qparams made without a wait)."""
    import contextlib

    from child.backends import awq_search
    from child.backends.awq_capture import AWQCapture

    from compressed_tensors.quantization.utils import helpers as qparams_helpers

    passes, searched, filled = [], [], []
    installed = AWQCapture.installed
    best_scale, update = awq_search.best_scale, awq_search.update_qparams
    monkeypatch.setattr(awq_search, "best_scale", lambda *a, **k: (searched.append(1), best_scale(*a, **k))[1])
    # each candidate's qparams made with their numbers filled on the device (no wait for the stream)
    monkeypatch.setattr(awq_search, "update_qparams", lambda *a, **k: (
        filled.append(qparams_helpers.torch is awq_search._NO_HOST_COPIES), update(*a, **k))[1])

    @contextlib.contextmanager
    def recorded(self):
        searched.clear()
        with installed(self):
            yield self
        assert self.hooks_replaced > 0 and self.hooks_replaced == self.served + self.ran, self.hooks_replaced
        assert len(searched) == self.hooks_replaced, searched
        assert filled and all(filled), filled
        filled.clear()
        passes.append((self.served, self.ran))

    monkeypatch.setattr(AWQCapture, "installed", recorded)
    return passes


@pytest.fixture(scope="module")
def ids_dataset(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("calib") / "ids.jsonl", token_rows(N))


def _logits(folder):
    return loaded_logits(folder, torch.randint(4, 256, (2, 12), generator=torch.Generator().manual_seed(0)))


def _assert_same_export(ref, ours) -> None:
    """oneshot's folder `ref` and ours: every tensor and config.json equal, and transformers loads both to the same
    logits."""
    assert_same_tensors(load_tensors(ref), load_tensors(str(ours)))
    with open(os.path.join(ref, "config.json")) as a, open(os.path.join(ours, "config.json")) as b:
        assert json.load(a) == json.load(b)
    assert torch.equal(_logits(str(ours)), _logits(ref))


@pytest.mark.parametrize("kind,scheme,method", [
    ("qwen3", "W4A16_ASYM", "gptq"),
    ("llama", "W8A16", "gptq"),
    ("qwen3", "W8A8", "gptq"),
    ("llama", "NVFP4", "rtn"),
    ("qwen3", "FP8", "rtn"),
    ("gemma", "W4A16", "awq"),  # offset norms: converted for calibration, smoothed, converted back (final norm too)
    # GPTQ's Hessians shared where the inputs are (child/backends/hessians.py), as the architecture shares them: DeepSeek-V3's
    # MLA (q_a_proj and kv_a_proj_with_mqa, not q_b/kv_b), each routed expert's gate/up (its own tokens), the shared
    # expert's gate/up, the dense first layer's gate/up
    ("deepseekv3", "W4A16", "gptq"),
])
def test_calibrator_equals_oneshot(kind, scheme, method, tiny_models, moe_models, ids_dataset, tmp_path,
                                   tmp_path_factory, monkeypatch):
    """Layer by layer (one thread on both sides), every tensor and config.json equal oneshot's sequential pipeline,
    and transformers loads the result and gives oneshot's logits; GPTQ computed each shared input's Hessian once."""
    from child.backends.hessians import SharedHessians

    served = []
    finish = SharedHessians.finish
    monkeypatch.setattr(SharedHessians, "finish", lambda self: (served.append(self.served), finish(self))[1])
    unscaled = _unscaled_passes(monkeypatch)
    if kind == "gemma":
        source = make_tiny_gemma(str(tmp_path_factory.mktemp("gemma")))
    else:
        source = moe_models(kind) if kind == "deepseekv3" else tiny_models(kind)
    rows = [json.loads(line)["input_ids"] for line in open(ids_dataset)]
    with threads(1):
        ref = oneshot_calibrated(source, scheme, method, rows, SEQ, str(tmp_path / "ref"))
        # activation_ram_gb tiny: the activations go through boundary files on disk, sample by sample
        ours = _export_in_process(source, scheme, method, ids_dataset, tmp_path / "ours",
                                  ram_gb=1e-6 if scheme == "W8A16" else 0.0)
    _assert_same_export(ref, ours)
    if method == "gptq":
        assert len(served) == 2 and all(served), served  # each layer served some module from another's input
    if method == "awq":  # every mapping's unscaled outputs came from the layer's forward: attention, MLP, down_proj
        assert unscaled == [(3, 0)] * 2, unscaled


def test_awq_on_a_moe_equals_oneshot_with_its_sums_on_the_device(moe_models, ids_dataset, tmp_path, monkeypatch):
    """AWQ on a Qwen3-MoE, whose cached arguments child/backends/calibrate.py offloads to the host: its activation
    sums added on the device (child/backends/awq_capture.py), no outputs kept (each unscaled pass the library's):
    every tensor, config.json and the logits equal oneshot's (its causal mask fixed, docs/fidelity.md)."""
    unscaled = _unscaled_passes(monkeypatch)
    _awq_equals_oneshot(moe_models("qwen3moe"), ids_dataset, tmp_path, fix_masks=True)
    assert len(unscaled) == 2 and all(served == 0 and ran > 0 for served, ran in unscaled), unscaled


@pytest.mark.parametrize("kind,switch", [("llama", ""), ("qwen3moe", ""), ("llama", "nosamplewise")])
def test_awq_lets_each_samples_attention_probabilities_go_before_the_next_pass(kind, switch, tiny_models, moe_models,
                                                                               ids_dataset, tmp_path, monkeypatch):
    """Eager attention returns its probabilities beside its output (256 MiB a sample of an 8B layer at 2048 tokens);
    llm-compressor's `_run_samples` holds every sample's until its last pass is over (32 GiB there). Ours lets each go
    before the next sample's pass, in the candidates' passes (their loss added sample by sample: Llama) and in the
    library's unscaled pass where it runs (MoE: child/backends/awq_search.py): no eager attention call starts with an
    earlier call's probabilities alive, where the library's hold up to all of a pass's samples (as the bench's switch
    SUPERVISOR_TEST_KERNELS=nosamplewise shows)."""
    import importlib
    import weakref

    module = importlib.import_module({"llama": "transformers.models.llama.modeling_llama",
                                      "qwen3moe": "transformers.models.qwen3_moe.modeling_qwen3_moe"}[kind])
    alive, refs = [], []
    eager = module.eager_attention_forward

    def counted(*a, **k):
        alive.append(sum(r() is not None for r in refs))
        out, weights = eager(*a, **k)
        refs.append(weakref.ref(weights))
        return out, weights

    monkeypatch.setattr(module, "eager_attention_forward", counted)
    monkeypatch.setenv("SUPERVISOR_TEST_KERNELS", switch)
    unscaled = _unscaled_passes(monkeypatch)
    source = tiny_models("llama") if kind == "llama" else moe_models("qwen3moe")
    with threads(1):
        _export_in_process(source, "W4A16", "awq", ids_dataset, tmp_path / "ours")
    # both layers: the forward and the propagation (N calls each), the candidates' passes (20 x N), and for the MoE
    # the library's unscaled pass (N)
    assert len(alive) >= 2 * 22 * N, len(alive)
    assert max(alive) == (N - 1 if switch else 0), max(alive)
    assert all((ran > 0) == (kind != "llama") for _, ran in unscaled), unscaled


@pytest.mark.parametrize("replays", ["right", "wrong"])
def test_awq_uses_a_graphed_pass_where_it_is_checked_and_searches_again_eagerly_where_not(
        replays, tiny_models, ids_dataset, tmp_path, monkeypatch):
    """child/backends/awq_search.py with a graphed pass (child/backends/graphed_pass.py; on the CPU a stand-in that
    gives the eager outputs, or wrong ones, and says so through `same()`): its outputs go into each candidate's loss,
    it is closed after the grid, and where its check fails the grid runs again eagerly and the graphs go off for the
    process. The export equals oneshot's either way. (Real graphs on a GPU: tests/gpu/test_graphed_pass_gpu.py.)"""
    from child.backends import graphed_pass

    made, closed = [], []

    class StandIn:
        def __init__(self, module, batches):
            self.module, self.batches, self.yielded = module, batches, 0

        def outputs(self):
            for batch in self.batches:
                out = self.module(**batch)
                out = out[0] if isinstance(out, tuple) else out
                self.yielded += 1
                yield out if replays == "right" else torch.zeros_like(out)

        def same(self):
            return torch.tensor(replays == "right")

        def close(self):
            closed.append(self)

    def build(module, batches, device):
        made.append(StandIn(module, batches))
        return made[-1], None

    monkeypatch.setitem(graphed_pass._state, "off", None)
    monkeypatch.setattr(graphed_pass, "applies", lambda module, device: graphed_pass._state["off"])  # any device
    monkeypatch.setattr(graphed_pass, "build", build)
    _awq_equals_oneshot(tiny_models("llama"), ids_dataset, tmp_path)
    # the first layer's mappings (and, while the replays are right, every layer's) went through a stand-in
    assert made and closed == made and all(m.yielded == 20 * N for m in made), [m.yielded for m in made]
    if replays == "right":
        # 2 layers x 3 mappings (v_proj -> o_proj is left out: grouped-query attention)
        assert len(made) == 2 * 3 and graphed_pass.available() is None
    else:
        assert len(made) == 1 and "differed from its eager pass" in graphed_pass.available()


@pytest.mark.parametrize("why", ["another llm-compressor", "switched off"])
def test_awq_runs_the_librarys_own_search_and_hooks_under_another_llm_compressor_or_switched_off(
        why, tiny_models, ids_dataset, tmp_path, monkeypatch):
    """child/backends/awq_search.py and awq_capture.py's activation hook copy llm-compressor 0.14.0.1's code: under
    another version (stood in for by its version string) neither stands in, the library's own search and hooks run,
    and the export is still oneshot's. The benches' switch (SUPERVISOR_TEST_KERNELS=nocapture,nosearch) leaves both
    out the same way."""
    import llmcompressor

    from child.backends import awq_search
    from child.backends.awq_capture import AWQCapture

    searched, captures = [], []
    best_scale, installed = awq_search.best_scale, AWQCapture.installed
    monkeypatch.setattr(awq_search, "best_scale", lambda *a, **k: (searched.append(1), best_scale(*a, **k))[1])
    monkeypatch.setattr(AWQCapture, "installed", lambda self: (captures.append(self), installed(self))[1])
    if why == "switched off":
        monkeypatch.setenv("SUPERVISOR_TEST_KERNELS", "nocapture,nosearch")
    else:
        monkeypatch.setattr(llmcompressor, "__version__", "0.15.0")
    _awq_equals_oneshot(tiny_models("llama"), ids_dataset, tmp_path)
    assert not searched
    if why == "switched off":
        assert not captures
    else:
        assert len(captures) == 2 and all(c.hooks_replaced == 0 for c in captures)


@pytest.mark.parametrize("case", ["parent changed", "output changed"])
def test_awq_runs_the_unscaled_pass_itself_where_the_forwards_outputs_are_not_its(case, tiny_models, ids_dataset,
                                                                                   tmp_path, monkeypatch):
    """AWQ's unscaled outputs come from the layer's forward only where they are what its pass would compute: with
    the up_proj -> down_proj mapping searched before the MLP's (which then smooths the MLP's own up_proj and
    down_proj before the MLP's search), or with an output changed in place after the forward, the library runs that
    pass itself, and every tensor still equals oneshot's (whose mappings are the same)."""
    from llmcompressor.modifiers.transform.awq import mappings as awq_mappings

    from child.backends.awq_capture import AWQCapture

    unscaled = _unscaled_passes(monkeypatch)
    if case == "parent changed":
        m = awq_mappings.default_mappings
        monkeypatch.setitem(awq_mappings.AWQ_MAPPING_REGISTRY, "LlamaForCausalLM", [m[0], m[1], m[3], m[2]])
    else:  # the attention's outputs: each bumped in place (its values unchanged) once kept
        keep = AWQCapture._keep

        def bumped(self, module, args, output):
            keep(self, module, args, output)
            if module.__class__.__name__.endswith("Attention"):
                output[0].add_(0)

        monkeypatch.setattr(AWQCapture, "_keep", bumped)
    _awq_equals_oneshot(tiny_models("llama"), ids_dataset, tmp_path)
    # served: the attention and down_proj, whose modules nothing had changed; ran: the MLP's (parent changed) or the
    # attention's (output changed)
    assert unscaled == [(2, 1)] * 2, unscaled


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_layer_read_ahead_to_the_device_is_oneshots_and_its_errors_are_against_the_source(
        method, tiny_models, ids_dataset, tmp_path, monkeypatch):
    """A GPU worker's read-ahead hands the layer over already copied to the device, and the layer's parameters are
    those copies, which calibration changes in place: the export is still oneshot's, and each module's error is
    measured against the source as read (`ReadAhead.host`: no copy of it beside the layer on the device), equal to
    transformers' loading of the export, never 0; then let go, and the worker told (sources_released: it copies
    the next layer onto the device meanwhile)."""
    from child.backends import quant_error
    from tests.models import assert_errors_equal_loading

    source = tiny_models("llama")
    rows = [json.loads(line)["input_ids"] for line in open(ids_dataset)]
    errors, measured, hosts, order = {}, [], [], []
    take, measure = quant_error.take, quant_error.measure
    monkeypatch.setattr(quant_error, "enabled", True)
    quant_error.take()  # what earlier tests in this process left
    monkeypatch.setattr(quant_error, "take", lambda: (errors.update(quant_error._tally), take())[1])
    monkeypatch.setattr(quant_error, "measure",
                        lambda modules, src: (measured.append(dict(src)), order.append("measured"),
                                              measure(modules, src)))
    with threads(1):
        ref = oneshot_calibrated(source, "W4A16", method, rows, SEQ, str(tmp_path / "ref"))
        ours = _export_in_process(source, "W4A16", method, ids_dataset, tmp_path / "ours", read_ahead=hosts,
                                  released=lambda: order.append("released"))
        errors.update(quant_error.take())
    _assert_same_export(ref, ours)
    assert len(measured) == len(hosts) == 2
    assert order == ["measured", "released"] * 2
    for src, host in zip(measured, hosts):  # the very tensors the source read
        assert {t.data_ptr() for t in src.values()} == {t.data_ptr() for t in host.values()}
    assert len(errors) == 7 * 2 and min(errors.values()) > 0, errors  # every Linear of both layers
    assert_errors_equal_loading(errors, source, str(ours))


@pytest.mark.parametrize("kind,scheme,method", [
    ("phi3", "W4A16", "gptq"),
    ("qwen2", "W4A16", "awq"),
    ("mistral", "W4A16", "awq"),
    ("gemma2", "NVFP4", "rtn"),
    ("cohere", "FP8", "rtn"),
    ("starcoder2", "W8A8", "gptq"),
    ("gptneox", "W4A16", "gptq"),
    ("olmo2", "W4A16_ASYM", "gptq"),
])
def test_other_dense_architectures_equal_oneshot(kind, scheme, method, ids_dataset, tmp_path, monkeypatch):
    """Architectures whose layers differ from Llama's (tests/ref_calib.py DENSE: fused projections, biases,
    LayerNorm, parallel blocks, offset norms, q/k norms, layers under `gpt_neox.layers`): every tensor, config.json
    and the logits equal oneshot's (its sequential pipeline given the causal mask, docs/fidelity.md)."""
    unscaled = _unscaled_passes(monkeypatch)
    source = make_tiny_dense(kind, str(tmp_path / "src"))
    rows = [json.loads(line)["input_ids"] for line in open(ids_dataset)]
    with threads(1):
        ref = oneshot_calibrated(source, scheme, method, rows, SEQ, str(tmp_path / "ref"), fix_masks=True)
        ours = _export_in_process(source, scheme, method, ids_dataset, tmp_path / "ours")
    _assert_same_export(ref, ours)
    if method == "awq":  # each mapping's unscaled outputs came from the layer's forward, none from another pass
        assert len(unscaled) == 2 and all(served >= 3 and ran == 0 for served, ran in unscaled), unscaled


def test_gptq_with_every_hessian_as_stripes_equals_oneshot(tiny_models, ids_dataset, tmp_path, monkeypatch):
    """With every Hessian term eligible for the verified stripes (MIN_WIDTH 0: the tiny model's widths too), each
    layout checked once and its stripes added into each Hessian's upper triangle where found equal (H mirrored once at the
    end), every tensor still equals oneshot's bit for bit."""
    from child.backends import hessians

    monkeypatch.setattr(hessians, "MIN_WIDTH", 0)
    monkeypatch.setattr(hessians, "_verdicts", {})
    source = tiny_models("llama")
    rows = [json.loads(line)["input_ids"] for line in open(ids_dataset)]
    with threads(1):
        ref = oneshot_calibrated(source, "W4A16", "gptq", rows, SEQ, str(tmp_path / "ref"))
        ours = _export_in_process(source, "W4A16", "gptq", ids_dataset, tmp_path / "ours")
    assert_same_tensors(load_tensors(ref), load_tensors(str(ours)))
    widths = {layout[0][0] for layout, (count, into) in hessians._verdicts.items() if count and into}
    assert len(widths) >= 2, hessians._verdicts  # the attention's and the MLP's inputs (and down_proj's) as stripes,
    # added into each Hessian's upper triangle


def test_sample_order_is_oneshots_dataloader_order(tmp_path, tiny_models):
    """calibration_ids yields the rows in exactly the order (and truncation) of oneshot's calibration dataloader."""
    from datasets import Dataset
    from llmcompressor.args import DatasetArguments
    from llmcompressor.datasets import get_calibration_dataloader
    from transformers import AutoTokenizer

    from child.backends.samples import calibration_ids

    rows = token_rows(40, low=10, high=30)  # many equal lengths, longer than seq_len 20 too
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    ours = calibration_ids(path, 40, 20, tiny_models("llama"))
    args = DatasetArguments(dataset=Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}),
                            num_calibration_samples=40, max_seq_length=20, shuffle_calibration_samples=False)
    theirs = [b["input_ids"] for b in get_calibration_dataloader(args, AutoTokenizer.from_pretrained(tiny_models("llama")))]
    assert [t.tolist() for t in ours] == [t.tolist() for t in theirs]
    # the rule is not a stable longest-first sort: equal lengths come out permuted (so only the library's code fits)
    stable = sorted(rows, key=len, reverse=True)
    assert [t.tolist() for t in ours] != [[r[:20]] for r in stable]


@pytest.mark.parametrize("world", [2, 3])
def test_a_ranks_samples_are_distributed_oneshots_partition(world, tmp_path, tiny_models, monkeypatch):
    """A group's rank r of W calibrates the contiguous slice rows[floor(N r / W):floor(N (r+1) / W)], in the order
    (and truncation) llm-compressor's distributed oneshot gives rank r: its `_make_sampler` under W ranks, whose
    indices count within the slice. (llm-compressor 0.14.0.1's dataloader then applies those indices to the whole
    dataset, so its rank r > 0 reads the first rows instead of its slice: asserted below, docs/fidelity.md.)"""
    import math

    from datasets import Dataset
    from llmcompressor.args import DatasetArguments
    from llmcompressor.datasets import get_calibration_dataloader
    from llmcompressor.datasets import utils as ds_utils
    from transformers import AutoTokenizer

    from child.backends.samples import calibration_ids

    n, seq = 41, 20  # 41: the slices are uneven; many equal lengths inside each, some longer than seq
    rows = token_rows(n, low=10, high=30)
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    tok = AutoTokenizer.from_pretrained(tiny_models("llama"))
    full = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    args = DatasetArguments(dataset=full, num_calibration_samples=n, max_seq_length=seq,
                            shuffle_calibration_samples=False)
    monkeypatch.setattr(ds_utils, "_is_dist_and_same_ds", lambda dataset: True)  # as under torchrun, W ranks
    monkeypatch.setattr(ds_utils.dist, "get_world_size", lambda *a: world)
    seen = []
    for rank in range(world):
        monkeypatch.setattr(ds_utils.dist, "get_rank", lambda *a, r=rank: r)
        ours = [t.tolist() for t in calibration_ids(path, n, seq, tiny_models("llama"), rank=rank, world=world)]
        start, end = math.floor(n * rank / world), math.floor(n * (rank + 1) / world)
        theirs = [[rows[start + i][:seq]] for i in ds_utils._make_sampler(args, full)]
        assert ours == theirs, rank
        seen += ours
        library = [b["input_ids"].tolist() for b in get_calibration_dataloader(args, tok)]
        if rank > 0:  # the library's own dataloader: the slice's order applied to the whole dataset's first rows
            assert library == [[rows[i][:seq]] for i in ds_utils._make_sampler(args, full)] != ours
    assert sorted(seen) == sorted([[r[:seq]] for r in rows])  # every sample on exactly one rank


def test_boundary_round_trip_in_ram_and_on_disk(tmp_path):
    """A boundary written sample by sample reads back equal, from RAM and from disk; a flipped byte is refused."""
    from child.backends.boundary import Activations, BoundaryCorrupt, BoundaryWriter

    shapes = [(1, 7, 16), (1, 5, 16), (1, 5, 16)]
    samples = [torch.randn(s, dtype=torch.bfloat16) for s in shapes]
    for keep_in_ram in (True, False):
        dest = tmp_path / f"b{keep_in_ram}.bin"
        w = BoundaryWriter(3, shapes, torch.bfloat16, tmp_path=str(tmp_path / "tmp.bin"), keep_in_ram=keep_in_ram)
        for j, s in enumerate(samples):
            w.put(j, s)
        acts, sha, size = w.commit(str(dest))
        assert acts.in_ram is keep_in_ram and os.path.getsize(dest) == size
        for loaded in (acts, Activations.load(str(dest), sha, 3, in_ram=True), Activations.load(str(dest), sha, 3, in_ram=False)):
            assert all(torch.equal(loaded.get(j), s) for j, s in enumerate(samples))
    data = bytearray(dest.read_bytes())
    data[-3] ^= 1
    dest.write_bytes(bytes(data))
    with pytest.raises(BoundaryCorrupt):
        Activations.load(str(dest), sha, 3, in_ram=False)


@pytest.mark.parametrize("sizes", [[(1, 7, 16), (1, 5, 16), (1, 5, 16)], [(1, 1, 3)], [(1, 1031, 64)] * 5])
def test_a_boundary_written_in_parts_is_the_file_one_writer_makes(sizes, tmp_path):
    """Every way a boundary file is made holds the same bytes and digest: fsynced after the samples (past the page
    cache where the filesystem allows), without fsync from several threads after the samples or (stream) while they
    come (the quality measurement's), and appended sample by sample on disk; it is the layout read by hand and loads
    back equal."""
    from child.backends.boundary import Activations, BoundaryWriter

    samples = [torch.randn(s, dtype=torch.bfloat16) for s in sizes]
    files = {}
    for mode in ("sync", "parts", "stream"):
        w = BoundaryWriter(4, sizes, torch.bfloat16, tmp_path=str(tmp_path / f"{mode}.tmp"), keep_in_ram=True,
                           later=True, sync=mode == "sync", stream=mode == "stream")
        for j, x in enumerate(samples):
            w.put(j, x)
        acts, pending = w.commit_later(str(tmp_path / f"{mode}.bin"))
        files[mode] = (pending.wait(), (tmp_path / f"{mode}.bin").read_bytes())
        assert all(torch.equal(acts.get(j), x) for j, x in enumerate(samples))
        assert not (tmp_path / f"{mode}.tmp").exists()
    # on disk (samples appended by one thread as they come, then fsynced): the same file again
    w = BoundaryWriter(4, sizes, torch.bfloat16, tmp_path=str(tmp_path / "disk.tmp"), keep_in_ram=False)
    for j, x in enumerate(samples):
        w.put(j, x)
    acts, digest, size = w.commit(str(tmp_path / "disk.bin"))
    files["disk"] = ((digest, size), (tmp_path / "disk.bin").read_bytes())
    acts.close()
    assert files["sync"] == files["parts"] == files["stream"] == files["disk"]
    (digest, size), data = files["stream"]
    assert size == len(data)
    # the layout, read here by hand: magic, the header's length, a JSON header ending on a 4 KiB block (so the
    # samples can go past the page cache), then the samples' raw bytes; the digest is the file's
    import json
    import struct

    from shared import durable

    assert data[:8] == b"LWBOUND1"
    (n,) = struct.unpack("<Q", data[8:16])
    assert json.loads(data[16:16 + n]) == {"feeds": 4, "dtype": "bfloat16", "shapes": [list(s) for s in sizes]}
    assert (16 + n) % 4096 == 0
    assert data[16 + n:] == b"".join(x.reshape(-1).view(torch.uint8).numpy().tobytes() for x in samples)
    assert durable.hash_file(str(tmp_path / "stream.bin")) == digest
    loaded = Activations.load(str(tmp_path / "stream.bin"), digest, 4, in_ram=True)
    assert all(torch.equal(loaded.get(j), x) for j, x in enumerate(samples))


def test_a_boundary_takes_the_host_memory_being_made_for_it(tmp_path):
    """A Future of host memory (host_buffer_meanwhile's, made while layer 0 computes) is waited for and filled when
    it fits, and left alone when it does not."""
    import concurrent.futures

    from child.backends.boundary import BoundaryWriter

    sizes = [(1, 9, 16), (1, 4, 16)]
    samples = [torch.randn(s, dtype=torch.bfloat16) for s in sizes]
    for numel, used in ((9 * 16 + 4 * 16, True), (7, False)):
        memory = torch.zeros(numel, dtype=torch.bfloat16)
        future = concurrent.futures.Future()
        future.set_result(memory)
        w = BoundaryWriter(1, sizes, torch.bfloat16, tmp_path=None, keep_in_ram=True, buffer=future)
        for j, x in enumerate(samples):
            w.put(j, x)
        acts, _, _ = w.commit(None)
        assert all(torch.equal(acts.get(j), x) for j, x in enumerate(samples))
        assert (acts.get(0).data_ptr() == memory.data_ptr()) == used
        assert bool(memory.any()) == used


@pytest.mark.parametrize("spare_bytes", [0, 1, 3000, 40000, 9000])
def test_a_boundary_written_over_a_spare_is_the_fresh_file(spare_bytes, tmp_path):
    """A boundary whose temp file is a spent one rewritten in place (of the same size, larger: cut, or smaller:
    extended) holds the bytes and digest of one written into a fresh file, by each way a durable boundary is
    made (after the layer, past the page cache; sample by sample on disk), and takes the spare; spare_bytes 0: no
    spare, a fresh file. Where several wait, the one of the file's own size is taken."""
    from child.backends.boundary import BoundaryWriter
    from shared import durable

    sizes = [(1, 37, 48), (1, 19, 48), (1, 64, 48)]
    samples = [torch.randn(s, dtype=torch.bfloat16) for s in sizes]
    fresh = tmp_path / "fresh"
    spares = tmp_path / "spares"
    fresh.mkdir()
    spares.mkdir()
    written = []
    for mode in ("later", "disk"):
        made = {}
        written.append(f"{mode}.bin")
        for where in (fresh, spares):
            if where is spares and spare_bytes:
                (spares / f"{durable.SPARE_PREFIX}a").write_bytes(os.urandom(spare_bytes))
            w = BoundaryWriter(4, sizes, torch.bfloat16, tmp_path=str(where / "b.tmp"), keep_in_ram=mode == "later",
                               later=mode == "later", spares=str(where))
            for j, x in enumerate(samples):
                w.put(j, x)
            dest = str(where / f"{mode}.bin")
            if mode == "later":
                acts, pending = w.commit_later(dest)
                digest, size = pending.wait()
            else:
                acts, digest, size = w.commit(dest)
            acts.close()
            made[where] = (digest, size, open(dest, "rb").read())
            assert sorted(os.listdir(where)) == sorted(written)  # the spare was taken: no temp file, no spare left
        assert made[fresh] == made[spares] and made[fresh][1] == len(made[fresh][2])
        assert durable.hash_file(str(spares / f"{mode}.bin")) == made[fresh][0]
    # several spares: the one of the boundary's own size is taken, the others wait
    exact = len(made[fresh][2])
    for name, n in (("a", exact + 4096), ("b", exact), ("c", exact - 4096)):
        (spares / f"{durable.SPARE_PREFIX}{name}").write_bytes(b"x" * n)
    ino = os.stat(spares / f"{durable.SPARE_PREFIX}b").st_ino
    w = BoundaryWriter(4, sizes, torch.bfloat16, tmp_path=str(spares / "b.tmp"), keep_in_ram=True, later=True,
                       spares=str(spares))
    for j, x in enumerate(samples):
        w.put(j, x)
    _, pending = w.commit_later(str(spares / "again.bin"))
    assert pending.wait()[0] == made[fresh][0]
    assert os.stat(spares / "again.bin").st_ino == ino
    assert durable.spares(str(spares)) == [f"{durable.SPARE_PREFIX}a", f"{durable.SPARE_PREFIX}c"]


def test_spent_boundaries_wait_as_spares_while_more_are_to_be_written(tmp_path):
    """The supervisor keeps a spent boundary file as a spare (a rename: the same file) while a boundary is still to
    be written, at most one per rank, unlinks the rest, and leaves none once the last boundary is journaled, nor
    after a run that stopped early."""
    import threading
    import types

    from shared import durable, layout
    from shared.messages import Boundary
    from supervisor.output import journal
    from supervisor.run.boundaries import Boundaries

    def run(world: int, layers: int, stop_after: int | None = None):
        out = tmp_path / f"w{world}-{layers}-{stop_after}"
        os.makedirs(layout.state_path(str(out), layout.TMP))
        os.makedirs(layout.state_path(str(out), layout.BOUNDARY))
        plan = types.SimpleNamespace(output=str(out), world=world, calibration=object(),
                                     source=types.SimpleNamespace(num_layers=layers))
        b = Boundaries(plan, {}, threading.Event())
        tmp = layout.state_path(str(out), layout.TMP)
        seen = []
        for i in range(layers):
            bs = []
            if i + 1 < layers:
                for r in range(world):
                    name = layout.boundary_name(i + 1, r if world > 1 else None, "f")
                    path = os.path.join(str(out), name)
                    with open(path, "wb") as f:
                        f.write(b"%d" % i)
                    bs.append(Boundary(feeds=i + 1, file=name, digest="x", nbytes=os.path.getsize(path)))
            b.recorded(journal.Shard(index=i, file=layout.shard_name(i), digest="x", nbytes=1,
                                     boundary=bs[0] if world == 1 and bs else None,
                                     boundaries=bs if world > 1 else []))
            if b._deleter is not None:
                b._deleter.submit(lambda: None).result()  # the unlinks queued so far are done
            seen.append(len(durable.spares(tmp)))
            # what is left on disk: the newest boundaries, and spares that are the spent files themselves
            assert sorted(os.listdir(layout.state_path(str(out), layout.BOUNDARY))) == \
                sorted(os.path.basename(x.file) for x in bs)
            if stop_after == i:
                break
        b.close()
        assert os.listdir(tmp) == []
        return seen

    # spent: layer i's record makes layer i's inputs spent (from i = 1); a spare while feeds + 1 < layers
    assert run(1, 6) == [0, 1, 1, 1, 0, 0]
    assert run(2, 5) == [0, 2, 2, 0, 0]
    assert run(1, 2) == [0, 0]
    assert run(2, 6, stop_after=2)[-1] == 2  # then close() unlinks them


@pytest.mark.parametrize("when", ["filling", "pending"])
def test_a_dropped_streamed_boundary_leaves_no_file(when, tmp_path):
    """A streamed boundary dropped while its samples come (the layer failed) or while its write finishes (the
    measurement moved on to the head) leaves neither its temp file nor its name behind."""
    from child.backends.boundary import BoundaryWriter

    sizes = [(1, 257, 64)] * 6
    w = BoundaryWriter(2, sizes, torch.bfloat16, tmp_path=str(tmp_path / "b.tmp"), keep_in_ram=True, later=True,
                       sync=False, stream=True)
    assert (tmp_path / "b.tmp").exists()  # the file is begun with the first sample, not after the last
    for j, s in enumerate(sizes[:3] if when == "filling" else sizes):
        w.put(j, torch.randn(s, dtype=torch.bfloat16))
    if when == "filling":
        w.abort()
    else:
        _, pending = w.commit_later(str(tmp_path / "b.bin"))
        pending.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_scheme_lists_match_the_libraries():
    """shared.schemes (no heavy imports) agrees with compressed-tensors' presets and llm-compressor's own rules."""
    from compressed_tensors.quantization import QuantizationStrategy, preset_name_to_scheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from shared import schemes

    for name in schemes.SUPPORTED:
        needs = QuantizationModifier(targets="Linear", scheme=name).requires_calibration_data
        assert needs == (name in schemes.CALIBRATED), name
        per_tensor = preset_name_to_scheme(name, ["Linear"]).weights.strategy == QuantizationStrategy.TENSOR
        assert per_tensor == (name in schemes.PER_TENSOR_WEIGHTS), name


def test_the_skeleton_takes_sdpa_only_when_asked_and_eager_where_the_model_has_none(monkeypatch):
    """The calibration skeleton's attention: eager by default (oneshot's), SDPA when asked (match_oneshot = false on a
    GPU), and eager when transformers refuses SDPA for the architecture (it raises at construction)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from child.backends import calibrate

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)

    def attention(model):
        return {m.config._attn_implementation for m in model.modules() if hasattr(m, "config")}

    assert attention(calibrate._calibration_skeleton(cfg)) == {"eager"}
    assert attention(calibrate._calibration_skeleton(cfg, sdpa=True)) == {"sdpa"}
    real = AutoModelForCausalLM.from_config

    def no_sdpa(config, **kwargs):
        if kwargs.get("attn_implementation") == "sdpa":
            raise ValueError("LlamaForCausalLM does not support an attention implementation through "
                             "torch.nn.functional.scaled_dot_product_attention yet.")
        return real(config, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", no_sdpa)
    assert attention(calibrate._calibration_skeleton(cfg, sdpa=True)) == {"eager"}
