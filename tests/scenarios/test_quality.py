"""`supervisor verify OUT --quality FILE`: the figures equal transformers' whole-model computation; resumable; bad input.

The reference is computed here, independently of our code: the source loaded with transformers'
`from_pretrained` (the adapter merged with PEFT's `merge_and_unload` where the job has one), the export folder
loaded with transformers' own loader (`from_pretrained(OUT)`: compressed-tensors decompresses it), every held-out
sample run through each whole model, and kl, top-1 and both perplexities computed from the logits in float32. Both
sides run eager attention (what our layers run; sdpa differs by float noise that can flip the argmax of the tiny
random models' near-uniform logits). Agreement asked: kl within 5%, top1 within 0.02, each ppl within 1%.

Kills are triggered by the quality worker reaching a layer (child/faults.py point "evaluate"), never by a sleep.
"""
import json
import math
import os
import shutil

import pytest
import torch

from tests.ref_calib import token_rows, write_jsonl
from tests.scenarios import cli, faultkit

N, SEQ = 8, 40


def _rows(n=N, seed=11):
    rows = token_rows(n, low=20, high=48, seed=seed)
    return [" ".join(f"t{40 + i % 60}" for i in rows[0])] + rows[1:]  # one text sample: the tokenizer's path


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("held") / "held.jsonl", _rows())


def _export(tmp_path, source, scheme, *, adapter=None, **kw) -> str:
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", source, out, scheme, **kw)
    if adapter is not None:
        text = open(job).read().replace("[export]", f'adapter = "{adapter}"\n[export]', 1)
        open(job, "w").write(text)
    cli.run("run", job, "--json")
    return str(out)


