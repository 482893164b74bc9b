"""A connection flood for the cluster tests: `python -m tests.cluster.flood HOST PORT COUNT` keeps COUNT idle
connections open to HOST:PORT (raising its own file limit to hold them); a connection the other end closes is
dialled again, at most REDIAL_PER_SECOND a second, so the pressure lasts. It never sends a byte.

Prints {"dialled": N, "open": M} once COUNT connections were dialled, then once a second; ends when stdin closes.
"""
from __future__ import annotations

import json
import resource
import selectors
import socket
import sys
import threading
import time

REDIAL_PER_SECOND = 200


def main() -> int:
    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = count * 2 + 64
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want) if hard != resource.RLIM_INFINITY else hard))
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    sel = selectors.DefaultSelector()
    dialled = 0

    def dial() -> None:
        nonlocal dialled
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, port))
        sel.register(s, selectors.EVENT_READ)
        dialled += 1

    for _ in range(count):
        dial()
    print(json.dumps({"dialled": dialled, "open": len(sel.get_map())}), flush=True)
    owed, budget_at, budget, said = 0, time.monotonic(), REDIAL_PER_SECOND, time.monotonic()
    while not done.is_set():
        for key, _ in sel.select(0.1):
            try:
                data = key.fileobj.recv(1)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # the other end closed it (or refused it): dial another
                sel.unregister(key.fileobj)
                key.fileobj.close()
                owed += 1
        now = time.monotonic()
        if now - budget_at >= 1.0:
            budget_at, budget = now, REDIAL_PER_SECOND
        while owed and budget:
            dial()
            owed, budget = owed - 1, budget - 1
        if now - said >= 1.0:
            said = now
            print(json.dumps({"dialled": dialled, "open": len(sel.get_map())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
