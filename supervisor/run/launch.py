"""Launching one run's workers: the slots, the warm parent, and a ready worker (or a group of them) per slot.

    slots()                        one per worker: this host's devices (workers.devices.worker_slots), or one per
                                   cluster seat
    start_zygote()                 the warm parent (workers.zygote), spawned from the long-lived spawner thread
    start_worker(slot, on_hello)   ─▶ _start_one: threads, the device lock, Hello, then
                                        Worker (forked from the warm parent, or spawned when it cannot fork)
                                        RemoteWorker (cluster.remote: started by the seat's node host)
                                   ─▶ the layer count and the GPU room (check_gpu_room) checked on its Ready,
                                        WorkerStarted
                                   a calibrated group (plan.world > 1): workers.group.Group of every rank
    on_heartbeat(hb)               the progress event a worker's heartbeat makes
    forecast(plan)                 `supervisor plan`: one spawned CPU worker answers Describe (api.describe)

Built by the run with what it needs (the plan, an emit function, the cancel token, the log feed, the live model's
lease, the progress clock); it calls nothing of the run. Owns starting workers; it never sends them parts (the
scheduler does) and never journals.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import msgspec

from shared import layout
from shared.job import warm_profile
from shared.messages import (LISTEN_FD_ENV, LISTEN_PORT_ENV, PROTOCOL_VERSION, Describe, Described, Failed, Heartbeat,
                             Hello)
from supervisor import events as ev
from supervisor.checks.source import SourceInfo
from supervisor.errors import Cancelled, ExportFailed, NoRoom, SourceError
from supervisor.live.lease import Lease
from supervisor.run.feed import Progress
from supervisor.run.plan import Plan
from supervisor.run.scheduler import Slot
from supervisor.workers.group import Group, data_plane_env, interface_holding
from supervisor.workers.logpump import OnLine
from supervisor.workers.worker import CancelledWait, Worker, WorkerLost, spawn
from supervisor.workers.zygote import EarlyStart, Zygote, ZygoteLost, keep_warm_seconds, run_env

# Test-only: seconds a cluster slot whose node left waits for Ray to place it elsewhere before it is left out
# (default supervisor.cluster.seats.PLACE_SECONDS); a left-out slot then asks every ROOM_POLL s until a node has room.
PLACE_ENV = "SUPERVISOR_TEST_PLACE_SECONDS"
ROOM_POLL = 2.0


def cluster_place_seconds() -> float:
    from supervisor.cluster.seats import PLACE_SECONDS

    return float(os.environ.get(PLACE_ENV) or PLACE_SECONDS)


class Launcher:
    def __init__(self, plan: Plan, emit: Callable[[ev.Event], None], cancel: threading.Event, *, on_log: OnLine,
                 lease: Lease, progress: Progress | None,
                 check_ready: Callable[[Worker | Group], None] = lambda worker: None, early: EarlyStart | None = None):
        """`check_ready(w)`: after a part-exporting worker (or group) is ready, before it gets a part. `early`: the
        warm parent launched when the job was read (supervisor.api), taken by start_zygote when it is the one the
        plan needs, with its spawner thread (the thread its zygote's parent-death signal watches)."""
        self.plan, self.job, self._emit, self._cancel = plan, plan.job, emit, cancel
        self._on_log, self._lease, self._progress, self._check_ready = on_log, lease, progress, check_ready
        self.slots: list[Slot] | None = None
        self.zygote: Zygote | None = None
        self._zygote_lock = threading.Lock()
        self._early = early
        self._spawner: ThreadPoolExecutor | None = early.spawner if early is not None else \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")

    @property
    def layer_bytes(self) -> int:
        """A decoder layer's source bytes, on average."""
        return self.plan.source.nbytes // max(self.plan.source.num_layers, 1)

    @property
    def forkable(self) -> bool:
        return self.zygote.forkable if self.zygote is not None else True

    def make_slots(self) -> list[Slot]:
        self.slots = slots_for(self.plan)
        return self.slots

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise Cancelled()

    def start_zygote(self) -> None:
        """Start the warm parent that forks workers. It is spawned from the long-lived spawner thread: a
        parent-death signal fires when the *thread* that spawned a process ends, not only its process."""
        self._check_cancel()
        env, fmt = run_env(self.plan.devices), warm_profile(self.job)
        keep = keep_warm_seconds(self.job.resources.keep_warm)
        log = layout.state_path(self.plan.output, layout.LOGS, "zygote.log")
        early, self._early = self._early, None
        if early is not None and early.matches(env, fmt, keep, self._lease.memfds):
            z, start = early.zygote, functools.partial(early.adopt, log, self._on_log)
        else:
            if early is not None:  # the plan's devices or environment differ from the job's first reading
                early.discard()
            z = Zygote(env, log, fmt, self.job.resources.startup_timeout, pass_fds=self._lease.memfds,
                       on_log=self._on_log, keep_warm=keep)
            start = z.start
        t = time.monotonic()
        try:
            self._spawner.submit(start, self._cancel.is_set).result()
        except ZygoteLost as exc:
            raise ExportFailed(f"workers cannot start: {exc.reason}", traceback=exc.log_tail) from None
        except CancelledWait:
            raise Cancelled() from None
        self.zygote = z
        self._emit(ev.PoolStarted(pid=z.pid, seconds=round(time.monotonic() - t, 3), imports=z.seconds,
                                  forking=z.forkable, reused=z.reused, kept=z.keep_warm if z.kept else 0.0))

    def _fork(self, env: dict, fds: tuple[int, int], out_fds: tuple[int, int], listen_fd: int | None = None):
        """Fork a worker from the warm parent; one that died is started again once (on the spawner thread).
        `listen_fd`: a socket the worker inherits (a group's rank 0: its store's, shared.messages.LISTEN_FD_ENV)."""
        with self._zygote_lock:
            try:
                if self.zygote is None or not self.zygote.alive:
                    old, self.zygote = self.zygote, None
                    if old is not None:
                        old.close()
                    self.start_zygote()
                if not self.zygote.forkable:
                    # the imports touched CUDA on this machine: a fork would not be safe; spawn instead (an inherited
                    # fd keeps its number)
                    extra = () if listen_fd is None else (listen_fd,)
                    if listen_fd is not None:
                        env = {**env, LISTEN_FD_ENV: str(listen_fd)}
                    return self._spawner.submit(spawn, env, fds, out_fds, self._lease.memfds + extra).result()
                return self.zygote.fork([], env, fds, out_fds, listen_fd)
            except ZygoteLost as exc:
                raise WorkerLost(exc.reason, exc.log_tail) from None

    def start_worker(self, slot: Slot, on_hello=lambda: None) -> Worker | Group:
        """A ready worker for `slot`: the child sees only the slot's GPU (as cuda:0), or none on CPU. `on_hello()`:
        the child exists and has its Hello (Worker.start). A calibrated export on a group (plan.world > 1): the
        slot's worker is the Group of every rank (supervisor.workers.group), one per device."""
        w = self._start_group(slot, on_hello) if self.plan.world > 1 and not slot.planner else \
            self._start_one(slot, slot.device, slot.id, on_hello)
        if not slot.planner:
            self._check_ready(w)
        return w

    def _start_group(self, slot: Slot, on_hello) -> Group:
        self._check_cancel()
        world, devs = self.plan.world, self.plan.devices
        rank_devices = [devs[r] for r in range(world)] if devs != ["cpu"] else ["cpu"] * world

        def start_rank(spec, cancelled, register, listen_fd) -> Worker:
            return self._start_one(slot, rank_devices[spec.rank], spec.rank, on_hello if spec.rank == 0 else
                                   (lambda: None), group=spec, sharing=world if devs == ["cpu"] else 1,
                                   cancelled=cancelled, register=register, listen_fd=listen_fd)

        cluster = self.plan.cluster
        g = Group.start(world, start_rank, cancelled=self._cancel.is_set, timeout=self.job.resources.collective_timeout,
                        backend="gloo" if devs == ["cpu"] else "nccl",
                        rendezvous=(lambda: cluster.rendezvous(0)) if cluster is not None else None)
        slot.worker = g
        return g

    def _hello(self, device: str, worker_id: int, sharing: int, cores: int, group, remote: bool) -> Hello:
        """The worker's Hello: its job with the thread count for `sharing` workers on `cores` cores, and the device
        lock when workers on one GPU take turns."""
        from supervisor.workers import devices

        plan, r, job = self.plan, self.job.resources, self.job
        threads = devices.worker_threads(r.torch_threads, device, sharing, cores)
        if threads != r.torch_threads:
            job = msgspec.structs.replace(job, resources=msgspec.structs.replace(r, torch_threads=threads))
        lock = layout.device_lock(plan.output, device) if group is None and not remote and \
            devices.device_stage_shared(device, sharing, self.layer_bytes) else ""
        return Hello(version=PROTOCOL_VERSION, job=job, output=plan.output,
                     device="cpu" if device == "cpu" else "cuda:0", worker=worker_id,
                     calibration_sha256=plan.calibration.sha256 if plan.calibration else "",
                     pool=self._lease.manifest, device_lock=lock, group=group)

    def _start_one(self, slot: Slot, device: str, worker_id: int, on_hello=lambda: None, *, group=None,
                   sharing: int | None = None, cancelled=None, register=None, listen_fd: int | None = None) -> Worker:
        """One worker on `device` (a group's rank `worker_id` when `group` is its GroupSpec; `listen_fd`: rank 0's
        store socket on this host, supervisor.workers.group)."""
        self._check_cancel()
        plan, r, cluster = self.plan, self.job.resources, self.plan.cluster
        agent = None
        if cluster is not None:  # this slot's seat and node host (a group's rank r: seat r; the planner: seat 0)
            agent = cluster.agent(worker_id if group is not None else 0 if slot.planner else slot.id,
                                  wait=ROOM_POLL if slot.parked else cluster_place_seconds())
            # CPU workers on one node split its cores; each GPU seat has a GPU of its own
            sharing, cores = (cluster.on_node(agent) if device == "cpu" else 1), agent.cpus
        else:
            # the slots on this slot's device: CPU workers split the cores; GPU workers may take turns on their GPU
            if sharing is None:
                sharing = sum(s.device == device for s in self.slots) if self.slots else 1
            cores = os.cpu_count() or 1
        hello = self._hello(device, worker_id, sharing, cores, group, agent is not None)
        log = layout.state_path(plan.output, layout.LOGS,
                                f"rank-{worker_id}.log" if group is not None else f"worker-{slot.id}.log")
        if agent is not None:
            from supervisor.cluster.remote import RemoteWorker

            # rank 0: its node's host hands it the store socket it bound for this port (Cluster.rendezvous)
            env = {**agent.env, LISTEN_PORT_ENV: str(group.port)} if group is not None and group.rank == 0 else \
                agent.env
            w = RemoteWorker(hello, log, env, startup_timeout=r.startup_timeout,
                             heartbeat_timeout=r.heartbeat_timeout, host=agent.host_actor, listener=cluster.listener,
                             where=agent.where, cancelled=cancelled or self._cancel.is_set)
        else:
            from supervisor.workers import devices

            env = devices.child_env(device, dict(os.environ))
            env["PYTHONUNBUFFERED"] = "1"
            if group is not None:  # the ranks' gloo and NCCL sockets on loopback, as the store
                env.update(data_plane_env(interface_holding(group.host)))
            fork = self._fork if listen_fd is None else functools.partial(self._fork, listen_fd=listen_fd)
            w = Worker(hello, log, env, startup_timeout=r.startup_timeout, heartbeat_timeout=r.heartbeat_timeout,
                       fork=fork, on_log=self._on_log)
        if register is not None:
            register(w)  # the group kills it if another rank fails to start
        else:
            slot.worker = w  # so a stop or kill reaches it while it starts
        t = time.monotonic()
        beat = self.on_heartbeat if group is None or group.rank == 0 else (lambda hb: None)
        ready = w.start(cancelled or self._cancel.is_set, beat, on_hello)
        check_layers(ready, plan.source)
        check_gpu_room(plan, ready, device, sharing if slot.optional else 1)
        now = time.monotonic()
        if not slot.planner:  # the export plan's worker exports no part: not one of the run's workers to a reader
            self._emit(ev.WorkerStarted(pid=ready.pid, device=device, seconds=round(now - t, 3), worker=worker_id,
                                        where=w.where,
                                        since_death=None if slot.died_at is None else round(now - slot.died_at, 3),
                                        gpu_free=ready.gpu_free, gpu_total=ready.gpu_total))
        if self._progress is not None:
            self._progress.first_worker_ready()
        return w

    def on_heartbeat(self, hb: Heartbeat) -> None:
        p = self._progress
        if p is not None and hb.index is not None:
            group = self.slots[0].worker if self.plan.world > 1 and self.slots else None
            self._emit(p.event(worker_rss=hb.rss, stage=hb.stage, index=hb.index,
                               ranks=group.alive if isinstance(group, Group) else 0))

    def close_spawner(self) -> None:
        early, self._early = self._early, None
        if early is not None:  # never taken: the run ended before its warm parent (the spawner is early's)
            early.discard()
        if self._spawner is not None:
            self._spawner.shutdown(wait=True)
            self._spawner = None

    def close_zygote(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None


def slots_for(plan: Plan) -> list[Slot]:
    """The run's slots, one per worker: this host's devices, or one per cluster seat."""
    from supervisor.workers import devices

    r = plan.job.resources
    calibrated = plan.calibration is not None
    # calibrated: each layer's inputs are the previous layer's outputs, so one worker, in order
    cluster = plan.cluster
    if cluster is not None:
        # one slot per seat; one whose node leaves the cluster with no room elsewhere waits for room (NoRoom)
        count = 1 if calibrated else len(cluster.agents)
        return [Slot(id=i, device=cluster.device, optional=True, elastic=True) for i in range(count)]
    layer_bytes = plan.source.nbytes // max(plan.source.num_layers, 1)
    slots = [plan.devices[0]] if calibrated else devices.worker_slots(plan.devices, r.workers, layer_bytes)
    # a worker the default count added beyond one per GPU is left out if its GPU cannot hold it (NoRoom)
    return [Slot(id=i, device=d, optional=r.workers <= 0 and d != "cpu" and d in slots[:i])
            for i, d in enumerate(slots)]


def check_gpu_room(plan: Plan, ready, device: str | None = None, workers: int = 1) -> None:
    """Refuse a GPU that cannot hold a layer: the worker measured its free memory after starting. `workers` > 1:
    a worker the default count added (Slot.optional), which starts only where the GPU holds the layers of all
    `workers` workers on it (they start side by side, so a worker's measurement may not yet see the others')."""
    device = device or plan.device
    if not ready.gpu_total:
        return
    need = layer_need(plan) * workers
    if ready.gpu_free >= need:
        return
    free = f"{device} has {ready.gpu_free / 2**30:.1f} GiB free as the worker sees it"
    if workers > 1:
        raise NoRoom(f"{free}, {workers} workers' layers there need about {need / 2**30:.1f} GiB; going on "
                     "with fewer (set [resources] workers to choose the count)")
    raise NoRoom(f"{free}, a layer needs about {need / 2**30:.1f} GiB: free memory on that GPU (or hand the live "
                 "model to Supervisor(model=...)), or set [resources] device to another one")


def layer_need(plan: Plan) -> int:
    # A layer in flight: its tensors, the next layer read ahead, and the quantized copy (~2.5x a layer).
    return int(2.5 * (plan.source.nbytes // max(plan.source.num_layers, 1)))


def precheck_gpu(plan: Plan) -> None:
    """Before a child starts: if this process already uses CUDA (a studio holding its model), ask the device
    for its free memory now, after the release. The CLI never initializes CUDA here (a context costs
    ~0.5 GB of the very memory we want free); the worker then measures it itself (check_gpu_room)."""
    import sys
    torch = sys.modules.get("torch")
    if plan.device == "cpu" or torch is None or not torch.cuda.is_initialized():
        return
    from supervisor.workers import devices
    for device in plan.devices:
        devices.check_free_memory(device, layer_need(plan) + (512 << 20))  # + the child's context


def check_layers(ready, source: SourceInfo) -> None:
    if ready.num_layers != source.num_layers or ready.layer_prefix != source.layer_prefix:
        raise SourceError(f"the model class sees {ready.num_layers} layers under {ready.layer_prefix!r} but the "
                          f"weights hold {source.num_layers} under {source.layer_prefix!r}; "
                          "this architecture is not supported")


def forecast(plan: Plan) -> Described:
    """The export plan (`supervisor plan`, api.describe): one CPU worker, spawned with its log in a temporary
    folder, answers Describe; nothing is written into the output. Raises the error the worker's failure maps to."""
    import tempfile

    from supervisor.run.scheduler import for_good
    from supervisor.workers import devices

    r = plan.job.resources
    hello = Hello(version=PROTOCOL_VERSION, job=plan.job, output=plan.output, device="cpu",
                  calibration_sha256=plan.calibration.sha256 if plan.calibration else "")
    never, ignore = (lambda: False), (lambda hb: None)
    with tempfile.TemporaryDirectory(prefix="supervisor-plan-") as tmp:
        env = devices.child_env("cpu")
        env["PYTHONUNBUFFERED"] = "1"
        w = Worker(hello, os.path.join(tmp, "worker.log"), env, startup_timeout=r.startup_timeout,
                   heartbeat_timeout=r.heartbeat_timeout)
        try:
            ready = w.start(never, ignore)
            reply = w.request(Describe(), never, ignore)
        except WorkerLost as exc:
            if exc.failed is not None:
                raise for_good(exc.failed, "starting the worker") from None
            raise ExportFailed(f"planning failed: {exc.reason}", traceback=exc.log_tail) from None
        finally:
            w.stop()
    if isinstance(reply, Failed):
        raise for_good(reply, "the export plan")
    check_layers(ready, plan.source)
    return reply
