"""The warm parent: `python -P -m child.zygote --sock-fd S --parent-pid P --format F`.

Imports torch, transformers and the backend's libraries once (several seconds), never touches CUDA, then forks
a worker whenever the supervisor asks, so a worker starts (or restarts after a crash) in well under a second:

    supervisor ──{"fork": {env, argv}} + fds (read, write, stdout, stderr) over a SOCK_SEQPACKET socket──▶ zygote
               ◀── {"ready"} once, {"forked": pid} per fork, {"exited": pid, "code"} per reaped worker ──
    forked worker: the given stdout/stderr fds (pipes the supervisor pumps), its own environment (CUDA_VISIBLE_DEVICES), then child.__main__.main

A forked worker is as isolated as a spawned one: its own process, pipes, CUDA context (CUDA is first touched
after the fork; PYTORCH_NVML_BASED_CUDA_CHECK keeps the imports' availability checks from initialising it) and
a parent-death signal (the zygote's); a crashed worker's state never reaches the next one, which is forked
from the zygote, not from it. The zygote itself dies with the supervisor (parent-death signal) or when the
socket closes; it must never run tensor work (OpenMP thread pools do not survive a fork) and never import the
supervisor package.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback

from shared import nvml

PR_SET_PDEATHSIG = 1
MAX_MSG = 1 << 20


def _set_parent_death_signal() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


def _send(sock: socket.socket, msg: dict) -> None:
    sock.send(json.dumps(msg).encode())


def _worker(sock: socket.socket, wake_r: int, wake_w: int, req: dict, fds: list[int], zygote_pid: int) -> None:
    """In the forked child: become a worker; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        os.close(wake_r)
        os.close(wake_w)
        read_fd, write_fd, out_fd, err_fd = fds
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        os.environ.clear()
        os.environ.update(req["env"])
        from child.__main__ import main

        code = main(req["argv"] + ["--read-fd", str(read_fd), "--write-fd", str(write_fd),
                                   "--parent-pid", str(zygote_pid)])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a worker must never fall back into the zygote's loop
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket, parent_pid: int) -> int:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
    signal.set_wakeup_fd(wake_w)
    me = os.getpid()
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [], 1.0)
        if os.getppid() != parent_pid:
            return 3  # the supervisor is gone; our workers follow us (their parent-death signal)
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock)
        if sock not in ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 4)
        if not msg:
            return 0  # the supervisor closed the socket: done
        req = json.loads(msg)["fork"]
        sys.stdout.flush()
        sys.stderr.flush()
        if threading.active_count() > 1:
            print(f"zygote: {threading.active_count()} threads alive at fork", file=sys.stderr, flush=True)
        pid = os.fork()
        if pid == 0:
            _worker(sock, wake_r, wake_w, req, fds, me)
        for fd in fds:
            os.close(fd)
        _send(sock, {"forked": pid})
        _reap(sock)


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
    that use it (measured on an H200 machine: every import of child.quantize left CUDA initialised). NVML gives
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m child.zygote")
    ap.add_argument("--sock-fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--format", default="compressed-tensors")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides how we stop, not the terminal
    _set_parent_death_signal()
    if os.getppid() != args.parent_pid:
        return 3
    sock = socket.socket(fileno=args.sock_fd)
    # torch's availability checks (run by imports such as llm-compressor's) then use NVML and leave CUDA alone
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    # torch.utils._triton.has_triton() reads the GPU's properties, which initialises CUDA; torchao's modules call
    # it at import (transformers imports torchao when it is installed): measured on an H200 machine, that made
    # every import touch CUDA. With device detection off during the imports it answers False without touching
    # the GPU; it is turned back on (and its cached answer dropped) before any worker is forked.
    os.environ["TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION"] = "1"
    t = time.perf_counter()
    try:
        import torch

        from child.backend import preload

        with _capability_from_nvml(torch):
            preload(args.format)
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
        import gc

        # Move the ~0.5M objects the imports made out of the collector's reach: a worker's per-layer
        # gc.collect() then scans only what it made since (measured: 0.33 s -> 0.008 s a layer), and the
        # collector does not write into (copy) the pages every forked worker shares with us.
        gc.freeze()
    except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, which fails the start clearly
        traceback.print_exc()
        _send(sock, {"failed": f"{type(exc).__name__}: {exc}"})
        return 1
    _send(sock, {"ready": True, "pid": os.getpid(), "seconds": round(time.perf_counter() - t, 3),
                 "forkable": forkable})
    return serve(sock, args.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
