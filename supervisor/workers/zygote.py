"""The warm pool: a pre-imported parent (child/zygote.py) that forks workers on request.

    Zygote.start()  kept warm (keep_warm > 0, no live-model pool): connects to the zygote an earlier run left
                    running for this environment, or starts one that outlives this run (see KEPT below); else
                    python -P -m child.zygote for this run alone (stdout/stderr pumped into
                    OUT/.export/logs/zygote.log and on_log); waits for {"ready"}. In two steps: launch() (connect
                    or spawn) and wait_ready(); adopt() names the log of one launched before its run knew it
    EarlyStart      a run's warm parent launched as its job is read (supervisor run), taken by the run's launcher
                    or discarded (a refused job leaves nothing of it)
    Zygote.fork()   sends {"fork": {env, argv}} with the worker's pipe ends and stdout/stderr fds (SCM_RIGHTS; a
                    group's rank 0 also its store's bound socket) and
                    returns a Forked (Popen-like: pid, poll, wait, terminate, kill) once the zygote says
                    {"forked": pid}; {"exited": pid, code} arrive on a reader thread and settle that Forked
    Zygote.close()  closes the socket (the zygote kills this run's workers; a run's own zygote then exits) and
                    waits for it

A fresh import of torch + transformers + llm-compressor costs 5-14 s; a fork costs milliseconds, so a worker
that dies is replaced at once. The zygote is spawned from the run's own thread, which lives until cleanup: a
parent-death signal fires when the thread that spawned a process ends. Owns that process and its socket only;
the worker protocol is supervisor.workers.worker's.

KEPT: a re-run after a crash, or the next export of a studio session, then starts its workers in a fork, not an
import (5-25 s). The kept zygote is found by a key: a hash of the interpreter, the environment it imports under
(minus a few variables nothing reads at import), the warm profile (shared.job.warm_profile: the format), the
child's and shared package's files (size, mtime)
and the installed libraries' versions, so it never serves a run whose imports would differ. Its socket, lock and
log live in a folder only this user can open ($XDG_RUNTIME_DIR, else the temp folder: supervisor-UID/KEY.*). A run
holds KEY.lock while it uses it; a second run at the same time starts a zygote of its own. It exits after
keep_warm seconds without a run; `supervisor warm --stop` stops it sooner.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from shared import durable
from supervisor.run import verbatim
from supervisor.workers.handle import Handle, pumped
from supervisor.workers.logpump import LogPump, OnLine
from supervisor.workers.worker import CancelledWait, describe_exit

MAX_MSG = 1 << 20
FORK_SECONDS = 60.0  # a live warm parent answers a fork request in milliseconds; past this it is taken for wedged
KEEP_WARM_ENV = "SUPERVISOR_KEEP_WARM"  # the default of resources.keep_warm (tests set 0)
DEFAULT_KEEP_WARM = 300.0
# Read after the fork (the worker's own environment), by the supervisor only, or by nothing at import: a run that
# differs only in these reuses a kept zygote. Everything else in the environment is part of the key.
_NOT_IN_KEY = {"PWD", "OLDPWD", "_", "SHLVL", "COLUMNS", "LINES", "SUPERVISOR_TEST_FAULT",
               "SUPERVISOR_TEST_TENSOR_LOG", verbatim.OFF_ENV, KEEP_WARM_ENV}
_LIBRARIES = ("torch", "transformers", "compressed-tensors", "llmcompressor", "accelerate", "safetensors",
              "torchao", "msgspec", "peft")
_kept_procs: list[subprocess.Popen] = []  # kept zygotes this process started: never collected while they run


def _umask() -> int:
    """This process's umask (a kept zygote has the umask of the run that started it; each worker takes its own
    run's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def keep_warm_seconds(configured: float | None) -> float:
    """resources.keep_warm, or SUPERVISOR_KEEP_WARM when the job leaves it unset, or 300 s."""
    if configured is not None:
        return configured
    raw = os.environ.get(KEEP_WARM_ENV, "")
    try:
        return max(0.0, float(raw)) if raw.strip() else DEFAULT_KEEP_WARM
    except ValueError:
        return DEFAULT_KEEP_WARM


