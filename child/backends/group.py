"""A calibrated group's rank: the torch.distributed process group this worker joins, and when the library uses it.

    Hello.group (rank, world, host:port, secret, timeout, backend)
      join(group)         rank 0 hosts the rendezvous: a TCPStore listening on the socket the supervisor (on a
                          cluster: its node's host) bound to host:port and handed over (LISTEN_FD_ENV), so it
                          listens on that address alone; the others connect to it. Every value the ranks put there
                          is signed (SignedStore: HMAC-SHA256 under the secret, which never enters the store) and
                          checked where it is read, so a process that can reach the port cannot make a rank accept
                          a value of its own; init_process_group(gloo | nccl, timeout): no collective waits past
                          `timeout`. The data plane binds the interface the supervisor named (GLOO_SOCKET_IFNAME,
                          NCCL_SOCKET_IFNAME in this worker's environment: loopback on one host)
      collectives()       around one layer's calibration only: llm-compressor's own distributed code runs there
                          (GPTQ's Hessians reduced to each module's owner by greedy bin packing, solved there and
                          broadcast; observers' activation statistics all-reduced; AWQ's sums all-reduced on GPUs).
                          Everywhere else the library sees one process (compressed-tensors' single-threaded switch):
                          the export plan, config.json, the loader check and the non-layer part run on rank 0 alone
                          and must not wait for ranks that are not asked. A collective that times out fails the
                          layer as CollectiveTimeout (the supervisor names the ranks that had not finished)
      leave()             destroy the process group (on Stop)

What the store's guard is and is not (torch 2.13): TCPStore has no hook to refuse a client, and any client may list
every key (Store.list_keys), read any value, add to counters and delete keys. So the keys' prefix is derived from the
secret rather than being it, values are authenticated (not encrypted: the rendezvous' addresses and NCCL's unique id
can be read by whoever reaches the port), and counters (`add`) and deletions are not authenticated: a stranger can
make a start fail (it is retried), not join the group or feed a rank a value. gloo's and NCCL's own sockets are not
authenticated at all (torch.distributed's: its documentation asks for a trusted network).

One change to the library's behaviour, inside collectives() only: `broadcast_qparams_and_cleanup` skips modules that
execute on the CPU (its CPU offload shares one copy of the weights between ranks through shared memory). Each of our
ranks holds its own copy of the layer, so every module's result is broadcast from its owner, whatever the device;
without it a CPU rank would propagate the layer with the other ranks' modules unquantized.

Owns the process group's life in this worker; it never decides which samples a rank holds (child.backends.samples) or
what is written (the Exporter: rank 0 writes the shard, every rank its boundary).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import hmac
import os
import socket

import torch.distributed as dist

from shared.messages import LISTEN_FD_ENV, Group
from shared.sockets import bound_socket

_group: Group | None = None
# the store the process group uses, held here: torch keeps only the C++ half of a Python store alive, and its Python
# half (the TCPStore inside) would otherwise be collected after init_process_group, closing the rendezvous
_store: "SignedStore | None" = None
MAC_BYTES = hashlib.sha256().digest_size


class StoreValueRefused(RuntimeError):
    """A rendezvous value that does not carry this group's signature: another process wrote it."""


class CollectiveTimeout(RuntimeError):  # its name is shared.messages.COLLECTIVE_TIMEOUT (Failed.kind)
    pass


