"""A calibrated group's rendezvous (child/backends/group.py, supervisor/workers/group.py): where rank 0's store listens, and what a
process that reaches its port can and cannot do (torch 2.13's TCPStore, in this process)."""
from __future__ import annotations

import datetime
import os
import socket

import psutil
import pytest
import torch.distributed as dist

from child.backends import group
from shared.messages import LISTEN_FD_ENV, Group
from shared.sockets import bound_socket
from supervisor.workers.group import data_plane_env, interface_holding

SECRET = "0123456789abcdef0123456789abcdef"


def _listening(port: int) -> list[str]:
    return [c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port]


@pytest.fixture
def rendezvous(monkeypatch):
    """Rank 0's store on a socket bound as the supervisor binds it and handed over as a fork hands it (a copy of
    the fd, named in the environment), and rank 1's view of it."""
    held = bound_socket("127.0.0.1")
    host, port = held.getsockname()[:2]
    monkeypatch.setenv(LISTEN_FD_ENV, str(os.dup(held.fileno())))
    held.close()  # the supervisor's copy: closed once rank 0 has its own
    spec = dict(world=2, host=host, port=port, secret=SECRET, timeout=30.0)
    rank0 = group.store(Group(rank=0, **spec), 30)
    rank1 = group.store(Group(rank=1, **spec), 30)
    yield host, port, rank0, rank1
    del rank0, rank1


def test_rank_zeros_store_listens_on_the_handed_socket_alone(rendezvous):
    """Rank 0's store listens on the port the supervisor's socket was bound to, on 127.0.0.1 only (never the wildcard
    address TCPStore binds by itself), and has taken the handed fd out of its environment."""
    host, port, rank0, rank1 = rendezvous
    assert _listening(port) == [host]
    assert LISTEN_FD_ENV not in os.environ
    rank0.set("k", b"v")
    assert rank1.get("k") == b"v"


def test_a_stranger_on_the_port_sees_no_secret_and_cannot_feed_a_rank_a_value(rendezvous):
    """A client that connects to the store without the secret can list its keys (torch lets it) but finds no secret
    in them; a value it writes under a rank's key, or one it copies from another key, is refused where a rank reads
    it; the ranks' own values pass."""
    host, port, rank0, rank1 = rendezvous
    rank0.set("0//cpu//0/0", b"rank 0's address")
    rank0.set("0//cpu//0/1", b"rank 1's address")
    stranger = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
    keys = stranger.list_keys()
    assert keys and not any(SECRET in k for k in keys), keys
    target = next(k for k in keys if k.endswith("0//cpu//0/0"))
    other = next(k for k in keys if k.endswith("0//cpu//0/1"))
    assert rank1.get("0//cpu//0/0") == b"rank 0's address"
    stranger.set(target, b"x" * 32 + b"127.0.0.1:1")
    with pytest.raises(group.StoreValueRefused, match="no rank of this run wrote"):
        rank1.get("0//cpu//0/0")
    stranger.set(target, stranger.get(other))  # a genuine value, replayed under another key
    with pytest.raises(group.StoreValueRefused):
        rank1.get("0//cpu//0/0")


def test_the_data_plane_binds_the_interface_that_holds_the_address():
    """gloo and NCCL are told the interface that holds 127.0.0.1 here (loopback), NCCL by its exact name; an address no
    interface holds gives nothing to set."""
    lo = interface_holding("127.0.0.1")
    assert lo and any(a.address == "127.0.0.1" for a in psutil.net_if_addrs()[lo])
    assert data_plane_env(lo) == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": f"={lo}"}
    assert interface_holding("192.0.2.254") == "" and data_plane_env("") == {}


def test_the_supervisors_socket_is_bound_not_listening():
    """The socket bound to pick the port accepts no connection until rank 0's store listens on it."""
    s = bound_socket("127.0.0.1")
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(s.getsockname()[:2], timeout=5)
    finally:
        s.close()