def kept_dir() -> str | None:
    """This user's folder for kept zygotes, made 0700 if missing; None when it is not safely ours."""
    base = os.environ.get("XDG_RUNTIME_DIR") or ""
    if not os.path.isdir(base):
        import tempfile

        base = tempfile.gettempdir()
    path = os.path.join(base, f"supervisor-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def _code_stamp() -> list:
    """What the zygote imports from this repository, by file size and mtime, and the libraries' versions."""
    from shared.versions import installed

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = []
    for pkg in ("child", "shared"):  # the whole tree: a sub-package's module is served from the warm parent too
        root = os.path.join(here, pkg)
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(names):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    st = os.stat(path)
                    files.append([pkg, os.path.relpath(path, root), st.st_size, st.st_mtime_ns])
    versions = [[lib, v] for lib, v in installed(_LIBRARIES, None).items()]
    return [here, files, versions]


def kept_key(env: dict[str, str], fmt: str) -> str:
    kept_env = sorted((k, v) for k, v in env.items() if k not in _NOT_IN_KEY)
    blob = json.dumps([sys.executable, sys.version, fmt, kept_env, _code_stamp()])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def kept_parents() -> list[dict]:
    """This user's kept zygotes: pid, format, idle (seconds it stays without a run), started (epoch), in_use (a
    run holds it now), key. Stale entries (a zygote that was killed) are removed."""
    where = kept_dir()
    found = []
    if where is None:
        return found
    for name in sorted(os.listdir(where)):
        if not name.endswith(".json"):
            continue
        key = name[: -len(".json")]
        info_path = os.path.join(where, name)
        try:
            with open(info_path) as f:
                info = json.load(f)
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _is_kept_zygote(pid, os.path.join(where, f"{key}.sock")):
            for suffix in (".json", ".sock"):
                durable.unlink_quietly(os.path.join(where, key + suffix))
            continue
        fd = _try_lock(os.path.join(where, f"{key}.lock"))
        in_use = fd is None
        if fd is not None:
            os.close(fd)
        found.append({"pid": pid, "format": info.get("format"), "idle": info.get("idle"),
                      "started": info.get("started"), "in_use": in_use, "key": key})
    return found


def _is_kept_zygote(pid: int, path: str) -> bool:
    """Whether `pid` is still the kept zygote listening on `path` (not a recycled pid)."""
    import psutil

    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    return "child.zygote" in argv and path in argv


def _try_lock(path: str) -> int | None:
    """An fd holding an exclusive flock on `path` (created 0600), or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def stop_kept() -> tuple[list[dict], list[dict]]:
    """SIGTERM every kept zygote of this user that no run is using; returns (stopped, in use). One in use stays (its
    run's workers are its children): it exits after its run, keep_warm seconds later, or when stopped again."""
    stopped, busy = [], []
    for info in kept_parents():
        if info["in_use"]:
            busy.append(info)
            continue
        try:
            os.kill(info["pid"], signal.SIGTERM)
            stopped.append(info)
        except ProcessLookupError:
            pass
    return stopped, busy


def run_env(devices: list[str]) -> dict[str, str]:
    """The environment a run's warm parent imports under (part of a kept one's key): this process's, unbuffered,
    and no GPU visible when the run's only device is the CPU (supervisor.workers.devices.child_env)."""
    from supervisor.workers import devices as devs

    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return devs.child_env("cpu", env) if devices == ["cpu"] else env


class EarlyStart:
    """A run's warm parent launched as soon as its job is read (supervisor.api.Supervisor), before the source, the
    output and the plan are checked, so that its imports (most of a cold start) overlap the supervisor's own: its
    imports, the checkpoint's headers, the fingerprint, the journal. Launched on the spawner thread the run then
    keeps (a zygote's parent-death signal fires when the thread that spawned it ends); its own zygote's log lines
    wait in memory until the run names the log file (Zygote.adopt), so nothing is written before the checks.

    The run's launcher takes it (supervisor.run.launch.Launcher.start_zygote) when the plan asks for the same
    environment, profile and keep_warm, and discards it otherwise; a run refused or ended before then closes it
    (close): its zygote ends, a kept zygote it spawned too, with its files."""

    def __init__(self, env: dict[str, str], fmt: str, startup_timeout: float, keep_warm: float):
        self.env, self.fmt, self.keep_warm = env, fmt, keep_warm
        self.zygote = Zygote(env, None, fmt, startup_timeout, keep_warm=keep_warm)
        self.spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")
        self._launched = self.spawner.submit(self.zygote.launch)

    def matches(self, env: dict[str, str], fmt: str, keep_warm: float, pass_fds: tuple[int, ...]) -> bool:
        return not pass_fds and (env, fmt, keep_warm) == (self.env, self.fmt, self.keep_warm)

    def adopt(self, log_path: str, on_log: OnLine | None, cancelled: Callable[[], bool]) -> None:
        """On the spawner thread, so after the launch (one thread, in order): its outcome, the log named, then the
        zygote's {"ready"}; raises ZygoteLost or CancelledWait (the zygote closed)."""
        try:
            self._launched.result()  # cannot block: the launch ran before this, on the same thread
            self.zygote.adopt(log_path, on_log)
            self.zygote.wait_ready(cancelled)
        except BaseException:
            self.zygote.close()
            raise

    def discard(self) -> None:
        """The run does not use it: end its zygote, after the launch, on the spawner thread."""
        self.spawner.submit(self.zygote.discard).result()

    def close(self) -> None:
        """The run ended before its launcher took it: discard it and end the spawner thread."""
        try:
            self.discard()
        finally:
            self.spawner.shutdown(wait=True)


class ZygoteLost(Exception):
    """The zygote died or could not start; `log_tail` holds the end of its log."""

    def __init__(self, reason: str, log_tail: str = ""):
        super().__init__(reason)
        self.reason, self.log_tail = reason, log_tail


class Forked(Handle):
    """A worker forked by the zygote (a ProcessHandle, supervisor/workers/handle.py): its exit arrives on the
    zygote's socket and settles it."""

    def __init__(self, pid: int, zygote: "Zygote"):
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote
        self._settled = threading.Event()
        try:
            self._pidfd = os.pidfd_open(pid)  # signals through it cannot hit a recycled pid
        except (OSError, AttributeError):
            self._pidfd = None

    def _settle(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._settled.set()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _exited(self, timeout: float | None) -> bool:
        if timeout == 0:
            return self._settled.is_set()
        return self._settled.wait(timeout)

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, OSError):
            pass


class Zygote:
    def __init__(self, env: dict[str, str], log_path: str | None, fmt: str, startup_timeout: float,
                 pass_fds: tuple[int, ...] = (), on_log: OnLine | None = None, keep_warm: float = 0.0):
        self.env, self.log_path, self.fmt, self.startup_timeout = env, log_path, fmt, startup_timeout
        # a live model's pool fds are this run's: a zygote that inherits them cannot serve another run
        self.keep_warm = 0.0 if pass_fds else keep_warm
        self.kept = False  # serving from a kept zygote (started by this run or an earlier one)
        self.reused = False  # an earlier run's kept zygote: no imports in this run
        self.pid: int | None = None
        self._lock_fd: int | None = None
        self.pass_fds = pass_fds  # inherited by the zygote and so by every worker it forks (a live model's pool)
        self.on_log = on_log  # its import-time lines (library warnings) as LogLine events, like a worker's
        self._pump: LogPump | None = None
        self.proc: subprocess.Popen | None = None
        self.seconds = 0.0  # its import time, reported by itself
        self.forkable = True  # False: the imports touched CUDA, so workers must be spawned, not forked
        self._ready = False  # its {"ready"} came
        self._sock: socket.socket | None = None
        self._replies: queue.Queue = queue.Queue()
        self._children: dict[int, Forked] = {}
        self._early_exits: dict[int, int] = {}
        self._lock = threading.Lock()  # one fork request at a time
        self._state = threading.Lock()
        self._reader: threading.Thread | None = None
        self._lost: str | None = None

    @property
    def alive(self) -> bool:
        if self._sock is None or self._lost is not None:
            return False
        return self.kept or (self.proc is not None and self.proc.poll() is None)

    def start(self, cancelled: Callable[[], bool]) -> None:
        """Connect to a kept zygote or spawn one, and wait until it has imported everything; raises ZygoteLost."""
        self.launch(cancelled)
        self.wait_ready(cancelled)

    def launch(self, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Connect to a kept zygote (waiting for its {"ready"}: it has imported already) or spawn one (kept, or this
        run's own), without waiting for the new one's imports (wait_ready does); raises ZygoteLost."""
        try:
            if self.keep_warm > 0 and self._launch_kept(cancelled):
                return
            self._launch_private()
        except BaseException:
            self.close()  # and release the kept zygote's lock, so a later run in this process may use it
            raise

    def wait_ready(self, cancelled: Callable[[], bool]) -> None:
        """Wait for a launched zygote's {"ready"} (at once for a kept one that had imported); raises ZygoteLost."""
        try:
            if not self._ready:
                self._wait_ready(cancelled)
        except BaseException:
            self.close()
            raise

    def adopt(self, log_path: str, on_log: OnLine | None) -> None:
        """A zygote launched before its run knew where its log goes (EarlyStart): its own zygote's output goes to
        `log_path` and `on_log` from now on, what it printed so far first. A kept one writes its own log."""
        if self._pump is not None:
            os.makedirs(os.path.dirname(log_path), exist_ok=True)
            self.log_path, self.on_log = log_path, on_log
            self._pump.attach(log_path, on_log)

    def discard(self) -> None:
        """close(), and end a kept zygote this object spawned, with its files: it was started for a run that did not
        use it (refused before its first worker), so none of that run's processes or files stay behind. The lock is
        held until its files are gone, so no other run's zygote at the same path loses its socket."""
        if self.proc is not None and not self.kept and self.proc.poll() is None:
            self.proc.kill()  # this run's own: no files, no workers yet, likely mid-import (it reads no socket then)
            self.proc.wait()  # bounded: after SIGKILL
        spawned = self.proc if self.kept else None
        if spawned is not None:
            if spawned.poll() is None:
                spawned.terminate()  # it removes its socket and listing on SIGTERM (child/zygote.py kept)
                try:
                    spawned.wait(10)
                except subprocess.TimeoutExpired:
                    spawned.kill()
                    spawned.wait()  # bounded: after SIGKILL
            base = self.log_path[: -len(".log")]
            for suffix in (".log", ".sock", ".json"):
                durable.unlink_quietly(base + suffix)
        self.close()

    def _launch_private(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if self.log_path is not None:
            os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        cmd = [sys.executable, "-P", "-m", "child.zygote", "--sock-fd", str(theirs.fileno()),
               "--parent-pid", str(os.getpid()), "--format", self.fmt]
        try:
            self.proc, self._pump = pumped(
                lambda out_w, err_w: subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                                                      pass_fds=(theirs.fileno(), *self.pass_fds), close_fds=True,
                                                      env=self.env), self.log_path, self.on_log)
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self._connected(ours)

    def _launch_kept(self, cancelled: Callable[[], bool]) -> bool:
        """Serve from the kept zygote for this environment, starting it if none runs; False: none can be kept
        here (no private folder, or another run is using it), so the caller starts one for this run alone."""
        where = kept_dir()
        if where is None:
            return False
        key = kept_key(self.env, self.fmt)
        path = os.path.join(where, f"{key}.sock")
        if len(path.encode()) > 100:  # AF_UNIX paths are limited to 108 bytes
            return False
        fd = _try_lock(os.path.join(where, f"{key}.lock"))
        if fd is None:
            return False  # another run holds it now
        self._lock_fd, self.kept = fd, True
        self.log_path = os.path.join(where, f"{key}.log")
        sock = self._connect(path)
        if sock is not None:
            self._connected(sock)
            try:
                self._wait_ready(cancelled)
                return True
            except ZygoteLost:  # it reached its idle end as we connected: start another
                self._reset()
        self._spawn_kept(path)
        return True

    @staticmethod
    def _connect(path: str) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
            return None

    def _spawn_kept(self, path: str) -> None:
        """Start a zygote in a session of its own, listening on `path`, and connect to it."""
        durable.unlink_quietly(path)  # a socket left by one that was killed
        cmd = [sys.executable, "-P", "-m", "child.zygote", "--listen", path, "--idle", str(self.keep_warm),
               "--format", self.fmt]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,
                                         env=self.env, start_new_session=True, cwd="/")
        _kept_procs.append(self.proc)
        self.pid = self.proc.pid
        deadline = time.monotonic() + min(self.startup_timeout, 60.0)
        while True:
            sock = self._connect(path) if os.path.exists(path) else None
            if sock is not None:
                self._connected(sock)
                return
            if self.proc.poll() is not None:
                raise ZygoteLost(f"the worker parent (zygote) {describe_exit(self.proc.returncode)} before "
                                 "listening", self.log_tail())
            if time.monotonic() > deadline:
                self.proc.kill()
                raise ZygoteLost("the worker parent (zygote) did not open its socket", self.log_tail())
            time.sleep(0.01)

    def _connected(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lost = None
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _reset(self) -> None:
        """Forget a connection that failed before {"ready"}."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._reader is not None:
            self._reader.join(5)
            self._reader = None
        self._replies = queue.Queue()
        self.proc, self.pid = None, None

    def _wait_ready(self, cancelled: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if cancelled():
                self.close()
                raise CancelledWait()
            try:
                msg = self._replies.get(timeout=0.2)
            except queue.Empty:
                if self._lost is not None:
                    raise ZygoteLost(f"the worker parent (zygote) {self._lost}", self.log_tail()) from None
                if time.monotonic() > deadline:
                    self.close()
                    raise ZygoteLost(f"the worker parent (zygote) did not finish importing within "
                                     f"{self.startup_timeout:.0f}s", self.log_tail()) from None
                continue
            if "ready" in msg:
                self._ready = True
                self.seconds = msg.get("seconds", 0.0)
                self.forkable = msg.get("forkable", True)
                self.reused = bool(msg.get("reused"))
                self.pid = msg.get("pid", self.pid)
                return
            if "failed" in msg:
                self.close()
                raise ZygoteLost(f"the worker parent (zygote) failed to start: {msg['failed']}", self.log_tail())

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MSG)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            if "exited" in msg:
                with self._state:
                    child = self._children.pop(msg["exited"], None)
                    if child is None:
                        self._early_exits[msg["exited"]] = msg["code"]
                if child is not None:
                    child._settle(msg["code"])
            else:
                self._replies.put(msg)
        # The zygote is gone, or (kept) it has killed this run's workers on the socket's close: settle them as
        # killed.
        if self.kept:
            code = self.proc.poll() if self.proc is not None else None
            self._lost = "closed its socket" if code is None else describe_exit(code)
        else:
            self._lost = describe_exit(_reap(self.proc) if self.proc is not None else -9)
        with self._state:
            children, self._children = list(self._children.values()), {}
        for child in children:
            child._settle(-signal.SIGKILL)

    def fork(self, argv: list[str], env: dict[str, str], fds: tuple[int, int], out_fds: tuple[int, int],
             listen_fd: int | None = None) -> Forked:
        """A new worker running `python -m child` with argv + its pipe fds, `out_fds` as its stdout and stderr, and
        `listen_fd` (a group's rank 0: its store's bound socket, shared.messages.LISTEN_FD_ENV); raises ZygoteLost."""
        with self._lock:
            if not self.alive:
                raise ZygoteLost(f"the worker parent (zygote) {self._lost or 'is not running'}", self.log_tail())
            req = json.dumps({"fork": {"env": env, "argv": argv, "cwd": os.getcwd(), "umask": _umask()}}).encode()
            extra = [listen_fd] if listen_fd is not None else []
            try:
                socket.send_fds(self._sock, [req], [fds[0], fds[1], *out_fds, *extra])
            except OSError as exc:
                raise ZygoteLost(f"the worker parent (zygote) cannot be reached ({exc})", self.log_tail()) from exc
            deadline = time.monotonic() + FORK_SECONDS
            while True:
                try:
                    msg = self._replies.get(timeout=0.5)
                    break
                except queue.Empty:
                    if not self.alive:
                        raise ZygoteLost(f"the worker parent (zygote) {self._lost or 'died'} while forking",
                                         self.log_tail()) from None
                    if time.monotonic() > deadline:
                        # a late answer would be taken for the next request's: this warm parent is done with
                        self._lost = f"did not answer a fork request within {FORK_SECONDS:.0f}s"
                        try:
                            self._sock.shutdown(socket.SHUT_RDWR)  # its own end closes: it ends its workers
                        except OSError:
                            pass
                        raise ZygoteLost(f"the worker parent (zygote) {self._lost}", self.log_tail()) from None
            child = Forked(msg["forked"], self)
            with self._state:
                code = self._early_exits.pop(child.pid, None)
                if code is None:
                    self._children[child.pid] = child
            if code is not None:
                child._settle(code)
            return child

    def close(self) -> None:
        """Stop this run's use of the zygote (it kills this run's workers; a run's own zygote exits too) and wait
        for that; idempotent."""
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if not self.kept and self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()  # bounded: after SIGKILL
        if self._reader is not None:
            self._reader.join(5)
        if self._pump is not None:
            self._pump.join(5)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the next run may use the kept zygote now
            self._lock_fd = None

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path is None:  # launched early, not adopted yet: its lines are still in its pump
            return ""
        if self._pump is not None and self.proc is not None and self.proc.poll() is not None:
            self._pump.join(2)  # its last words may still be in the pipe
        elif self.kept and self.proc is not None:
            try:
                self.proc.wait(2)  # a kept zygote writes its log itself; let it finish dying
            except subprocess.TimeoutExpired:
                pass
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


def _reap(proc: subprocess.Popen, grace: float = 10.0) -> int:
    """The exit code of a warm parent whose socket closed: it is exiting; one that has not within `grace` seconds
    is killed (a wedged process must not hold the reader thread)."""
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()  # bounded: after SIGKILL
