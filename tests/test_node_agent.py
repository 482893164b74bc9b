"""What a node host waits on (supervisor/cluster/node_agent.py), without Ray: a worker whose supervisor's host vanishes
without closing the connection (its peer stops acknowledging) exits within about the heartbeat timeout
(TCP_USER_TIMEOUT, _bound_silence; in a network namespace of the test's own), and a warm parent that never answers
a fork request is given up within its deadline."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from supervisor.workers import zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SILENCE = 3.0  # the heartbeat timeout the host bounds the connection's silence by

# In `unshare -n`: the run's port and a node host's connection on loopback; the worker stands in with the child's
# own heartbeat thread (child.process.Beat: a heartbeat a second, os._exit(3) when a write fails); then loopback
# goes down, so nothing is acknowledged any more and no FIN or RST ever comes.
_SCRIPT = r"""
import json, os, select, subprocess, sys, time
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
from supervisor.cluster import channel, node_agent, remote
listener = remote.Listener("127.0.0.1", lambda peer, reason: None)
token = os.urandom(channel.TOKEN_BYTES)
arrived = listener.expect(token)
dialed = node_agent.dial("127.0.0.1", listener.port, token, channel.worker_key(listener.secret, token), None,
                         float(sys.argv[1]), time.monotonic() + 10)
supervisor_end = arrived.result(5)
worker = subprocess.Popen([sys.executable, "-c",
                           "import sys, time\n"
                           "from child.process import Beat\n"
                           "from shared.framing import Writer\n"
                           "Beat(Writer(int(sys.argv[1])), 0).start()\n"
                           "time.sleep(600)\n", str(dialed.fd)], pass_fds=(dialed.fd,))
dialed.close()
beat = select.select([supervisor_end], [], [], 30)[0]  # its first heartbeat arrived: it runs
subprocess.run(["ip", "link", "set", "lo", "down"], check=True)
t = time.monotonic()
try:
    code = worker.wait(60)
except subprocess.TimeoutExpired:
    code = None
    worker.kill()
print(json.dumps({"beat": bool(beat), "code": code, "seconds": time.monotonic() - t}))
"""


def test_a_worker_whose_supervisor_host_vanished_exits_within_the_heartbeat_timeout():
    """Loopback down under a live connection (no FIN, nothing acknowledged): the worker's next heartbeat write fails
    after about the heartbeat timeout and it exits (code 3), instead of the kernel's ~15 minutes of retries."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        why = "needs root and unshare (a network namespace of its own)"
        if os.environ.get("CI"):
            raise RuntimeError(f"{why}; this CI runner has neither")
        pytest.skip(why)
    out = subprocess.run(["unshare", "-n", "--", sys.executable, "-c", _SCRIPT, str(SILENCE)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["beat"] and got["code"] == 3, got
    assert got["seconds"] < SILENCE + 5, got  # the timeout, a heartbeat's period, and room for a loaded machine


def test_a_warm_parent_that_never_answers_a_fork_is_given_up_within_its_deadline(monkeypatch, tmp_path):
    """A warm parent alive but silent (its socket open, no reply): fork() raises ZygoteLost after FORK_SECONDS
    instead of waiting forever (a node host would hold its start lock for good), and it counts as not alive."""
    monkeypatch.setattr(zygote, "FORK_SECONDS", 0.5, raising=False)
    z = zygote.Zygote({}, str(tmp_path / "zygote.log"), "compressed-tensors", 10)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    z.proc = subprocess.Popen(["sleep", "60"])
    z._connected(ours)
    r, w = os.pipe()
    raised = []

    def fork():
        try:
            z.fork([], {}, (r, w), (w, w))
        except zygote.ZygoteLost as exc:
            raised.append(exc.reason)

    t = time.monotonic()
    th = threading.Thread(target=fork, daemon=True)
    th.start()
    th.join(10)
    try:
        assert not th.is_alive(), "fork() still waiting for the warm parent after 10 s"
        assert raised and "did not answer a fork request" in raised[0], raised
        assert time.monotonic() - t < 5 and not z.alive
    finally:
        z.proc.kill()
        z.close()
        theirs.close()
        os.close(r)
        os.close(w)
