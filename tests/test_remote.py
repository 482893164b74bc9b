"""The run's port under pressure (supervisor/cluster/remote.py's Listener), without Ray: idle connections never hold more
than MAX_HANDSHAKES of its files and a worker still gets in; running out of files (EMFILE) pauses accepting
instead of ending it; refusals are reported at a bounded rate."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from supervisor.cluster import channel, node_agent, remote

HOST = "127.0.0.1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dial(listener: remote.Listener, timeout: float = 10.0):
    token = os.urandom(channel.TOKEN_BYTES)
    arrived = listener.expect(token)
    dialed = node_agent.dial(HOST, listener.port, token, channel.worker_key(listener.secret, token), None, 5,
                             time.monotonic() + timeout)
    sock = arrived.result(5)
    listener.forget(token, taken=True)
    return sock, dialed


def test_idle_connections_hold_at_most_max_handshakes_and_a_worker_still_gets_in():
    """300 idle connections kept open: the port holds at most MAX_HANDSHAKES of them (the least advanced, oldest
    ones are closed as new ones come), and a worker connecting among them is handed over."""
    refused = []
    listener = remote.Listener(HOST, lambda peer, reason: refused.append(reason))
    idle = []
    try:
        for _ in range(300):
            idle.append(socket.create_connection((HOST, listener.port)))
        deadline = time.monotonic() + 10
        while len(refused) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert listener.in_flight <= remote.MAX_HANDSHAKES
        sock, dialed = _dial(listener)
        os.write(dialed.fd, b"ok")
        assert sock.recv(2) == b"ok"
        assert listener.in_flight <= remote.MAX_HANDSHAKES
        assert any("handshakes in flight" in r for r in refused), refused
    finally:
        for s in idle:
            s.close()
        listener.close()


# Run in a process of its own: it lowers its file limit below what the flood needs.
_EMFILE = r"""
import json, logging, os, resource, socket, subprocess, sys, time
from supervisor.cluster import channel, node_agent, remote

warnings = []
class Catch(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("supervisor").addHandler(Catch())
listener = remote.Listener("127.0.0.1", lambda peer, reason: None)
flood = subprocess.Popen([sys.executable, "-m", "tests.cluster.flood", "127.0.0.1", str(listener.port), "300"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 30, hard))
flood.stdout.readline()
deadline = time.monotonic() + 30
while not any("cannot accept" in w for w in warnings) and time.monotonic() < deadline:
    time.sleep(0.05)
saw_emfile = any("cannot accept" in w for w in warnings)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
token = os.urandom(channel.TOKEN_BYTES)
arrived = listener.expect(token)
dialed = node_agent.dial("127.0.0.1", listener.port, token, channel.worker_key(listener.secret, token), None, 5,
                         time.monotonic() + 30)
got = arrived.result(10)
flood.stdin.close()
flood.wait(10)
print(json.dumps({"emfile": saw_emfile, "connected": got is not None, "warnings": warnings[:3]}))
listener.close()
"""


def test_out_of_files_the_port_pauses_and_goes_on_accepting():
    """A port whose process runs out of files while a flood keeps 300 connections open: accept fails with
    EMFILE, the port backs off (logged once) instead of stopping, and once files are free a worker connects."""
    out = subprocess.run([sys.executable, "-c", _EMFILE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["emfile"] and got["connected"], got
    assert any("Too many open files" in w for w in got["warnings"]), got


def _foreign_connections(listener, count: int) -> None:
    """`count` connections that send bytes no handshake starts with, one after another, each until the port closed
    it (refused: the count is bumped in the same turn of the port's loop as the close)."""
    for _ in range(count):
        with socket.create_connection((HOST, listener.port)) as s:
            s.sendall(b"\xff" * 8)
            s.settimeout(5)
            try:
                s.recv(1)
            except ConnectionResetError:
                pass


def test_refusals_are_reported_one_by_one_then_counted(monkeypatch):
    """60 foreign connections: the first REFUSALS_SHOWN of a window are reported one by one, the others in one
    count when the window ends; none is lost from the count."""
    monkeypatch.setattr(remote, "REFUSAL_WINDOW", 0.5)
    reports = []
    listener = remote.Listener(HOST, lambda peer, reason: reports.append((peer, reason)))
    try:
        _foreign_connections(listener, 60)
        deadline = time.monotonic() + 10
        while not any("more connections refused" in r for _, r in reports) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        listener.close()
    single = [r for _, r in reports if "more connections refused" not in r]
    counted = [r for _, r in reports if "more connections refused" in r]
    assert len(single) >= remote.REFUSALS_SHOWN and counted, reports
    total = len(single) + sum(int(r.split()[0]) for r in counted)
    assert total == 60 and len(reports) < 30, reports
    assert all("not our handshake" in r for r in single), single


def test_refusals_still_held_when_the_port_closes_are_reported_in_one_count(monkeypatch):
    """A port closed inside a refusal window reports the count it held (a run shorter than the window loses none)."""
    monkeypatch.setattr(remote, "REFUSAL_WINDOW", 3600.0)
    reports = []
    listener = remote.Listener(HOST, lambda peer, reason: reports.append((peer, reason)))
    try:
        _foreign_connections(listener, 20)
        assert not any("more connections refused" in r for _, r in reports), reports  # the window is not over
    finally:
        listener.close()
    counted = [r for _, r in reports if "more connections refused" in r]
    assert len(reports) == remote.REFUSALS_SHOWN + 1 and len(counted) == 1, reports
    assert counted[0].startswith(f"{20 - remote.REFUSALS_SHOWN} more connections refused"), counted


def test_close_stops_the_port_at_once():
    """close() returns within a second with connections in handshake, and the port refuses new ones."""
    listener = remote.Listener(HOST, lambda peer, reason: None)
    idle = [socket.create_connection((HOST, listener.port)) for _ in range(5)]
    t = time.monotonic()
    listener.close()
    assert time.monotonic() - t < 1.0
    try:
        socket.create_connection((HOST, listener.port), timeout=2).close()
        refused = False
    except OSError:
        refused = True
    assert refused
    for s in idle:
        s.close()
