"""`status` and `verify` of an output folder: read-only views of the journal and the files on disk.

`verify` re-hashes every journaled file and, on a finished export, runs transformers' loader on the folder (meta
device, no weight read, in a child process: `python -m child.loadcheck`): a weight the loader could not place is
a problem like a bad hash. Owns nothing on disk: it never takes the lock and never changes a file.
"""
from __future__ import annotations

import os
import subprocess
import sys

import msgspec

from shared import layout
from shared.load_verdict import problems as load_problems
from shared.messages import NON_LAYER, LoadReport
from shared.schemes import needs_calibration
from supervisor.output import journal
from supervisor.errors import OutputError


def read_state(output: str) -> journal.State:
    """The export's journal; OutputError if `output` is not an export folder."""
    if not os.path.isdir(output):
        raise OutputError(f"{output!r} is not a folder")
    st = journal.read(output)
    if st.header is None:
        raise OutputError(f"{output!r} holds no export journal (.export/journal.jsonl); is it an export folder?")
    return st


def _running_pid(output: str) -> int | None:
    from supervisor.errors import LockedError
    from supervisor.output.lock import probe
    try:
        probe(output)
    except LockedError as exc:
        return exc.pid or -1
    return None


def status(output: str, state: journal.State | None = None) -> dict:
    """What is done and left in `output` (from `state`, its journal as already read, when given)."""
    st = read_state(output) if state is None else state
    n = st.header.num_layers
    parts = list(range(n)) + [NON_LAYER]
    job = st.header.job
    if needs_calibration(job["export"]["scheme"], job["export"].get("method", "rtn")):
        # layers run in order from the newest journaled boundary (files are checked by `run`)
        k = journal.calibrated_start(st, n, st.shards)
        left = list(range(k, n)) + ([] if NON_LAYER in st.shards else [NON_LAYER])
    else:
        left = [p for p in parts if p not in st.shards]
    return {
        "output": os.path.abspath(output),
        "source": (job.get("source") or {}).get("path", "a live model (Python API)"),
        "scheme": job["export"]["scheme"],
        "method": job["export"].get("method", "rtn"),
        "arithmetic": arithmetic(job),
        "layers": n,
        "done": f"{len(parts) - len(left)}/{len(parts)} shards",
        "left": ["non-layer" if p == NON_LAYER else p for p in left],
        "finalized": st.finalized is not None and os.path.exists(layout.state_path(output, layout.DONE)),
        "running_pid": _running_pid(output),
        "bytes": sum(r.nbytes for r in st.shards.values()),
    }


def arithmetic(job: dict) -> str:
    """Which arithmetic writes a calibrated export ("" for a data-free one), from the job as journaled."""
    c = job.get("calibration")
    if not c:
        return ""
    if c.get("match_oneshot", True):
        return "oneshot's, bit for bit"
    if (job.get("export") or {}).get("method") == "awq":
        return "fast: SDPA attention in AWQ's calibration passes and grid search on a GPU (on the CPU, the " \
            "default's) ([calibration] match_oneshot = false)"
    return "fast: bf16 Hessians on tensor cores, SDPA attention on a GPU, GPTQ's factor in half the flops " \
        "([calibration] match_oneshot = false)"


LOADER = "(transformers loader)"  # the key of a loader problem in verify's result


def verify(output: str, load_check: bool = True) -> dict[str, str]:
    """file -> problem, for every journaled shard (and finalized file) whose bytes do not match its digest: every
    byte is re-read (resume trusts an unchanged stat; verify never does); on a finished export whose files are
    intact, LOADER -> why transformers would not load it correctly."""
    st = read_state(output)
    problems = {}
    for rec in st.shards.values():
        why = journal.verify_shard(output, rec, rehash=True)
        if why:
            problems[rec.file] = why
    if st.finalized is not None:
        # the shards were just re-hashed against their own records: the rest (config.json, index, tokenizer...)
        problems.update(journal.verify_files(output, journal.not_shards(st.finalized.files, st.shards)))
        job = st.header.job
        if load_check and not problems and job.get("export", {}).get("format", "compressed-tensors") == \
                "compressed-tensors":
            report = load_report(output, (job.get("source") or {}).get("allow_remote_code", False))
            problem = load_problems(report)
            if problem:
                problems[LOADER] = problem
    return problems


def load_report(output: str, trust_remote_code: bool = False) -> LoadReport:
    """transformers' loader on a finished export folder, run in a child process (torch stays out of the CLI)."""
    cmd = [sys.executable, "-P", "-m", "child.loadcheck", output, "--json"]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")), None)
    if line is None:
        tail = " ".join(proc.stderr.strip().splitlines()[-1:])
        return LoadReport(checked=True, error=f"the loader check did not run ({tail or f'exit {proc.returncode}'})")
    return msgspec.json.decode(line, type=LoadReport)
