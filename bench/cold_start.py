"""A data-free export's cold start, code tree against code tree: the warm parent's imports, the cold run, the warm run.

Builds a random bf16 Llama checkpoint (bench/export_bench.py's builder; the Llama-3-8B shape by default), warms the
page cache and the import caches, then for each round and each code tree (alternating, the order reversed every
other round so that a drift of the machine's speed falls on both):

  imports alone  `python -P -c "child.zygote._imports(profile)"` in a fresh interpreter: what the warm parent spends
  cold           `supervisor run --json` with keep_warm = 600 and no warm parent running: the warm parent imports
                 (PoolStarted.imports), forks the workers, and stays for the next run
  warm           the same job into a new folder: its workers fork from the warm parent the cold run kept (its wall
                 is what a re-run or a studio's next export costs); then `supervisor warm --stop`

and, after each round (the first --oneshot-rounds; none with --skip oneshot), llm-compressor's oneshot on the same
checkpoint (bench/export_bench.py's script). A tree is a folder holding the `child`, `shared` and `supervisor`
packages (a checkout, or `git archive REV child shared supervisor | tar -x -C DIR`): its CLI and everything it starts
import from it (PYTHONPATH first, the CLI started in that folder). Prints every run, then one table (mean, min-max
of the rounds), and compares every tree's cold output with the first tree's, and the last tree's with oneshot's,
tensor by tensor.

    python bench/cold_start.py --tree before=/tmp/before --tree after=. --rounds 4 \\
        --device cpu --layers 8 --hidden 2048 --intermediate 5632 --vocab 32000     # the CPU VM
    python3 bench/cold_start.py --tree before=bench/before --tree after=. --rounds 2 --oneshot-rounds 1 \\
        --skip imports --device cuda:0                                          # one H200 (bench/gpu_session.sh cold34)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import export_bench as eb  # noqa: E402 - the checkpoint builder, the oneshot script, the tensor comparison

PACKAGES = ("child", "shared", "supervisor")
IMPORTS = r"""
import json, sys
from child.zygote import _imports
seconds, forkable = _imports(sys.argv[1])
print(json.dumps({"imports": seconds, "forkable": forkable, "modules": len(sys.modules)}))
"""


def tree_env(tree: str, runtime: str) -> dict:
    """The environment a run of `tree` gets: its packages first on the path, kept warm parents in its own folder."""
    env = dict(os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != eb.REPO]
    env["PYTHONPATH"] = os.pathsep.join([tree, *rest])
    env["XDG_RUNTIME_DIR"] = runtime
    env.pop("SUPERVISOR_KEEP_WARM", None)
    return env


def run_cli(args, tree: str, env: dict, src: str, out: str, keep_warm: float) -> dict:
    """One `supervisor run --json` of `tree` (started in the tree's folder: `python -m` puts the working directory
    first on the path); wall, PoolStarted's imports and whether the warm parent was reused."""
    job = eb.write_job(os.path.join(args.workdir, f"job-{os.path.basename(out)}.toml"), src, out, args.scheme,
                       args.device, 0, measure_error=args.measure_error, keep_warm=keep_warm)
    os.sync()  # every run starts on a quiet disk (export_bench.timed)
    t = time.perf_counter()
    proc = subprocess.run([eb.SUPERVISOR, "run", job, "--json"], capture_output=True, text=True, env=env, cwd=tree)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"supervisor ({tree}) failed: {proc.stderr[-3000:]}")
    events = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    pool = next((e for e in events if e["type"] == "PoolStarted"), {})
    return {"wall": wall, "imports": pool.get("imports", 0.0), "reused": pool.get("reused", False),
            "forking": pool.get("forking"), "ready": pool.get("t", 0.0)}


