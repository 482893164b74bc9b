"""Bad calibration input: exit code 2, a one-line error saying what to fix, no traceback, nothing created or changed.

Runs `python -m supervisor.cli run` on a structurally valid fake checkpoint (no torch needed: validation happens
before any child starts)."""
import json
import os
import subprocess
import sys

import pytest

from tests.scenarios import cli
from tests.scenarios.test_bad_input import _fake_checkpoint

GOOD = """
[source]
path = "src"
[export]
scheme = "W4A16"
method = "gptq"
output = "out"
[resources]
device = "cpu"
[calibration]
dataset = "calib.jsonl"
samples = 4
seq_len = 16
"""
ROWS = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6]}, {"input_ids": [7, 1]}]


def _checkpoint(tmp, tokenizer=True):
    src = os.path.join(tmp, "src")
    _fake_checkpoint(src)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(vocab_size=8, max_position_embeddings=64)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config, f)
    if tokenizer:
        with open(os.path.join(src, "tokenizer.json"), "w") as f:
            f.write("{}")


def _dataset(text: str):
    def write(tmp):
        with open(os.path.join(tmp, "calib.jsonl"), "w") as f:
            f.write(text)
    return write


def _lines(*objs) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs)


def _no_tokenizer(tmp):
    os.unlink(os.path.join(tmp, "src", "tokenizer.json"))
    _dataset(_lines(*[{"text": "hello"}] * 4))(tmp)


def _other_dataset_in_output(tmp):
    """An earlier export of the same job with another dataset: the fingerprint covers the data."""
    from shared.job import parse_toml
    from supervisor.output import journal
    from supervisor.api import prepare

    job = parse_toml(GOOD.replace('"src"', f'"{tmp}/src"').replace('"out"', f'"{tmp}/out"')
                     .replace('"calib.jsonl"', f'"{tmp}/calib.jsonl"'))
    plan = prepare(job)
    os.makedirs(os.path.join(tmp, "out", ".export"))
    journal.start(os.path.join(tmp, "out"), job, plan.fingerprint, 2).close()
    _dataset(_lines(*ROWS[::-1]))(tmp)  # same lines, another order: another calibration


CASES = [
    # (id, job text, mutation of the tree, expected words in the error)
    ("gptq without [calibration]", GOOD.split("[calibration]")[0], None, "needs calibration data"),
    ("static scheme without [calibration]", GOOD.split("[calibration]")[0].replace('method = "gptq"\n', "")
     .replace("W4A16", "NVFP4"), None, "needs calibration data"),
    ("[calibration] with a data-free job", GOOD.replace('method = "gptq"\n', ""), None, "has no effect"),
    ("unknown method", GOOD.replace('"gptq"', '"gtpq"'), None, "gtpq"),
    ("unknown key in [calibration]", GOOD + "shuffle = true\n", None, "unknown field `shuffle`"),
    ("zero samples", GOOD.replace("samples = 4", "samples = 0"), None, "at least 1"),
    ("match_oneshot not a bool", GOOD + 'match_oneshot = "no"\n', None, "match_oneshot"),
    ("match_oneshot = false with static scales", GOOD.replace('method = "gptq"\n', "").replace("W4A16", "NVFP4")
     + "match_oneshot = false\n", None, "GPTQ's and AWQ's arithmetic only"),
    ("awq with per-tensor weights", GOOD.replace('"gptq"', '"awq"').replace("W4A16", "FP8"), None,
     "one scale per tensor"),
    ("lm_head quantized", GOOD.replace('method = "gptq"', 'method = "gptq"\nignore = []'), None, "lm_head"),
    ("negative activation_ram_gb", GOOD.replace('device = "cpu"', 'device = "cpu"\nactivation_ram_gb = -1'), None,
     "activation_ram_gb"),
    ("dataset missing", GOOD.replace("calib.jsonl", "nowhere.jsonl"), None, "does not exist"),
    ("dataset is a folder", GOOD.replace("calib.jsonl", "src"), None, "is a folder"),
    ("dataset empty", GOOD, _dataset(""), "is empty"),
    ("line not JSON", GOOD, _dataset(_lines(ROWS[0], "{oops", ROWS[2], ROWS[3])), "line 2 is not valid JSON"),
    ("line without text or input_ids", GOOD, _dataset(_lines(*ROWS[:3], {"prompt": "x"})), "exactly one of"),
    ("line with both", GOOD, _dataset(_lines({"text": "a", "input_ids": [1]}, *ROWS[1:])), "exactly one of"),
    ("empty text", GOOD, _dataset(_lines({"text": ""}, *ROWS[1:])), "non-empty string"),
    ("ids not integers", GOOD, _dataset(_lines({"input_ids": [1, "2"]}, *ROWS[1:])), "non-negative integers"),
    ("id outside the vocabulary", GOOD, _dataset(_lines({"input_ids": [1, 8]}, *ROWS[1:])), "vocab_size 8"),
    ("fewer lines than samples", GOOD, _dataset(_lines(*ROWS[:2])), "has 2 lines"),
    ("text without a tokenizer", GOOD, _no_tokenizer, "no tokenizer"),
    ("seq_len over max_position_embeddings", GOOD.replace("seq_len = 16", "seq_len = 65"), None,
     "max_position_embeddings (64)"),
    ("output holds the job with other data", GOOD, _other_dataset_in_output, "different job"),
]