def reference(source: str, out: str, dataset: str, seq_len: int, adapter: str | None = None) -> dict:
    """kl, top1, ppl_source, ppl_export from whole models loaded by transformers (see the module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel

        src = PeftModel.from_pretrained(src, adapter).merge_and_unload()
    exp = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(source)
    kl = top1 = nll_s = nll_e = 0.0
    positions = predicted = 0
    with open(dataset) as f:
        rows = [json.loads(line) for line in f][:N]
    with torch.no_grad():
        for row in rows:
            ids = row["input_ids"] if "input_ids" in row else tok(row["text"], truncation=True,
                                                                   max_length=seq_len)["input_ids"]
            x = torch.tensor([ids[:seq_len]])
            ls = torch.log_softmax(src(x).logits[0].float(), -1)
            le = torch.log_softmax(exp(x).logits[0].float(), -1)
            kl += float((ls.exp() * (ls - le)).sum(-1).sum())
            top1 += int((ls.argmax(-1) == le.argmax(-1)).sum())
            positions += x.shape[1]
            t = x[0, 1:]
            nll_s -= float(ls[:-1].gather(-1, t[:, None]).sum())
            nll_e -= float(le[:-1].gather(-1, t[:, None]).sum())
            predicted += t.numel()
    return {"kl": kl / positions, "top1": top1 / positions, "ppl_source": math.exp(nll_s / predicted),
            "ppl_export": math.exp(nll_e / predicted), "tokens": positions}


def _verify(out, dataset, *args, env=None, check=True):
    proc = cli.run("verify", out, "--quality", dataset, "--samples", str(N), "--seq-len", str(SEQ), "--json", *args,
                   env=env, check=check)
    return proc, (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None)


def _assert_agrees(got: dict, want: dict) -> None:
    q = got["quality"]
    assert q["tokens"] == want["tokens"] and q["samples"] == N
    assert abs(q["kl"] - want["kl"]) <= 0.05 * want["kl"], (q, want)
    assert abs(q["top1"] - want["top1"]) <= 0.02, (q, want)
    for k in ("ppl_source", "ppl_export"):
        assert abs(q[k] - want[k]) <= 0.01 * want[k], (k, q, want)
    assert all(0 < r["rel_error"] < 1 and 0.5 < r["cosine"] <= 1 for r in q["layers"]), q["layers"]


CASES = {
    "llama-W4A16": dict(kind="llama", scheme="W4A16"),
    "qwen3-FP8_DYNAMIC": dict(kind="qwen3", scheme="FP8_DYNAMIC"),  # activations quantized on the fly
    "qwen3moe-W4A16": dict(kind="qwen3moe", scheme="W4A16"),  # fused experts, transformers' MoE conversions
    "llama-torchao-Int8WeightOnly": dict(kind="llama", scheme="Int8WeightOnly", export={"format": "torchao"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_quality_equals_whole_model_transformers(case, tiny_models, held_out, tmp_path):
    c = CASES[case]
    source = tiny_models(c["kind"], layers=2)
    out = _export(tmp_path, source, c["scheme"], **({"export": c["export"]} if "export" in c else {}))
    before = cli.output_bytes(out)
    proc, got = _verify(out, held_out)
    assert got["ok"], got
    _assert_agrees(got, reference(source, out, held_out, SEQ))
    assert cli.output_bytes(out) == before  # the export's files never change
    # the report shows the journaled figures (table and --json)
    rep = json.loads(cli.run("report", out, "--json").stdout)
    assert rep["quality"]["kl"] == got["quality"]["kl"]
    text = cli.run("report", out, "--html", str(tmp_path / "r.html")).stdout
    assert "top-1 agreement" in text and "hidden state per decoder layer" in text
    assert "Quality against the source" in open(tmp_path / "r.html").read()


def test_quality_of_a_lora_merged_export(tmp_path, tiny_models, held_out):
    """The source is the checkpoint with the job's adapter merged, as the export was made (PEFT's merge here). Its
    job's resources.activation_ram_gb is below one layer's hidden states: they stay on disk, read back a sample
    at a time."""
    from tests.ref_studio import make_adapter

    base = tiny_models("qwen3", layers=2)
    adapter = make_adapter(base, str(tmp_path / "adapter"))
    out = _export(tmp_path, base, "W4A16", adapter=adapter, activation_ram_gb=1e-6)
    _, got = _verify(out, held_out)
    _assert_agrees(got, reference(base, out, held_out, SEQ, adapter=adapter))


def test_quality_of_a_calibrated_gptq_export(tmp_path, tiny_models, held_out):
    base = tiny_models("llama", layers=2)
    calib = write_jsonl(tmp_path / "calib.jsonl", token_rows(8, seed=5))
    out = _export(tmp_path, base, "W4A16", method="gptq", calibration={"dataset": calib, "samples": 8, "seq_len": 32})
    _, got = _verify(out, held_out)
    _assert_agrees(got, reference(base, out, held_out, SEQ))


def test_killed_quality_worker_resumes_to_the_same_figures(tmp_path, tiny_models, held_out):
    """SIGKILL the quality worker as it reaches layer 2 (of 4); the run goes on in a fresh worker from the newest
    journaled boundary (layer 0 is not measured again; layer 1, whose outputs were being written beside layer
    2, is) and its figures equal an uninterrupted run's. Then the
    supervisor itself is SIGKILLed (with its workers) while its worker waits at layer 2, and the journaled boundary
    emptied as a machine's crash can leave an unsynced file: the next run measures from the samples and ends with the
    same figures."""
    base = tiny_models("llama", layers=4, seed=2)
    out = _export(tmp_path, base, "W4A16")
    _, want = _verify(out, held_out)
    journal = os.path.join(out, ".export", "quality", "journal.jsonl")
    os.unlink(journal)  # measured again from scratch
    marker = tmp_path / "fired"
    fault = {"SUPERVISOR_TEST_FAULT": json.dumps({"point": "evaluate", "action": "sigkill", "index": 2,
                                                  "once": str(marker)})}
    _, got = _verify(out, held_out, env=fault)
    assert marker.exists()
    timing = {"seconds", "startup"}
    assert {k: v for k, v in got["quality"].items() if k not in timing} == \
        {k: v for k, v in want["quality"].items() if k not in timing}
    records = [json.loads(line) for line in open(journal)]
    # a measured layer's record comes first without its boundary (made durable beside the next layer, then journaled
    # again naming it): layer 1's was not named yet when layer 2's worker died, so layer 1 is measured once more
    measured = [r["index"] for r in records if r["type"] == "Layer" and r["boundary"] is None]
    assert measured == [0, 1, 1, 2, 3], measured
    assert not [f for f in os.listdir(os.path.dirname(journal)) if f.startswith("inputs-")]  # boundaries gone

    os.unlink(journal)
    marker2, never = tmp_path / "waiting", tmp_path / "never"
    env = cli.run_env({"SUPERVISOR_TEST_FAULT": json.dumps({"point": "evaluate", "action": "await", "index": 2,
                                                            "path": str(never), "once": str(marker2)})})
    with cli.job([cli.SUPERVISOR, "verify", out, "--quality", held_out, "--samples", str(N), "--seq-len", str(SEQ)],
                 env=env) as proc:
        assert faultkit.wait_marker(marker2)
        cli.end_group(proc)  # the supervisor and its workers, SIGKILLed at once
    # layer 0, layer 0 naming its written boundary, layer 1 (its boundary not named): resumed at layer 1
    assert [(r["type"], r.get("index")) for r in map(json.loads, open(journal))] == \
        [("Header", None), ("Layer", 0), ("Layer", 0), ("Layer", 1)]
    # the boundary files are not fsynced: after the machine's own crash the journaled one can be empty (its pages
    # never reached the disk); the resume re-hashes it, measures from the samples, and the figures do not change
    named = [r["boundary"]["file"] for r in map(json.loads, open(journal)) if r.get("boundary")]
    assert len(named) == 1
    open(os.path.join(out, named[0]), "wb").close()
    _, again = _verify(out, held_out)
    assert {k: v for k, v in again["quality"].items() if k not in timing} == \
        {k: v for k, v in want["quality"].items() if k not in timing}
    measured = [r["index"] for r in map(json.loads, open(journal)) if r["type"] == "Layer" and r["boundary"] is None]
    assert measured == [0, 1, 0, 1, 2, 3], measured  # layer 0 measured again: the damaged boundary not trusted


def _one_line_refusal(args, root, expected):
    before = {k: v for k, v in cli.tree(root).items() if not k.startswith(".export")}
    proc = cli.run("verify", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert {k: v for k, v in cli.tree(root).items() if not k.startswith(".export")} == before


def test_bad_input_is_refused_in_one_line(tmp_path, tiny_models):
    base = tiny_models("llama", layers=2)
    out = _export(tmp_path, base, "W4A16")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _one_line_refusal([out, "--quality", str(tmp_path / "missing.jsonl")], out, "does not exist")
    _one_line_refusal([out, "--quality", str(empty)], out, "is empty")
    long_ids = write_jsonl(tmp_path / "long.jsonl", [list(range(4, 4 + 250)) + list(range(4, 20))])  # 266 > 256
    _one_line_refusal([out, "--quality", long_ids, "--samples", "1", "--seq-len", "4096"], out, "positions")
    long_text = write_jsonl(tmp_path / "long-text.jsonl", [" ".join(f"t{40 + i % 60}" for i in range(300))])
    _one_line_refusal([out, "--quality", long_text, "--samples", "1", "--seq-len", "4096"], out, "positions")
    # an unfinished export: its journal cut after the first shard, the done marker gone
    part = tmp_path / "part"
    shutil.copytree(out, part)
    jpath = part / ".export" / "journal.jsonl"
    jpath.write_text("".join(open(jpath).readlines()[:2]))
    os.unlink(part / ".export" / "done.json")
    ok = write_jsonl(tmp_path / "ok.jsonl", token_rows(2))
    _one_line_refusal([str(part), "--quality", ok, "--samples", "2"], part, "not finished")


def test_evaluate_in_the_job_runs_at_the_end_of_the_export(tmp_path, tiny_models, held_out):
    """[evaluate] in job.toml: the figures come as events at the end of `run`, are journaled (report --json shows
    them, and verify --quality finds them measured) and equal the reference; a missing file is refused before
    anything is written."""
    base = tiny_models("llama", layers=2)
    out = tmp_path / "out"
    job = cli.write_job(tmp_path / "job.toml", base, out, "W4A16")
    with open(job, "a") as f:
        f.write(f'[evaluate]\ndataset = "{held_out}"\nsamples = {N}\nseq_len = {SEQ}\n')
    bad = tmp_path / "bad.toml"
    bad.write_text(open(job).read().replace(held_out, str(tmp_path / "missing.jsonl")))
    cli.assert_refused(str(bad), "does not exist", tmp_path)
    evs = cli.events(cli.run("run", job, "--json"))
    measured = [e for e in evs if e["type"] == "QualityMeasured"]
    assert len(measured) == 1 and [e["index"] for e in evs if e["type"] == "QualityLayer"] == [0, 1]
    assert evs[-1]["type"] == "Finished"
    rep = json.loads(cli.run("report", str(out), "--json").stdout)["quality"]
    assert rep["kl"] == measured[0]["kl"] and [r["rel_error"] for r in rep["layers"]] == measured[0]["rel_error"]
    _, got = _verify(str(out), held_out)
    assert got["quality"] == rep
    _assert_agrees(got, reference(base, str(out), held_out, SEQ))