def imports_alone(tree: str, env: dict, profile: str) -> dict:
    proc = subprocess.run([sys.executable, "-P", "-c", IMPORTS, profile], capture_output=True, text=True, env=env,
                          cwd=tree)
    if proc.returncode != 0:
        sys.exit(f"imports ({tree}) failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stop_warm(env: dict, tree: str) -> None:
    subprocess.run([eb.SUPERVISOR, "warm", "--stop"], capture_output=True, timeout=60, env=env, cwd=tree)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listed = subprocess.run([eb.SUPERVISOR, "warm", "--json"], capture_output=True, text=True, timeout=60,
                                env=env, cwd=tree)
        if '"pid"' not in listed.stdout:
            return
        time.sleep(0.2)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    eb.add_shape_args(ap)
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                    help="a code tree to run (repeat; the first is the reference for the output comparison)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scheme", default="FP8_DYNAMIC")
    ap.add_argument("--device", default="cuda:0", help="the job's resources.device")
    ap.add_argument("--profile", default="compressed-tensors", help="the warm profile of the imports-alone rows")
    ap.add_argument("--skip", default="", help="comma-separated: oneshot, imports, warm")
    ap.add_argument("--oneshot-rounds", type=int, default=None, help="run oneshot after the first N rounds only")
    ap.add_argument("--measure-error", default=False, type=lambda v: v.lower() in ("1", "true", "yes"),
                    help="[export] measure_error (default false, as the GPU benches run)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "cold-bench"))
    args = ap.parse_args()
    args.torch_device = "cpu" if args.device == "cpu" else ("cuda:0" if args.device == "cuda" else args.device)
    skip = set(filter(None, args.skip.split(",")))
    trees = []
    for spec in args.tree:
        name, _, path = spec.partition("=")
        path = os.path.abspath(path)
        if not all(os.path.isdir(os.path.join(path, p)) for p in PACKAGES):
            sys.exit(f"--tree {spec}: {path} does not hold child/, shared/ and supervisor/")
        trees.append((name, path))

    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    src = os.path.join(args.workdir, "model")
    t = time.perf_counter()
    size = eb.build(args, src)
    print(f"checkpoint: {args.layers} layers, {size / 1e9:.2f} GB bf16, written in {time.perf_counter() - t:.1f} s",
          flush=True)
    eb.warm(src, args.scheme, args.torch_device)
    envs = {}
    for name, path in trees:
        runtime = os.path.join(args.workdir, f"rt-{name}")
        os.makedirs(runtime, mode=0o700)
        envs[name] = tree_env(path, runtime)
        # the tree's own bytecode written before anything is timed (a fresh checkout has none)
        subprocess.run([sys.executable, "-m", "compileall", "-q", *(os.path.join(path, p) for p in PACKAGES)],
                       check=True)

    rows: dict[str, dict[str, list[float]]] = {name: {"imports alone": [], "imports (cold run)": [], "cold": [],
                                                      "warm": []} for name, _ in trees}
    oneshot: list[float] = []
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for name, path in order:
            env, row = envs[name], rows[name]
            if "imports" not in skip:
                alone = imports_alone(path, env, args.profile)
                row["imports alone"].append(alone["imports"])
            out = os.path.join(args.workdir, f"out-{name}")
            shutil.rmtree(out, ignore_errors=True)
            cold = run_cli(args, path, env, src, out, keep_warm=0 if "warm" in skip else 600)
            if cold["reused"]:
                sys.exit(f"{name}: the cold run found a warm parent running")
            row["imports (cold run)"].append(cold["imports"])
            row["cold"].append(cold["wall"])
            line = (f"round {r} {name}: cold {cold['wall']:.2f} s (warm parent's imports {cold['imports']:.2f} s, "
                    f"ready at {cold['ready']:.2f} s, {'forked' if cold['forking'] else 'SPAWNED'})")
            if "imports" not in skip:
                line += f", imports alone {alone['imports']:.2f} s ({alone['modules']} modules)"
            if "warm" not in skip:
                again = os.path.join(args.workdir, f"out-{name}-warm")
                shutil.rmtree(again, ignore_errors=True)
                warm = run_cli(args, path, env, src, again, keep_warm=600)
                stop_warm(env, path)
                if not warm["reused"]:
                    sys.exit(f"{name}: the warm run did not reuse the kept warm parent")
                row["warm"].append(warm["wall"])
                line += f", warm {warm['wall']:.2f} s"
                shutil.rmtree(again)
            print(line, flush=True)
        if "oneshot" not in skip and (args.oneshot_rounds is None or r < args.oneshot_rounds):
            one = eb.run_script(eb.ONESHOT, args, src, os.path.join(args.workdir, "oneshot"), eb.IGNORE)
            oneshot.append(one["wall"])
            print(f"round {r} oneshot: {one['wall']:.2f} s (imports {one['startup']:.2f} s)", flush=True)

    print()
    print(f"{args.layers} layers ({args.hidden} hidden, {args.intermediate} intermediate, {args.vocab} vocab), "
          f"{args.scheme}, device {args.device}, {args.rounds} rounds; seconds, mean (min-max)")
    names = [name for name, _ in trees]
    print("| | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for key in ("imports alone", "imports (cold run)", "cold", "warm"):
        if any(rows[n][key] for n in names):
            print(f"| {key} | " + " | ".join(spread(rows[n][key]) for n in names) + " |")
    if oneshot:
        print(f"| oneshot | {spread(oneshot)} |" + " |" * (len(names) - 1))
        mean = statistics.mean(oneshot)
        print("| cold / oneshot (means) | " + " | ".join(f"{statistics.mean(rows[n]['cold']) / mean:.2f}"
                                                     for n in names) + " |")
    first = os.path.join(args.workdir, f"out-{names[0]}")
    for name in names[1:]:
        print(f"{name}'s output vs {names[0]}'s:", eb.compare(os.path.join(args.workdir, f"out-{name}"), first))
    if oneshot:  # the last tree's (each tree's equals the first's, above)
        print(f"{names[-1]}'s output vs oneshot's:", eb.compare(os.path.join(args.workdir, f"out-{names[-1]}"),
                                                              os.path.join(args.workdir, "oneshot")))


if __name__ == "__main__":
    main()
