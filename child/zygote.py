"""The warm parent: `python -P -m child.zygote --sock-fd S --parent-pid P --format F` (one run's), or
`python -P -m child.zygote --listen PATH --idle SECONDS --format F` (kept warm between runs).

Imports torch, transformers and the backend's libraries once (several seconds), never touches CUDA, then forks
a worker whenever the supervisor asks, so a worker starts (or restarts after a crash) in well under a second:

    supervisor ──{"fork": {env, argv}} + fds (read, write, stdout, stderr, [listen]) over SOCK_SEQPACKET──▶ zygote
               ◀── {"ready"} once, {"forked": pid} per fork, {"exited": pid, "code"} per reaped worker ──
    forked worker: the given stdout/stderr fds (pipes the supervisor pumps), its own environment (CUDA_VISIBLE_DEVICES), then child.__main__.main

A forked worker is as isolated as a spawned one: its own process, pipes, CUDA context (CUDA is first touched
after the fork; PYTORCH_NVML_BASED_CUDA_CHECK keeps the imports' availability checks from initialising it) and
a parent-death signal (the zygote's); a crashed worker's state never reaches the next one, which is forked
from the zygote, not from it. The zygote itself dies with the supervisor (parent-death signal) or when the
socket closes; it must never run tensor work (OpenMP thread pools do not survive a fork) and never import the
supervisor package.

Kept warm (`resources.keep_warm`, supervisor/workers/zygote.py): the zygote listens on a Unix socket in a folder only its
user can open, in a session of its own (no parent-death signal: it outlives the run that started it) and serves
one run at a time: each connection gets {"ready"} at once (no imports: they are done) and its own workers. When a
connection closes (the run ended, or its supervisor was killed) the zygote SIGKILLs and reaps every worker it
forked for it before it accepts the next, so no worker outlives its supervisor and none is shared between runs.
After SECONDS without a connection it removes its socket and exits.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback

from child import bytecode
from shared import nvml
from shared.messages import LISTEN_FD_ENV

PR_SET_PDEATHSIG = 1
MAX_MSG = 1 << 20


def _set_parent_death_signal() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def _worker(socks: list[socket.socket], wake_r: int, wake_w: int, req: dict, fds: list[int],
            zygote_pid: int) -> None:
    """In the forked child: become a worker; never returns (a worker must never fall back into the zygote's loop)."""

    def become() -> int:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for s in socks:
            s.close()
        os.close(wake_r)
        os.close(wake_w)
        read_fd, write_fd, out_fd, err_fd, *listening = fds
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        os.environ.clear()
        os.environ.update(req["env"])
        if listening:  # a group's rank 0: its store's socket, bound by the supervisor (child.backends.group)
            os.environ[LISTEN_FD_ENV] = str(listening[0])
        if "umask" in req:  # the run's, not the run's that started a kept zygote
            os.umask(req["umask"])
        if "cwd" in req:
            os.chdir(req["cwd"])
        from child.__main__ import main

        return main(req["argv"] + ["--read-fd", str(read_fd), "--write-fd", str(write_fd),
                                   "--parent-pid", str(zygote_pid)])

    _exit_after(become)


def _exit_after(body) -> None:
    """Run `body` and leave the process with its exit code through os._exit, never returning: not the
    interpreter's teardown, which for the zygote (everything the imports built) took 0.3 s on the development VM
    after every run, and which nothing here needs (workers reaped, a kept zygote's socket removed, output flushed).
    SystemExit gives its code (argparse's usage errors, `supervisor warm --stop`'s SIGTERM); anything else is
    printed and exits 1."""
    code = 1
    try:
        code = body()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(sock: socket.socket, mine: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        mine.discard(pid)
        try:
            _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        except OSError:
            pass  # the run is gone; its workers are being killed


def _kill(pids: set[int]) -> None:
    """SIGKILL and reap a closed connection's workers: none outlives the run it was forked for."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    pids.clear()


def serve(sock: socket.socket, parent_pid: int, wake: tuple[int, int], listener: socket.socket | None = None) -> int:
    """Fork workers for one run until its socket closes; then kill those still alive. parent_pid 0: kept warm (no
    parent to watch)."""
    wake_r, wake_w = wake
    me = os.getpid()
    mine: set[int] = set()
    socks = [sock] if listener is None else [sock, listener]
    try:
        while True:
            ready, _, _ = select.select([sock, wake_r], [], [], 1.0)
            if parent_pid and os.getppid() != parent_pid:
                return 3  # the supervisor is gone
            if wake_r in ready:
                os.read(wake_r, 4096)
                _reap(sock, mine)
            if sock not in ready:
                continue
            try:
                msg, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 5)
            except OSError:
                msg, fds = b"", []
            if not msg:
                return 0  # the supervisor closed the socket (or died): this run is over
            req = json.loads(msg)["fork"]
            sys.stdout.flush()
            sys.stderr.flush()
            if threading.active_count() > 1:
                print(f"zygote: {threading.active_count()} threads alive at fork", file=sys.stderr, flush=True)
            pid = os.fork()
            if pid == 0:
                _worker(socks, wake_r, wake_w, req, fds, me)
            mine.add(pid)
            for fd in fds:
                os.close(fd)
            try:
                _send(sock, {"forked": pid})
            except OSError:
                return 0
            _reap(sock, mine)
    finally:
        _kill(mine)


def _wake_pipe() -> tuple[int, int]:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
    signal.set_wakeup_fd(wake_w)
    return wake_r, wake_w


def _accept(listener: socket.socket, timeout: float) -> socket.socket | None:
    """The next run's connection, or None after `timeout` seconds without one. (No worker lives between runs:
    serve() killed and reaped them, so nothing needs reaping here.)"""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([listener], [], [], left)
        if ready:
            try:
                conn, _ = listener.accept()  # cannot block: select() said it is ready
                return conn
            except OSError:
                continue


def _stop_listening(listener: socket.socket, path: str, info: str, bound: int) -> None:
    """Remove our socket and info files (unless another zygote has bound the path since: `bound` is the inode
    of the file our bind made), then close it."""
    try:
        if os.stat(path).st_ino == bound:
            os.unlink(path)
            os.unlink(info)
    except OSError:
        pass
    listener.close()


def _hash_triton_ahead() -> threading.Thread | None:
    """Start computing Triton's own key in a thread beside the imports; None where Triton is not installed.

    A process's first Triton kernel launch (compressed-tensors quantizes with Triton kernels on a GPU) hashes
    Triton's sources and its ~400 MB libtriton.so to key the on-disk kernel cache (`triton.runtime.cache.triton_key`,
    cached per process): 0.6 s of every fresh worker's first part on an H200 machine (2026-12-01,
    bench/first_part.py), against 0.1 s for the quantization itself. It needs no GPU, so the warm parent computes it
    once, while the main thread imports (hashing and file reads release the GIL), and every worker forked after it
    inherits the answer. Any failure leaves the worker to compute it itself, as before."""
    import importlib.util

    try:
        if importlib.util.find_spec("triton") is None:
            return None
        # imported here, not in the thread (Triton is imported anyway: compressed-tensors imports it), so the thread
        # imports at most Triton's own subpackages (pkgutil.walk_packages), which nothing the main thread imports
        # needs while it holds them
        from triton.runtime.cache import triton_key
    except Exception:  # noqa: BLE001 - an unusable Triton: its own importer reports it, as before
        return None

    def run() -> None:
        try:
            triton_key()
        except Exception:  # noqa: BLE001 - a head start only
            pass

    thread = threading.Thread(target=run, name="triton-key", daemon=True)
    thread.start()
    return thread


def _restore_triton_detection() -> None:
    os.environ.pop("TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION", None)
    try:
        import torch._inductor.config as inductor_config
        from torch.utils import _triton

        inductor_config.triton_disable_device_detection = False
        _triton.has_triton.cache_clear()
    except (ImportError, AttributeError):
        pass


def _nvml_capability(torch, device=None) -> tuple[int, int] | None:
    """A GPU's compute capability as NVML reports it: the answer torch.cuda.get_device_capability gives, without
    initialising CUDA; None where NVML cannot answer. The device index is torch's (CUDA_VISIBLE_DEVICES applied,
    ids or UUIDs)."""
    if device is None:
        index = 0  # the current device of a process that has not chosen one
    elif isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        index = 0 if device.index is None else device.index
    try:
        physical = torch.cuda._get_nvml_device_index(index)
    except (RuntimeError, ValueError, AttributeError):
        return None
    return nvml.cuda_capability(physical)


@contextlib.contextmanager
def _capability_from_nvml(torch):
    """While the backend's libraries import, answer torch.cuda.get_device_capability from NVML.

    torchao's modules ask for the GPU's capability at import (`is_sm_at_least_100()` in
    torchao/prototype/mx_formats/kernels.py, reached through transformers' torchao integration); torch answers
    from the device's properties, which initialises CUDA, and a process that initialised CUDA cannot fork workers
    that use it (measured on an H200 machine: every import of child.backends.quantize left CUDA initialised). NVML gives
    the same numbers without a CUDA context. Where NVML cannot answer, torch's own function runs (and the zygote
    then reports that it cannot fork). Restored as soon as the imports are done.
    """
    cuda = torch.cuda
    if cuda.is_initialized() or not os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"):
        yield
        return
    original = cuda.get_device_capability

    def get_device_capability(device=None):
        answer = _nvml_capability(torch, device)
        return original(device) if answer is None else answer

    cuda.get_device_capability = get_device_capability
    try:
        yield
    finally:
        cuda.get_device_capability = original


def _imports(fmt: str) -> tuple[float, bool]:
    """Import the backend's libraries without initialising CUDA; returns (seconds, forkable)."""
    # torch's availability checks (run by imports such as llm-compressor's) then use NVML and leave CUDA alone
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    # torch.utils._triton.has_triton() reads the GPU's properties, which initialises CUDA; torchao's modules call
    # it at import (transformers imports torchao when it is installed): measured on an H200 machine, that made
    # every import touch CUDA. With device detection off during the imports it answers False without touching
    # the GPU; it is turned back on (and its cached answer dropped) before any worker is forked.
    os.environ["TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION"] = "1"
    t = time.perf_counter()
    # No cyclic garbage collection while importing: the imports make ~0.6 M objects that all stay alive, and every
    # full collection on the way scanned all those made so far (6-7 of them, with ~80 younger ones): a quarter of
    # the imports' CPU time on the development VM (4.26 -> 3.10 s, docs/performance.md). What the collector would
    # have freed (~14k objects, 9 MB of module-level temporaries, no tensor) is frozen with the rest: a collection
    # to free it costs 0.45 s.
    gc.disable()
    try:
        import torch

        from child.imports import preload

        hashing = _hash_triton_ahead()
        with _capability_from_nvml(torch):
            preload(fmt)
        if hashing is not None:
            hashing.join()  # bounded: one hash of Triton's sources; no thread may run at a fork
    finally:
        # Move what the imports made out of the collector's reach before it runs again (enabled first, its next
        # collection would scan every one of them): a worker's per-layer gc.collect() then scans only what it made
        # since (measured: 0.33 s -> 0.008 s a layer), and the collector does not write into (copy) the pages every
        # forked worker shares with us.
        gc.freeze()
        gc.enable()
    _restore_triton_detection()
    from child import faults

    faults.load()
    forkable = not torch.cuda.is_initialized() and not getattr(torch.cuda, "_is_in_bad_fork", lambda: False)() \
        and not faults.asks("zygote", "unforkable")
    if not forkable:
        # some import touched CUDA on this machine: a forked worker could not use the GPU. Say so; the
        # supervisor then spawns fresh interpreters instead (slower to start, as safe).
        print("zygote: CUDA was initialised while importing; workers will be spawned, not forked",
              file=sys.stderr, flush=True)
    return time.perf_counter() - t, forkable


