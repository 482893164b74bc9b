"""A calibrated group: W workers that calibrate every decoder layer together, to the scheduler one worker.

    Group.start(world, start_rank)        the rendezvous (child.backends.group): a socket bound to 127.0.0.1 here, handed to
                                          rank 0 as its store's listen fd (on a cluster: rank 0's node host binds
                                          one to that node's Ray IP and hands it over the same way), a fresh secret
      rank 0 … rank W-1                    started side by side (each forked from the warm parent, its own pipes,
                                           heartbeats, log); they meet in torch.distributed (gloo | nccl)
    Group.request(ExportLayer(i))          every rank gets layer i with the journaled inputs of its own samples
      ◀── W replies                        rank 0's shard + every rank's boundary ─▶ one LayerWritten (boundaries)
    any rank fails, dies, hangs, stalls    the layer fails for the group: the other ranks' waits end at once, and the
                                           scheduler kills every rank (kill()) and retries the layer on a fresh group
                                           from the journaled boundaries; a failure names the ranks still busy then
    other requests (the plan, config.json, the loader check, the non-layer part): rank 0 alone

What is bound where: rank 0's store listens on the rendezvous address alone (127.0.0.1 on one host, rank 0's node's
Ray IP on a cluster), never on every interface; every rank's data plane (gloo's pairs, NCCL's sockets) binds one
interface of its own node (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME): loopback on one host, the one that holds the
node's Ray IP on a cluster. Binding the store's socket where the port is picked leaves no moment in which another
process could take it. What is authenticated: the store's values (child.backends.group: an HMAC under the per-start secret,
which never enters the store); a stranger who can reach the port can still read them, count and delete keys and so
disturb the rendezvous (the start then fails and is retried). The data plane is torch.distributed's own and
unauthenticated: the network it binds is trusted, as torch.distributed documents (README: "What a group binds, and
what it trusts").

No rank blocks forever: the supervisor watches each rank's process and heartbeats as for any worker, and the ranks'
collectives time out after `resources.collective_timeout` (a rank stuck in a C call while its heartbeats go on).
Owns the ranks' life and the merging of their replies; it never decides about retries (the scheduler does) and
never journals (the run does).
"""
from __future__ import annotations

import secrets
import socket
import threading
from typing import Callable

import msgspec

from shared.messages import (COLLECTIVE_TIMEOUT, NON_LAYER, ExportLayer, Failed, Group as GroupSpec, Heartbeat,
                             LayerWritten)
from shared.sockets import bound_socket
from supervisor.workers.worker import CancelledWait, Worker, WorkerLost

HOST = "127.0.0.1"  # a one-host group's rendezvous: loopback only


def interface_holding(address: str) -> str:
    """The name of this node's network interface that holds `address` ("" if none): a rank's gloo and NCCL sockets
    bind it, rather than whatever the host name resolves to (127.0.1.1 on Debian, so the peers on other nodes would
    be told to connect to loopback)."""
    import ipaddress

    import psutil

    try:
        want = ipaddress.ip_address(address)
    except ValueError:
        return ""  # a host name, not an address
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    if ipaddress.ip_address(a.address.split("%")[0]) == want:
                        return name
                except ValueError:
                    continue
    return ""


def data_plane_env(interface: str) -> dict[str, str]:
    """A rank's environment for gloo's and NCCL's own sockets: bind `interface` (interface_holding: of its node's
    Ray IP, or of 127.0.0.1 on one host), by exact name (NCCL takes a bare name as a prefix, "=" makes it exact);
    {} for "" (the libraries then pick as they do by default)."""
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": f"={interface}"} if interface else {}