@pytest.mark.parametrize("job_text,mutate,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_calibration_input_exits_2_with_one_line_and_writes_nothing(tmp_path, job_text, mutate, expected):
    """Each bad calibration setting or dataset: exit 2, one stderr line naming the problem, tree unchanged."""
    _checkpoint(str(tmp_path))
    _dataset(_lines(*ROWS))(str(tmp_path))
    (tmp_path / "job.toml").write_text(job_text)
    if mutate:
        mutate(str(tmp_path))
    cli.assert_refused(tmp_path / "job.toml", expected, tmp_path, cwd=tmp_path)


def test_good_calibration_input_passes_validation(tmp_path):
    """The same table's good job validates (so each bad case fails for its own reason), and writes nothing."""
    from shared.job import parse_toml
    from supervisor.api import prepare

    _checkpoint(str(tmp_path))
    _dataset(_lines(*ROWS))(str(tmp_path))
    before = cli.tree(tmp_path)
    job = parse_toml(GOOD.replace('"src"', f'"{tmp_path}/src"').replace('"out"', f'"{tmp_path}/out"')
                     .replace('"calib.jsonl"', f'"{tmp_path}/calib.jsonl"'))
    plan = prepare(job)
    assert plan.calibration is not None and len(plan.calibration.sha256) == 64
    assert cli.tree(tmp_path) == before


@pytest.mark.parametrize("kind,expected", [
    ("phi", "AWQ mappings for it (Llama's, the default: none are registered for it) do not fit the modules of layer 0"),
    ("gpt2", "would change nothing in GPT2LMHeadModel"),
    # registered mappings, and a dense first layer they do not fit (oneshot fails on it too, another way)
    ("deepseekv3", "AWQ mappings for it (registered for it) do not fit the modules of layer 0"),
])
def test_awq_where_its_mappings_do_not_fit_the_model_is_refused_before_anything_is_written(tmp_path, kind, expected):
    """AWQ on an architecture llm-compressor's AWQ cannot smooth: Phi (its q/k/v_proj and v_proj match Llama's default
    mappings, its input_layernorm-less and o_proj-less modules do not: oneshot fails at its first layer, checked
    here), GPT-2 (no module matches: AWQ would be a silent round-to-nearest) and DeepSeek-V3, whose registered
    mappings do not fit its dense first layer. `plan` and `run` refuse it with one
    error line, exit 2, nothing written."""
    from tests.ref_calib import make_tiny_dense, oneshot_calibrated, token_rows, write_jsonl
    from tests.ref_moe import make_family_model

    make = make_tiny_dense if kind == "phi" else make_family_model
    src = make(kind, str(tmp_path / "src"))
    rows = token_rows(4)
    write_jsonl(tmp_path / "calib.jsonl", rows)
    if kind == "phi":  # the independent reference: oneshot's own AWQ fails on this model
        with pytest.raises(ValueError, match="incomplete set"):
            oneshot_calibrated(src, "W4A16", "awq", rows, 40, str(tmp_path / "ref"))
    job = cli.write_job(tmp_path / "job.toml", src, tmp_path / "out", "W4A16", method="awq",
                        calibration={"dataset": tmp_path / "calib.jsonl", "samples": 4, "seq_len": 40})
    before = cli.tree(tmp_path)
    for command in ("plan", "run"):  # refused by the worker that builds the model: run's progress lines come first
        proc = subprocess.run(cli.as_a_terminal([sys.executable, "-m", "supervisor.cli", command, job]), cwd=tmp_path,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and last.startswith("error: ") and expected in last, (command, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout
        assert cli.tree(tmp_path) == before
