"""A node host's connection to the run's port (supervisor/node_agent.py's dial), without Ray: a worker whose
supervisor's host vanishes without closing the connection (its peer stops acknowledging) exits within about the
heartbeat timeout (TCP_USER_TIMEOUT, _bound_silence), in a network namespace of the test's own."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SILENCE = 3.0  # the heartbeat timeout the host bounds the connection's silence by

# In `unshare -n`: the run's port and a node host's connection on loopback; the worker stands in with the child's
# own heartbeat thread (child.__main__.Beat: a heartbeat a second, os._exit(3) when a write fails); then loopback
# goes down, so nothing is acknowledged any more and no FIN or RST ever comes.
_SCRIPT = r"""
import json, os, select, subprocess, sys, time
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
from supervisor import channel, node_agent, remote
listener = remote.Listener("127.0.0.1", lambda peer, reason: None)
token = os.urandom(channel.TOKEN_BYTES)
arrived = listener.expect(token)
dialed = node_agent.dial("127.0.0.1", listener.port, token, channel.worker_key(listener.secret, token), None,
                         float(sys.argv[1]), time.monotonic() + 10)
supervisor_end = arrived.result(5)
worker = subprocess.Popen([sys.executable, "-c",
                           "import sys, time\n"
                           "from child.__main__ import Beat\n"
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