class SignedStore(dist.Store):
    """`inner` (the TCPStore under a PrefixStore) with every value set through it signed, and checked where it is
    read: HMAC-SHA256 of the key and the value under `key`, which never enters the store. torch.distributed calls
    it from C++ (gloo's and NCCL's rendezvous: set, get, wait; init_process_group's barrier: add, check).
    Counters (`add`) cannot be signed (the server adds to them) and pass through unsigned, as do check, wait,
    delete_key and num_keys, which carry no value a rank acts on; compare_set and the queues are not offered."""

    def __init__(self, inner: dist.Store, key: bytes):
        super().__init__()
        self._inner, self._key = inner, key

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def _open(self, key: str, raw: bytes) -> bytes:
        mac, value = raw[:MAC_BYTES], raw[MAC_BYTES:]
        if len(raw) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, value)):
            raise StoreValueRefused(f"the group's rendezvous holds a value under {key!r} that no rank of this run "
                                    "wrote (another process reached the store's port)")
        return value

    def set(self, key: str, value) -> None:
        value = _bytes(value)
        self._inner.set(key, self._mac(key, value) + value)

    def get(self, key: str) -> bytes:
        return self._open(key, self._inner.get(key))

    def multi_set(self, keys: list[str], values: list) -> None:
        values = [_bytes(v) for v in values]
        self._inner.multi_set(keys, [self._mac(k, v) + v for k, v in zip(keys, values)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._open(k, raw) for k, raw in zip(keys, self._inner.multi_get(keys))]

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def store(group: Group, startup_timeout: float) -> SignedStore:
    """This rank's view of the rendezvous: rank 0 serves it on the socket it was handed (or one it binds to
    host:port itself when started without one), the others connect; keys under a prefix derived from the secret."""
    timeout = datetime.timedelta(seconds=startup_timeout)
    if group.rank == 0:
        tcp = dist.TCPStore(group.host, group.port, world_size=group.world, is_master=True, timeout=timeout,
                            wait_for_workers=False, master_listen_fd=_listen_fd(group))
    else:
        tcp = dist.TCPStore(group.host, group.port, world_size=group.world, is_master=False, timeout=timeout)
    key = group.secret.encode()
    prefix = hmac.new(key, b"store prefix", hashlib.sha256).hexdigest()[:16]
    return SignedStore(dist.PrefixStore(f"supervisor/{prefix}/", tcp), key)


def _listen_fd(group: Group) -> int:
    """The socket rank 0's store listens on, bound to group.host: the one handed over, checked to be that address;
    else one bound here. TCPStore takes it over (it closes it with the store)."""
    fd = os.environ.pop(LISTEN_FD_ENV, "")
    if fd:
        s = socket.socket(fileno=int(fd))
        host, port = s.getsockname()[:2]
        if port != group.port or socket.getaddrinfo(group.host, port)[0][4][0] != host:
            s.close()
            raise RuntimeError(f"the store's socket handed to rank 0 is bound to {host}:{port}, not the group's "
                               f"rendezvous {group.host}:{group.port}")
        return s.detach()
    return bound_socket(group.host, group.port).detach()


def join(group: Group, startup_timeout: float) -> None:
    """Meet the other ranks and initialise the default process group (blocks until all `world` ranks joined, at
    most `startup_timeout` seconds)."""
    global _group, _store
    import torch
    from compressed_tensors.distributed import utils

    utils._force_single_threaded = True  # the library sees one process until collectives()
    kwargs = {}
    if group.backend == "nccl":
        kwargs["device_id"] = torch.device("cuda:0")  # each rank sees its own GPU only
    _store = store(group, startup_timeout)
    dist.init_process_group(group.backend, store=_store, rank=group.rank, world_size=group.world,
                            timeout=datetime.timedelta(seconds=group.timeout), **kwargs)
    _group = group


def rank() -> int:
    return _group.rank if _group is not None else 0


def world() -> int:
    return _group.world if _group is not None else 1


@contextlib.contextmanager
def collectives():
    """The library's distributed code on, for one layer's calibration (a no-op outside a group)."""
    if _group is None:
        yield
        return
    from compressed_tensors.distributed import utils
    from compressed_tensors.utils import patch_attr
    from llmcompressor.modifiers.gptq import base as gptq
    from llmcompressor.modifiers.quantization.quantization import base as quantization
    from llmcompressor.utils.dist import broadcast_qparams_and_cleanup

    every_module = functools.partial(broadcast_qparams_and_cleanup, skip_cpu=False)
    try:
        with patch_attr(utils, "_force_single_threaded", False), \
                patch_attr(gptq, "broadcast_qparams_and_cleanup", every_module), \
                patch_attr(quantization, "broadcast_qparams_and_cleanup", every_module):
            yield
    except RuntimeError as exc:
        # torch 2.13's words for it: gloo "Timed out waiting 8000ms for recv operation to complete", NCCL's watchdog
        # "Watchdog caught collective operation timeout" (by default it aborts the process instead)
        text = str(exc)
        if "timed out" not in text.lower() and "timeout" not in text.lower():
            raise
        line = next((x for x in text.splitlines() if x.strip()), type(exc).__name__)
        raise CollectiveTimeout(f"a collective of the group waited past [resources] collective_timeout = "
                                f"{_group.timeout:g} s for another rank: {line}") from exc


def leave() -> None:
    global _group, _store
    if _group is None:
        return
    _group = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _store = None
