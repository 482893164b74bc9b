"""Helpers for scenario suites: run the real `supervisor` console script on tiny models, as a user would."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

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


# A command started as a terminal starts it, whatever this test process inherited: `cmd &` in a non-interactive
# shell (and nohup) starts it with SIGINT and SIGQUIT (nohup: SIGHUP) ignored, a CI runner may ignore or block others,
# and exec keeps an ignored signal ignored and the blocked mask (Popen's restore_signals resets SIGPIPE and SIGXFSZ
# only). This trampoline sets every catchable signal to its default, unblocks all and execs the command, so the
# process Popen returns is the command itself. It runs in a fresh interpreter, not in a preexec_fn: this process has
# threads (torch's, the tests' readers), and Python code between fork and exec may then deadlock.
# It also drops the variables that make rich render for a terminal into the tests' pipes (FORCE_COLOR=1, set by many
# CI setups, gives ANSI codes, a live progress bar and 80 columns; COLUMNS another width): what the tests read is the
# CLI's output into a pipe or file, whatever the environment the suite was started in.
TERMINAL_ONLY_ENV = ("FORCE_COLOR", "NO_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS",
                     "LINES", "JUPYTER_COLUMNS", "JUPYTER_LINES")
_AS_A_TERMINAL = (
    "import os, signal, sys\n"
    "for s in signal.Signals:\n"
    "    if s < signal.SIGRTMIN and s not in (signal.SIGKILL, signal.SIGSTOP):\n"
    "        signal.signal(s, signal.SIG_DFL)\n"
    "signal.pthread_sigmask(signal.SIG_SETMASK, ())\n"
    f"for k in {TERMINAL_ONLY_ENV!r}:\n"
    "    os.environ.pop(k, None)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n")


def as_a_terminal(cmd) -> list[str]:
    """cmd (argv), run with every signal at its default, none blocked, and no TERMINAL_ONLY_ENV (_AS_A_TERMINAL)."""
    return [sys.executable, "-I", "-S", "-c", _AS_A_TERMINAL, *map(str, cmd)]


_started: list[tuple[subprocess.Popen, int]] = []  # every start() and the thread it was called from: end_started()
_started_lock = threading.Lock()


def start(cmd, *, env=None, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **popen) -> subprocess.Popen:
    """Start cmd (argv; env: its whole environment, default ours) as a terminal starts a job: signals at their
    defaults, stdin /dev/null (never this process's terminal or pipe), and a process group of its own, in a session
    of its own (no controlling terminal, whatever this process has), so a signal to its group reaches the job and
    nothing else. The group's id is proc.pid. End it with end_group() (or start it with `job`); what a test leaves
    running is ended after it anyway (tests/conftest.py)."""
    proc = subprocess.Popen(as_a_terminal(cmd), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            env=dict(os.environ) if env is None else env, start_new_session=True, **popen)
    with _started_lock:
        _started.append((proc, threading.get_ident()))
    return proc


def group_left(proc: subprocess.Popen) -> list:
    """The processes (psutil; zombies left out) still in proc's process group: proc, its warm parent, its workers.

    While the group has a member its id cannot be any new process's pid; so once proc is reaped, a process with
    proc's pid is another's, and so is its group (nothing is ours then)."""
    import psutil

    if proc.returncode is not None and psutil.pid_exists(proc.pid):
        return []
    left = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except (psutil.Error, OSError):
            pass  # gone meanwhile
    return left


def end_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGKILL what is left of proc's process group (proc included), reap proc, and wait until the group is gone."""
    if proc.returncode is None:  # not reaped: its pid, and so its group's id, are still ours
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    else:
        for p in group_left(proc):
            with contextlib.suppress(Exception):
                p.kill()
    proc.wait(timeout)
    deadline = time.monotonic() + timeout
    while group_left(proc):
        assert time.monotonic() < deadline, f"process group {proc.pid} still running {timeout}s after SIGKILL"
        time.sleep(0.05)


@contextlib.contextmanager
def job(cmd, **kwargs):
    """`with job([SUPERVISOR, "run", ...], ...) as proc:` start() it; on leaving, however, end_group() it."""
    proc = start(cmd, **kwargs)
    try:
        yield proc
    finally:
        end_group(proc)


def started() -> int:
    with _started_lock:
        return len(_started)


def end_started(since: int = 0) -> None:
    """end_group() every process this thread start()ed since the since-th start() (a failed test's run, still
    going, or its workers). Other threads' (faultkit.Background's exports for later tests) are left alone."""
    me = threading.get_ident()
    with _started_lock:
        mine = [entry for entry in _started[since:] if entry[1] == me]
        _started[:] = [entry for entry in _started if entry not in mine]
    for proc, _ in mine:
        end_group(proc)


# The product's test-only knobs (child/faults.py, supervisor/run/verbatim.py, supervisor/run/sequence.py): a run gets those its test
# passes, never one left in the environment the suite was started from.
TEST_KNOBS = ("SUPERVISOR_TEST_FAULT", "SUPERVISOR_TEST_NO_COPY_AHEAD", "SUPERVISOR_TEST_PLAN_BESIDE",
              "SUPERVISOR_TEST_TENSOR_LOG", "SUPERVISOR_TEST_STAGE_HOST", "SUPERVISOR_TEST_PLACE_SECONDS")


def run_env(env=None) -> dict[str, str]:
    """Our environment without TEST_KNOBS, plus env."""
    full_env = {k: v for k, v in os.environ.items() if k not in TEST_KNOBS}
    full_env.update(env or {})
    return full_env


def run(*args, env=None, timeout=600, check=True) -> subprocess.CompletedProcess:
    full_env = run_env(env)
    # signals at their defaults and stdin /dev/null, as in start(); in our process group (a timeout kills the
    # supervisor, and its warm parent and workers die with it)
    proc = subprocess.run(as_a_terminal([SUPERVISOR, *args]), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, env=full_env)
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
    proc = subprocess.run(as_a_terminal([sys.executable, "-m", "supervisor.cli", "run", job]), cwd=cwd,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert tree(root) == before
