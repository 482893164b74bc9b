"""A NodeHost actor on the test cluster, driven directly: `python -m tests.cluster.hostcheck RAY_ADDRESS`
(in the cluster's network namespace) prints one JSON line with what it measured. It never starts Ray: it joins
the test cluster that RayHost started under `unshare -n`, run through `nsenter` into that namespace (test_ray.py
passes host.prefix), and exits before `ray.init` anywhere else (require_isolated_network: only loopback).

- concurrency: WAITS wait_worker calls pending on a worker that never exits, then how long ping and
  signal_worker take to answer (they must not queue behind the waits);
- stop: Worker.stop on a remote worker whose host cannot signal it (a partition: signal_worker does nothing),
  how long stop() took and what the process handle says.
The host's workers are plain `sleep` processes it adopts (forking real workers is what the export tests do).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import ray

from supervisor.cluster import remote
from supervisor.cluster.node_agent import NodeHost
from tests.cluster.rayhost import require_isolated_network

WAITS = 100


class AdoptingHost(NodeHost):
    def adopt(self, argv: list[str]) -> int:
        proc = subprocess.Popen(argv)
        self._children[proc.pid] = proc
        return proc.pid

    def end(self, pid: int) -> None:
        self._children[pid].kill()


class PartitionedHost(AdoptingHost):
    def signal_worker(self, pid: int, sig: int) -> None:
        pass  # the signal never reaches the node


def _actor(cls):
    try:
        from supervisor.cluster.seats import host_actor_class
    except ImportError:  # the tree before concurrency groups: how it made its hosts
        from supervisor.cluster.seats import ACTOR_CONCURRENCY
        return ray.remote(cls).options(num_cpus=0, max_concurrency=ACTOR_CONCURRENCY).remote("compressed-tensors", 60,
                                                                                               os.devnull, {})
    return host_actor_class(ray, cls).options(num_cpus=0).remote("compressed-tensors", 60, os.devnull, {})


def concurrency() -> dict:
    host = _actor(AdoptingHost)
    pid = ray.get(host.adopt.remote(["sleep", "600"]), timeout=60)
    waits = [host.wait_worker.remote(pid) for _ in range(WAITS)]
    time.sleep(1.0)  # let the waits reach the actor first: the control calls come after them
    t = time.monotonic()
    try:
        ray.get([host.ping.remote(), host.signal_worker.remote(pid, 18)], timeout=20)  # 18: SIGCONT, harmless
        answered = time.monotonic() - t
    except ray.exceptions.GetTimeoutError:
        answered = None
    ray.get(host.end.remote(pid), timeout=60) if answered is not None else None
    ray.kill(host)
    del waits
    return {"control_seconds": answered}


def stop() -> dict:
    host = _actor(PartitionedHost)
    pid = ray.get(host.adopt.remote(["sleep", "600"]), timeout=60)
    log = os.path.join(tempfile.mkdtemp(), "w.log")
    w = remote.RemoteWorker(None, log, None, startup_timeout=60, heartbeat_timeout=60, host=host, listener=None,
                            where="a partitioned node", cancelled=lambda: False)
    w.proc = remote.RemoteProc(host, pid, w.where)
    w._stop_sent = True  # no connection here to send Stop on
    t = time.monotonic()
    th = threading.Thread(target=w.stop, kwargs={"grace": 1.0}, daemon=True)
    th.start()
    th.join(120)
    took = None if th.is_alive() else time.monotonic() - t
    os.kill(pid, 9)
    ray.kill(host)
    return {"stop_seconds": took, "lost": w.proc.lost}


def main() -> int:
    require_isolated_network()  # it joins the test cluster from inside its namespace (test_ray.py: host.prefix)
    ray.init(address=sys.argv[1], log_to_driver=False, include_dashboard=False, namespace="hostcheck")
    out = {**concurrency(), **stop()}
    print(json.dumps(out), flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
