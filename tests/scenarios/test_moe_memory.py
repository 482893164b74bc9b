"""Memory stays flat on a 12-layer, 32-expert MoE: per-layer peak RSS, and no tensor of a finished layer survives it.

The bug this project started from was a layerwise MoE export that kept every layer's expert tensors alive. Here the
child logs, after each layer (test-only, child/faults.py), the CPU tensors still alive in its heap once the
read-ahead of the next layer has landed: they must be exactly the next layer's source tensors, nothing more.
"""
from __future__ import annotations

import json

import pytest

from tests.models import load_tensors
from tests.scenarios import cli

LAYERS, EXPERTS = 12, 32
RSS_TOLERANCE = 1.05  # the bound: the last layer's peak within 5% of the first's


@pytest.fixture(scope="module")
def big_moe(moe_models):
    return moe_models("qwen3moe", layers=LAYERS, experts=EXPERTS)


def test_moe_memory_flat_and_no_tensor_of_a_finished_layer_kept(big_moe, tmp_path):
    """Last layer's peak RSS within 5% of the first's; after layer i the child holds exactly layer i+1's tensors
    (read ahead) plus a constant few bytes, the same for every layer."""
    log = tmp_path / "tensors.jsonl"
    # one worker: after layer i it holds layer i+1, read ahead (parts in order)
    job = cli.write_job(tmp_path / "job.toml", big_moe, tmp_path / "out", "W4A16", torch_threads=1, workers=1)
    events = cli.events(cli.run("run", job, "--json", env={"SUPERVISOR_TEST_TENSOR_LOG": str(log)}))
    peaks = {e["index"]: e["peak_rss"] for e in events if e["type"] == "LayerWritten"}
    assert sorted(peaks) == [-1] + list(range(LAYERS))
    assert peaks[LAYERS - 1] <= peaks[0] * RSS_TOLERANCE, (peaks[0], peaks[LAYERS - 1])

    live = {r["index"]: r for r in map(json.loads, log.read_text().splitlines())}
    source = load_tensors(big_moe)

    def layer(i):
        named = [t for k, t in source.items() if k.startswith(f"model.layers.{i}.")]
        return len(named), sum(t.numel() * t.element_size() for t in named)

    extra = {(live[i]["tensors"] - layer(i + 1)[0], live[i]["bytes"] - layer(i + 1)[1]) for i in range(LAYERS - 1)}
    assert len(extra) == 1, f"what the child holds beyond the next layer changes from layer to layer: {extra}"
    (count, nbytes), = extra
    assert 0 <= count <= 16 and 0 <= nbytes <= 4096, (count, nbytes)  # a few scalars, never a layer's weights
