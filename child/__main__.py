"""Child worker entry point: `python -m child --read-fd R --write-fd W --parent-pid P`.

Parses the pipe fds and the parent pid, takes the process's own precautions (Ctrl-C ignored, faulthandler, the
parent-death signal, the parent check: child/process.py), then hands the pipes to child.exporter.serve.
stdout/stderr belong to the libraries (the supervisor pumps them into the worker log and LogLine events).
It exits on Stop, on EOF from the supervisor, or when its parent dies (parent-death signal, plus a check of
the parent pid in the heartbeat thread), and it writes nothing after its parent is gone.
It must never import the supervisor package.
"""
from __future__ import annotations

import argparse
import faulthandler
import signal
import sys

from child import bytecode, faults, process
from child.exporter import serve
from shared.framing import FrameError, Reader, Writer
from shared.messages import ToChild


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m child")
    ap.add_argument("--read-fd", type=int, required=True)
    ap.add_argument("--write-fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, default=0)
    args = ap.parse_args(argv)
    # Ctrl-C reaches the whole process group; the supervisor decides how we stop, not the terminal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    bytecode.cache_imports()  # before the imports (lazy, in serve); a forked worker's warm parent did it already
    process.adopt(args.parent_pid)
    faulthandler.enable()  # a segfault leaves a Python traceback in the worker log
    process.set_parent_death_signal()
    process.parent_alive()
    faults.load()
    reader, writer = Reader(args.read_fd, ToChild), Writer(args.write_fd)
    try:
        return serve(reader, writer, args.parent_pid)
    except (FrameError, BrokenPipeError) as exc:
        print(f"child: pipe error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
