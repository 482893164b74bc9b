"""The cluster path's overhead: the same export on this host's local pool and on a one-node Ray cluster (one node
agent per GPU, or per CPU worker), alternating, in one run; prints a table and whether the bytes are equal.

    python bench/cluster_bench.py --device cuda --layers 8            # on the GPU machine (Ray carried as a wheel)
    unshare -n sh -c 'ip link set lo up; python bench/cluster_bench.py --device cpu --layers 4 --hidden 512 \
        --intermediate 1024 --vocab 2048 --workers 2'                  # on a CPU machine, Ray on loopback only

Both runs are cold (keep_warm = 0): the local run imports in its warm parent, the cluster run in each agent's. The
cluster is started here with `ray start --head` bound to 127.0.0.1 and stopped at the end. Wall is the CLI's
whole process; "first part" is when the first LayerStarted came (start-up: Ray join, agents, imports); "s/part" the
workers' mean seconds per layer.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.export_bench import add_shape_args, build, output_bytes, run_supervisor, warm  # noqa: E402


def _ray(*args, env=None) -> None:
    """The `ray` command line, as this interpreter's module (a wheel installed with --target has no script)."""
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], check=True, capture_output=True, text=True,
                   env=env, timeout=300)


def _hashes(folder: str) -> dict[str, str]:
    from tests.scenarios.cli import output_bytes as hashed

    return hashed(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--scheme", default="FP8_DYNAMIC")
    ap.add_argument("--device", default="cuda", help="cuda (one agent per GPU) or cpu")
    ap.add_argument("--workers", type=int, default=0, help="resources.workers (cpu: the agents; 0: one per GPU)")
    ap.add_argument("--rounds", type=int, default=2, help="local and cluster runs each, alternating")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "cluster-bench"))
    ap.add_argument("--torch-device", default="cpu")
    args = ap.parse_args()
    args.measure_error = False
    os.makedirs(args.workdir, exist_ok=True)
    src = os.path.join(args.workdir, "model")
    if not os.path.isdir(src):
        build(args, src)
    warm(src, args.scheme, "cuda:0" if args.device == "cuda" else "cpu")
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    cpus = max(args.workers, 1) if args.device == "cpu" else 1
    _ray("start", "--head", "--node-ip-address=127.0.0.1", f"--num-gpus={gpus}", f"--num-cpus={cpus}",
         "--include-dashboard=false", "--disable-usage-stats")
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:6379")
    rows, hashes = [], {}
    try:
        for r in range(args.rounds):
            for kind in ("local", "cluster"):
                out = os.path.join(args.workdir, f"out-{kind}-{r}")
                subprocess.run(["rm", "-rf", out], check=True)
                res = run_supervisor(args, src, out, args.workdir, args.workers, env=env, cluster=kind == "cluster")
                hashes[kind] = _hashes(out)
                rows.append((kind, r, res["wall"], res["startup"], res["per_layer"], output_bytes(out)))
    finally:
        _ray("stop", "--force")
    print(f"\n{args.scheme}, {args.layers} layers of hidden {args.hidden}, device {args.device}, "
          f"workers {args.workers or 'default'}")
    print("| run | round | wall s | first part s | s/part | MB out |\n| --- | --- | --- | --- | --- | --- |")
    for kind, r, wall, startup, per, nbytes in rows:
        print(f"| {kind} | {r} | {wall:.2f} | {startup:.2f} | {per:.3f} | {nbytes / 1e6:.1f} |")
    local = [w for k, _, w, *_ in rows if k == "local"]
    cluster = [w for k, _, w, *_ in rows if k == "cluster"]
    print(f"\ncluster / local wall: {sum(cluster) / sum(local):.2f} (mean of {len(local)} each); "
          f"outputs byte-identical: {hashes.get('local') == hashes.get('cluster')}")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
