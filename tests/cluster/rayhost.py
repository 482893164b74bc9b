"""A local Ray cluster for the cluster tests, in a network namespace of its own (only 127.0.0.1 exists there).

    unshare -n python -m tests.cluster.rayhost      (RayHost.start does this; needs root, as CI and the VM have)
      brings loopback up, starts a head node (no CPUs: no worker lands on it, so any worker node can be removed)
      and two worker nodes of 2 CPUs, prints {"address": ...}, then answers one JSON command per stdin line:
        {"cmd": "add_node", "num_cpus": 2, "env": {...}}   -> {"node": NODE_ID}
        {"cmd": "remove_node", "node": NODE_ID}            -> {"removed": NODE_ID}
        {"cmd": "nodes"}                                   -> {"nodes": [NODE_ID, ...]} (worker nodes, alive)
        {"cmd": "listening"}                               -> {"listening": [local address, ...]} (ss -ltn)
        {"cmd": "quit"}
The tests run `supervisor` in the same namespace (nsenter --net=/proc/PID/ns/net), so nothing they start can
reach, or be reached from, beyond loopback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


def require_isolated_network() -> None:
    """Exit unless this process is in a network namespace where only loopback exists (unshare -n, or nsenter into
    the cluster's): Ray listens on the machine's own address otherwise, and no test may send traffic beyond it."""
    import psutil

    others = sorted(name for name in psutil.net_if_addrs() if name != "lo")
    if others:
        sys.exit(f"refusing to start Ray outside a network namespace of its own (interfaces {others}); run it "
                 "under `unshare -n` (RayHost.start does) or nsenter into the test cluster's namespace")


def _reply(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    require_isolated_network()
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = {}
    for _ in range(2):
        node = cluster.add_node(num_cpus=2)
        nodes[node.node_id] = node
    cluster.wait_for_nodes()
    _reply({"address": cluster.address, "pid": os.getpid()})
    try:
        for line in sys.stdin:
            req = json.loads(line)
            cmd = req["cmd"]
            if cmd == "add_node":
                node = cluster.add_node(num_cpus=req.get("num_cpus", 2), env_vars=req.get("env") or None)
                cluster.wait_for_nodes()
                nodes[node.node_id] = node
                _reply({"node": node.node_id})
            elif cmd == "remove_node":
                cluster.remove_node(nodes.pop(req["node"]))
                _reply({"removed": req["node"]})
            elif cmd == "nodes":
                _reply({"nodes": list(nodes)})
            elif cmd == "listening":
                out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
                _reply({"listening": [line.split()[3] for line in out.splitlines() if line.strip()]})
            elif cmd == "quit":
                break
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