def _start(sock: socket.socket, fmt: str) -> tuple[float, bool] | None:
    """The imports, reported on `sock` as {"ready"} or {"failed"}; None when they failed."""
    try:
        seconds, forkable = _imports(fmt)
    except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, which fails the start clearly
        traceback.print_exc()
        _send(sock, {"failed": f"{type(exc).__name__}: {exc}"})
        return None
    _ready(sock, seconds, forkable, reused=False)
    return seconds, forkable


def _ready(sock: socket.socket, seconds: float, forkable: bool, reused: bool) -> None:
    _send(sock, {"ready": True, "pid": os.getpid(), "seconds": round(seconds, 3), "forkable": forkable,
                 "reused": reused})


def kept(path: str, idle: float, fmt: str) -> int:
    """Kept warm: bind `path`, import, then serve one run (connection) at a time until `idle` seconds pass
    without one."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `supervisor warm --stop`: clean up, kill workers
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(path)
    except OSError:
        return 0  # another zygote holds the path: the run that started us connects to that one
    listener.listen(8)
    bound = os.stat(path).st_ino
    info = path[: -len(".sock")] + ".json"
    try:
        with open(info + ".tmp", "w") as f:  # what `supervisor warm` lists
            json.dump({"pid": os.getpid(), "format": fmt, "idle": idle, "started": time.time(),
                       "python": sys.executable}, f)
        os.replace(info + ".tmp", info)
        conn = _accept(listener, 60.0)  # the run that started us connects at once
        if conn is None:
            return 0
        started = _start(conn, fmt)
        if started is None:
            return 1
        seconds, forkable = started
        wake = _wake_pipe()
        while conn is not None:
            serve(conn, 0, wake, listener)
            conn.close()
            conn = _accept(listener, idle)
            while conn is not None:
                try:
                    _ready(conn, seconds, forkable, reused=True)
                    break
                except OSError:  # that run went away before its answer
                    conn.close()
                    conn = _accept(listener, idle)
        return 0
    finally:
        _stop_listening(listener, path, info, bound)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m child.zygote")
    ap.add_argument("--sock-fd", type=int)
    ap.add_argument("--parent-pid", type=int, default=0)
    ap.add_argument("--listen", help="kept warm: the Unix socket path to serve runs on")
    ap.add_argument("--idle", type=float, default=300.0, help="kept warm: seconds without a run before exiting")
    ap.add_argument("--format", default="compressed-tensors",
                    help="the warm profile (shared.job.warm_profile): what the workers import")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides how we stop, not the terminal
    bytecode.cache_imports()  # before the imports: their bytecode where Python would keep none (child/bytecode.py)
    if args.listen:
        return kept(args.listen, args.idle, args.format)
    if args.sock_fd is None:
        ap.error("--sock-fd or --listen is required")
    _set_parent_death_signal()
    if os.getppid() != args.parent_pid:
        return 3
    sock = socket.socket(fileno=args.sock_fd)
    if _start(sock, args.format) is None:
        return 1
    return serve(sock, args.parent_pid, _wake_pipe())


if __name__ == "__main__":
    _exit_after(main)
