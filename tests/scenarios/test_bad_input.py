"""Bad job files and bad sources: exit code 2, a one-line error, no traceback, nothing created or changed."""
import json
import os
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.scenarios import cli

GOOD_JOB = """
[source]
path = "src"
[export]
scheme = "W4A16"
output = "out"
[resources]
device = "cpu"
"""


def _fake_checkpoint(path, layers=2, config_layers=None):
    """A structurally valid checkpoint: config.json + safetensors with `layers` decoder layers (no torch)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "num_hidden_layers": config_layers or layers}, f)
    tensors = {"model.embed_tokens.weight": np.zeros((8, 4), np.float32)}
    for i in range(layers):
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def _lying_header(src):
    p = os.path.join(src, "model.safetensors")
    with open(p, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    key = "model.layers.0.mlp.down_proj.weight"
    header[key]["shape"] = [400, 400]  # claims far more bytes than its offsets hold
    raw = json.dumps(header).encode()
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _index_escape(src):
    with open(os.path.join(src, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {"model.layers.0.mlp.down_proj.weight": "../evil.safetensors"}}, f)


def _pickle_only(src):
    os.unlink(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "pytorch_model.bin"), "wb") as f:
        f.write(b"\x80\x04not really a pickle")


def _no_weights(src):
    os.unlink(os.path.join(src, "model.safetensors"))


def _remote_code(src):
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump({"model_type": "x", "num_hidden_layers": 2, "auto_map": {"AutoModel": "m.M"}}, f)


def _layers_missing(src):
    _fake_checkpoint(src, layers=2, config_layers=4)


def _other_files_in_output(tmp):
    os.makedirs(os.path.join(tmp, "out"))
    with open(os.path.join(tmp, "out", "notes.txt"), "w") as f:
        f.write("mine")


def _other_job_in_output(tmp):
    os.makedirs(os.path.join(tmp, "out", ".export"))
    with open(os.path.join(tmp, "out", ".export", "journal.jsonl"), "w") as f:
        f.write(json.dumps({"type": "Header", "version": 1, "fingerprint": "0" * 32,
                            "job": {"source": {"path": "elsewhere"}, "export": {"scheme": "FP8_DYNAMIC"}},
                            "num_layers": 2}) + "\n")


def _output_is_file(tmp):
    with open(os.path.join(tmp, "out"), "w") as f:
        f.write("x")


CASES = [
    # (id, job text or None for GOOD_JOB, mutation of the tree, expected words in the error)
    ("missing job file", "<nojob>", None, "does not exist"),
    ("invalid toml", "[source\npath=", None, "not valid TOML"),
    ("unknown top-level key", GOOD_JOB + "\nextra = 1\n", None, "unknown field `extra`"),
    ("unknown key in section", GOOD_JOB.replace('scheme = "W4A16"', 'scheme = "W4A16"\nschema = 1'), None,
     "unknown field `schema`"),
    ("wrong type", GOOD_JOB.replace('path = "src"', "path = 3"), None, "Expected `str`, got `int`"),
    ("missing section", "[export]\nscheme='W4A16'\noutput='out'\n", None, "the job has no [source]"),
    ("unknown scheme with suggestion", GOOD_JOB.replace("W4A16", "W4A61"), None, "did you mean"),
    ("calibrated scheme", GOOD_JOB.replace("W4A16", "NVFP4"), None, "needs calibration data"),
    ("bad device", GOOD_JOB.replace('device = "cpu"', 'device = "gpu"'), None, "device"),
    ("zero attempts", GOOD_JOB + "max_attempts = 0\n", None, "max_attempts"),
    ("missing source", GOOD_JOB.replace('path = "src"', 'path = "nowhere"'), None, "is not a folder"),
    ("no safetensors", None, lambda tmp: _no_weights(os.path.join(tmp, "src")), "no *.safetensors"),
    ("pickle-only source", None, lambda tmp: _pickle_only(os.path.join(tmp, "src")), "pickle"),
    ("index points outside", None, lambda tmp: _index_escape(os.path.join(tmp, "src")), "outside the source"),
    ("header lies about sizes", None, lambda tmp: _lying_header(os.path.join(tmp, "src")), "not a valid safetensors"),
    ("config/weights layer mismatch", None, lambda tmp: _layers_missing(os.path.join(tmp, "src")), "incomplete"),
    ("output holds other files", None, _other_files_in_output, "not empty"),
    ("output holds another job", None, _other_job_in_output, "different job"),
    ("output is a file", None, _output_is_file, "not a folder"),
    ("output inside source", GOOD_JOB.replace('output = "out"', 'output = "src/out"'), None, "inside the source"),
    ("output equals source", GOOD_JOB.replace('output = "out"', 'output = "src"'), None, "inside the source"),
]


@pytest.mark.parametrize("job_text,mutate,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, job_text, mutate, expected):
    """Each bad job or source: exit 2, one stderr line naming the problem, no traceback, tree unchanged."""
    _fake_checkpoint(tmp_path / "src")
    job = tmp_path / "job.toml"
    if job_text != "<nojob>":
        job.write_text(GOOD_JOB if job_text is None else job_text)
    if mutate:
        mutate(str(tmp_path))
    cli.assert_refused(job, expected, tmp_path, cwd=tmp_path)


def test_remote_code_passes_validation_either_way(tmp_path):
    """A config.json with auto_map passes validation (writing nothing) with or without allow_remote_code: without it
    the checkpoint's code is never run and the export goes by tensor names (tests/test_name_only.py)."""
    from shared.job import parse_job
    from supervisor.api import prepare

    _fake_checkpoint(tmp_path / "src")
    _remote_code(str(tmp_path / "src"))
    before = cli.tree(tmp_path)
    job = {"source": {"path": str(tmp_path / "src")}, "export": {"scheme": "W4A16", "output": str(tmp_path / "out")},
           "resources": {"device": "cpu"}}
    assert prepare(parse_job(job)).source.num_layers == 2
    job["source"]["allow_remote_code"] = True
    assert prepare(parse_job(job)).source.num_layers == 2
    assert cli.tree(tmp_path) == before