class Group:
    """The ranks of one group start; see the module docstring. Quacks like a Worker for the scheduler: request,
    kill, stop, ask_to_stop, layers_done, rss, ready, pid."""

    def __init__(self, ranks: list[Worker]):
        self.ranks = ranks
        self.layers_done = 0

    # ---- start ---------------------------------------------------------------------------------------------
    @classmethod
    def start(cls, world: int, start_rank: Callable[[GroupSpec, Callable[[], bool], Callable[[Worker], None],
                                                     int | None], Worker],
              *, cancelled: Callable[[], bool], timeout: float, backend: str,
              rendezvous: Callable[[], tuple[str, int]] | None = None) -> "Group":
        """Start W ranks side by side: `start_rank(spec, cancelled, register, listen_fd)` returns rank spec.rank's
        ready Worker (it may raise; `register(worker)` before it starts, so that a failed start can kill it;
        `listen_fd`: rank 0's store socket on this host, None for the others and on a cluster). When one fails,
        the others stop waiting for the rendezvous at once; all are killed; its error is raised. `rendezvous()`: the
        address rank 0 hosts the store on (default: a socket bound here on 127.0.0.1, handed to rank 0 as
        `start_rank`'s `listen_fd`; on a cluster, rank 0's node, whose host binds and hands over the socket)."""
        listening = bound_socket(HOST) if rendezvous is None else None
        try:
            host, port = listening.getsockname()[:2] if listening is not None else rendezvous()
            return cls._start(world, start_rank, host, port, cancelled=cancelled, timeout=timeout, backend=backend,
                              listen_fd=listening.fileno() if listening is not None else None)
        finally:
            if listening is not None:
                listening.close()  # rank 0 holds its own copy (or the start failed)

    @classmethod
    def _start(cls, world: int, start_rank, host: str, port: int, *, cancelled, timeout: float, backend: str,
               listen_fd: int | None) -> "Group":
        secret = secrets.token_hex(16)
        specs = [GroupSpec(rank=r, world=world, host=host, port=port, secret=secret, timeout=timeout, backend=backend)
                 for r in range(world)]
        broken = threading.Event()
        workers: list[Worker | None] = [None] * world
        errors: list[tuple[int, BaseException]] = []
        started: list[Worker] = []
        lock = threading.Lock()

        def register(w: Worker) -> None:
            with lock:
                started.append(w)

        def one(spec: GroupSpec) -> None:
            try:
                w = start_rank(spec, lambda: cancelled() or broken.is_set(), register,
                               listen_fd if spec.rank == 0 else None)
                workers[spec.rank] = w
            except BaseException as exc:  # noqa: BLE001 - raised from start() below
                with lock:
                    errors.append((spec.rank, exc))
                broken.set()

        threads = [threading.Thread(target=one, args=(s,), name=f"rank-{s.rank}-start", daemon=True) for s in specs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # bounded: each rank's start has the startup timeout
        if errors:
            for w in started:
                w.kill()
            if cancelled():
                raise CancelledWait()
            raise _first_cause(errors)
        return cls(workers)

    # ---- the Worker surface the scheduler uses ---------------------------------------------------------------
    @property
    def where(self) -> str:
        """On a cluster, every rank's node ("rank r: …"); "" on this host."""
        if not any(w.where for w in self.ranks):
            return ""
        return "; ".join(f"rank {r}: {w.where}" for r, w in enumerate(self.ranks))

    @property
    def ready(self):
        return self.ranks[0].ready

    @property
    def pid(self) -> int | None:
        return self.ranks[0].pid

    @property
    def rss(self) -> int:
        """The largest rank's RSS (recycle_above_rss_mb applies to each rank)."""
        return max(w.rss for w in self.ranks)

    @rss.setter
    def rss(self, value: int) -> None:
        pass  # the ranks' own heartbeats keep theirs

    @property
    def alive(self) -> int:
        return sum(w.proc is not None and w.proc.poll() is None for w in self.ranks)

    def request(self, msg, cancelled: Callable[[], bool], on_heartbeat: Callable[[Heartbeat], None],
                timeout: float = 0.0):
        if not isinstance(msg, ExportLayer) or msg.index == NON_LAYER:
            return self.ranks[0].request(msg, cancelled, on_heartbeat, timeout)
        return self._layer(msg, cancelled, on_heartbeat, timeout)

    def _layer(self, msg: ExportLayer, cancelled, on_heartbeat, timeout: float):
        """One calibrated layer on every rank; the merged reply, a rank's Failed, or WorkerLost naming the rank."""
        world = len(self.ranks)
        if msg.boundaries and len(msg.boundaries) != world:
            raise ValueError(f"layer {msg.index}: {len(msg.boundaries)} journaled boundaries for {world} ranks")
        broken = threading.Event()
        replies: list = [None] * world
        errors: list[tuple[int, BaseException | Failed]] = []
        busy: list[int] = []  # the ranks still on the layer when the first one failed
        lock = threading.Lock()

        def one(rank: int) -> None:
            mine = msgspec.structs.replace(msg, boundary=msg.boundaries[rank] if msg.boundaries else None,
                                           boundaries=[])
            beat = on_heartbeat if rank == 0 else (lambda hb: None)  # the progress line follows rank 0's stages
            try:
                reply = self.ranks[rank].request(mine, lambda: cancelled() or broken.is_set(), beat, timeout)
            except BaseException as exc:  # noqa: BLE001 - classified below
                reply = exc
            if isinstance(reply, LayerWritten) and reply.index == msg.index:
                replies[rank] = reply
                return
            if isinstance(reply, CancelledWait) and broken.is_set() and not cancelled():
                return  # another rank broke the layer: this one is stopped with it
            with lock:
                if not errors:
                    busy.extend(r for r in range(world) if r != rank and replies[r] is None)
                errors.append((rank, reply))
            broken.set()

        threads = [threading.Thread(target=one, args=(r,), name=f"rank-{r}", daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # bounded: each rank's thread waits with the collective timeout
        if errors:
            if cancelled():
                raise CancelledWait()
            cause = _first_cause(errors)
            if isinstance(cause, BaseException):
                raise cause
            stuck = [r for r in busy if r not in {rank for rank, _ in errors}]  # neither replied nor failed
            if stuck:  # a collective that timed out names no peer: the ranks that had not finished are the suspects
                ranks = f"rank{'s' if len(stuck) > 1 else ''} {', '.join(map(str, stuck))}"
                why = ": stuck, its heartbeats still coming" if cause.kind == COLLECTIVE_TIMEOUT else ""
                cause = msgspec.structs.replace(cause, message=f"{cause.message} ({ranks} had not finished layer "
                                                f"{msg.index}{why})")
            return cause
        return _merge(replies)

    def ask_to_stop(self) -> None:
        for w in self.ranks:
            w.ask_to_stop()

    def stop(self, grace: float = 5.0) -> None:
        self.ask_to_stop()
        for w in self.ranks:
            w.stop(grace)

    def kill(self) -> None:
        for w in self.ranks:  # every rank at once first: none is left waiting for a dead peer meanwhile
            if w.proc is not None and w.proc.poll() is None:
                w.proc.kill()
        for w in self.ranks:
            w.kill()


def _merge(replies: list[LayerWritten]) -> LayerWritten:
    """Rank 0's reply (the shard) with every rank's boundary, in rank order, and the slowest rank's figures."""
    first = replies[0]
    boundaries = [r.boundary for r in replies] if first.boundary is not None else []
    return msgspec.structs.replace(
        first, boundary=None, boundaries=boundaries, seconds=max(r.seconds for r in replies),
        peak_rss=max(r.peak_rss for r in replies), rss=max(r.rss for r in replies),
        peak_gpu=max(r.peak_gpu for r in replies), source_bytes=sum(r.source_bytes for r in replies),
        ranks={k: v for r in replies for k, v in r.ranks.items()},
        losses={name: loss for r in replies for name, loss in sorted(r.losses.items())})  # each by its owner


def _first_cause(errors: list[tuple[int, BaseException | Failed]]):
    """The failure to report for the group: one that would repeat (bad input, a bad layout) first, then a rank's
    death or hang, then any; named by its rank. The others are what that one caused (a peer gone mid-collective)."""
    def order(item):
        _, e = item
        if isinstance(e, Failed):
            return 0 if (not e.retry or e.refused or e.errno is not None) else 3
        if isinstance(e, CancelledWait):
            return 4  # stopped because another rank broke
        return 2 if isinstance(e, WorkerLost) else 1  # 1: the run's own checks (NoRoom, a source mismatch)

    rank, e = sorted(errors, key=order)[0]
    if isinstance(e, Failed):
        return msgspec.structs.replace(e, message=f"rank {rank}: {e.message}")
    if isinstance(e, WorkerLost):
        return WorkerLost(f"rank {rank}: {e.reason}", e.log_tail, e.failed)
    return e
