"""Helpers for scenario suites: run the real `supervisor` console script on tiny models, as a user would."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

# The installed console script; SUPERVISOR_BIN overrides it where the package is not pip-installed (GPU box).
SUPERVISOR = os.environ.get("SUPERVISOR_BIN") or os.path.join(os.path.dirname(sys.executable), "supervisor")


def write_job(path, source, output, scheme, *, device="cpu", ignore=None, export=None, method=None,
              calibration=None, **resources) -> str:
    """export: more [export] keys; method: [export] method; calibration: the [calibration] table as a dict."""
    lines = ["[source]", f'path = "{source}"', "[export]", f'scheme = "{scheme}"', f'output = "{output}"']
    if ignore is not None:
        lines.append("ignore = [" + ", ".join(json.dumps(i) for i in ignore) + "]")
    if method is not None:
        lines.append(f'method = "{method}"')
    lines += [f"{k} = {json.dumps(v)}" for k, v in (export or {}).items()]
    lines += ["[resources]", f'device = "{device}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in resources.items()]
    if calibration is not None:
        lines += ["[calibration]"] + [f"{k} = {json.dumps(str(v) if k == 'dataset' else v)}"
                                      for k, v in calibration.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def run(*args, env=None, timeout=600, check=True) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.pop("SUPERVISOR_TEST_FAULT", None)
    full_env.update(env or {})
    proc = subprocess.run([SUPERVISOR, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"supervisor {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def events(proc: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def output_bytes(folder) -> dict[str, str]:
    """sha256 of every file of an export (outside .export/): what must be byte-identical across runs."""
    out = {}
    for name in sorted(os.listdir(folder)):
        p = os.path.join(folder, name)
        if name == ".export" or not os.path.isfile(p):
            continue
        with open(p, "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def tree(root) -> dict[str, tuple]:
    """Every path under root with its mode, size, mtime and (files) sha256: what "changes nothing on disk" compares."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            digest = ""
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def assert_refused(job, expected: str, root, *, cwd=None) -> None:
    """`supervisor run job` refuses it as bad input: exit 2, one stderr line "error: ..." holding `expected`, no
    traceback, and nothing under root changed."""
    before = tree(root)
    proc = subprocess.run([sys.executable, "-m", "supervisor.cli", "run", str(job)], cwd=cwd, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert tree(root) == before
