"""The remote worker's handshake (supervisor/cluster/channel.py) between the run's port (remote.Listener) and a node host's
connect path (node_agent.dial), without Ray: both ends prove the run's secret, neither sends it, a wrong secret
is refused on both sides, a recorded exchange cannot be replayed, and with Ray's TLS variables both ends verify
each other against the cluster's CA (certificates made here with the openssl CLI)."""
from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import socket
import struct
import subprocess
import threading
import time

import pytest

from supervisor.cluster import channel, node_agent, remote

HOST = "127.0.0.1"


class Port:
    """A Listener on loopback, its refusals collected."""

    def __init__(self, tls=None):
        self.refused: list[tuple[str, str]] = []
        self.listener = remote.Listener(HOST, lambda peer, reason: self.refused.append((peer, reason)), tls)

    def worker(self, secret: bytes | None = None, port: int | None = None, tls=None, timeout: float = 5.0):
        """(the supervisor's socket or None, the node host's Dialed or the RuntimeError it raised)."""
        token = os.urandom(channel.TOKEN_BYTES)
        arrived = self.listener.expect(token)
        key = channel.worker_key(secret or self.listener.secret, token)
        try:
            dialed = node_agent.dial(HOST, port or self.listener.port, token, key, tls, 5, time.monotonic() + timeout)
        except RuntimeError as exc:
            dialed = exc
        try:
            got = arrived.result(1.0)
        except TimeoutError:
            got = None
        self.listener.forget(token, taken=got is not None)
        return got, dialed

    def wait_refused(self, n: int, timeout: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.refused) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return [reason for _, reason in self.refused]

    def close(self):
        self.listener.close()


@pytest.fixture
def port():
    p = Port()
    yield p
    p.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the other end closed `sock` within 5 s (FIN, or RST when it left bytes of ours unread)."""
    sock.settimeout(5)
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def _frames_flow(sup: socket.socket, fd: int) -> None:
    os.write(fd, b"from the worker")
    assert sup.recv(100) == b"from the worker"
    sup.sendall(b"from the supervisor")
    assert os.read(fd, 100) == b"from the supervisor"


def test_a_worker_with_its_key_is_handed_to_the_worker_waiting_on_its_token(port):
    """The right key: the socket reaches the RemoteWorker that waits on the token, and bytes flow both ways."""
    sup, dialed = port.worker()
    assert sup is not None and isinstance(dialed, node_agent.Dialed), dialed
    _frames_flow(sup, dialed.fd)
    assert port.refused == []


def test_a_wrong_secret_on_the_node_host_is_refused_on_both_sides(port):
    """A node host holding another secret's key: the port refuses it ("wrong secret", logged) and the host is told
    its proof was refused; no worker gets the connection."""
    sup, dialed = port.worker(secret=os.urandom(channel.SECRET_BYTES))
    assert sup is None
    assert isinstance(dialed, RuntimeError) and "refused our proof" in str(dialed), dialed
    assert port.wait_refused(1) == ["the worker did not prove the run's secret (wrong secret)"]


class FakeSupervisor:
    """A port that welcomes any answer to its challenge, then answers the node's challenge with `key`: what an
    impostor without the secret can do. Records what the node host sent."""

    def __init__(self, key: bytes):
        self.key, self.got = key, b""
        self.sock = socket.create_server((HOST, 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _msg(self, conn) -> bytes:
        head = self._exact(conn, 4)
        return self._exact(conn, struct.unpack("!i", head)[0])

    def _exact(self, conn, n) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        self.got += data
        return data

    def _serve(self):
        conn, _ = self.sock.accept()
        conn.settimeout(5)
        with conn:
            send = lambda b: conn.sendall(struct.pack("!i", len(b)) + b)  # noqa: E731
            self._msg(conn)  # hello
            send(b"#CHALLENGE#{sha256}" + os.urandom(40))
            self._msg(conn)  # the node's answer, not checked
            send(b"#WELCOME#")
            challenge = self._msg(conn)[len(b"#CHALLENGE#"):]
            send(b"{sha256}" + hmac.new(self.key, challenge, hashlib.sha256).digest())
            try:
                self._msg(conn)  # the verdict
            except (EOFError, OSError):
                pass


def test_a_port_that_cannot_prove_the_secret_gets_no_worker():
    """An impostor port that accepts any proof but answers the node's challenge with another key: the node host
    refuses it (tells it #FAILURE#) and starts nothing."""
    fake = FakeSupervisor(key=os.urandom(32))
    token = os.urandom(channel.TOKEN_BYTES)
    with pytest.raises(RuntimeError, match="did not prove the run's secret"):
        node_agent.dial(HOST, fake.port, token, channel.worker_key(os.urandom(32), token), None, 5,
                        time.monotonic() + 5)
    deadline = time.monotonic() + 5
    while not fake.got.endswith(b"#FAILURE#") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.got.endswith(b"#FAILURE#")
    fake.sock.close()


class Tap:
    """A TCP relay between a client and HOST:port that records every byte each way."""

    def __init__(self, port: int):
        self.up, self.down = bytearray(), bytearray()
        self.sock = socket.create_server((HOST, 0))
        self.port, self.target = self.sock.getsockname()[1], port
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            b = socket.create_connection((HOST, self.target))
            threading.Thread(target=self._pipe, args=(a, b, self.up), daemon=True).start()
            threading.Thread(target=self._pipe, args=(b, a, self.down), daemon=True).start()

    @staticmethod
    def _pipe(src, dst, log):
        try:
            while data := src.recv(65536):
                log += data
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_neither_the_secret_nor_the_key_crosses_the_wire_and_a_replay_is_refused(port):
    """Every byte of a successful handshake, recorded both ways, holds neither the run's secret nor the worker's
    key; the same bytes replayed for the same token (expected again) fail the fresh challenge."""
    tap = Tap(port.listener.port)
    token = os.urandom(channel.TOKEN_BYTES)
    key = channel.worker_key(port.listener.secret, token)
    arrived = port.listener.expect(token)
    dialed = node_agent.dial(HOST, tap.port, token, key, None, 5, time.monotonic() + 5)
    sup = arrived.result(5)
    _frames_flow(sup, dialed.fd)
    port.listener.forget(token, taken=True)
    wire = bytes(tap.up + tap.down)
    assert token in wire and len(wire) > 200
    for secret in (port.listener.secret, key):
        assert secret not in wire
        assert not any(secret[i:i + 8] in wire for i in range(len(secret) - 7))  # nor a piece of it
    hello_and_answer = 4 + len(channel.MAGIC) + channel.TOKEN_BYTES + 4 + 8 + 32  # the node's first two messages
    port.listener.expect(token)
    with socket.create_connection((HOST, port.listener.port)) as replay:
        replay.sendall(bytes(tap.up[:hello_and_answer]))
        replay.settimeout(5)
        said = b""
        while chunk := replay.recv(4096):
            said += chunk
    assert said.endswith(b"#FAILURE#")
    assert port.wait_refused(1) == ["the worker did not prove the run's secret (wrong secret)"]
    tap.sock.close()


def test_a_silent_or_foreign_connection_is_refused_without_stopping_the_port(port, monkeypatch):
    """A connection that sends nothing is closed at the handshake's deadline, one that sends something else at
    once; each is reported, and a worker connects after them."""
    monkeypatch.setattr(channel, "HANDSHAKE_SECONDS", 0.5)
    silent = socket.create_connection((HOST, port.listener.port))
    with socket.create_connection((HOST, port.listener.port)) as foreign:
        foreign.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert _closed(foreign)
    assert _closed(silent)
    reasons = port.wait_refused(2)
    assert any("not our handshake" in r for r in reasons) and any("within 0s" in r or "within 1s" in r
                                                                   for r in reasons), reasons
    silent.close()
    sup, dialed = port.worker()
    assert sup is not None, dialed


# ---- TLS ---------------------------------------------------------------------------------------------------------
def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(folder, name: str) -> dict[str, str]:
    """A throwaway CA and one node certificate it signed (used as server and as client, as Ray's is)."""
    os.makedirs(folder, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.crt", "-days", "1",
             "-subj", f"/CN={name}-ca", cwd=folder)
    _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}-node", cwd=folder)
    with open(os.path.join(folder, "ext.cnf"), "w") as f:
        f.write("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.crt", "-CAkey", f"{name}-ca.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "1", "-extfile", "ext.cnf", cwd=folder)
    return {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": os.path.join(folder, f"{name}.crt"),
            "RAY_TLS_SERVER_KEY": os.path.join(folder, f"{name}.key"),
            "RAY_TLS_CA_CERT": os.path.join(folder, f"{name}-ca.crt")}


@pytest.fixture(scope="module")
def cas(tmp_path_factory):
    if not shutil.which("openssl"):
        pytest.skip("no openssl CLI to make the test certificates")
    folder = tmp_path_factory.mktemp("tls")
    return _ca(folder, "cluster"), _ca(folder, "other")


def test_with_rays_tls_both_ends_verify_against_the_ca_and_the_challenge_still_runs(cas, monkeypatch):
    """RAY_USE_TLS and its three files: the port and the node host each require the other's certificate from the
    cluster's CA; frames are relayed through TLS both ways (TlsRelay); a certificate of another CA is refused on
    both sides, a plaintext client is refused, and inside TLS a wrong secret is still refused."""
    cluster, other = cas
    server, client = channel.tls_contexts(cluster)
    monkeypatch.setattr(remote, "REFUSALS_SHOWN", 100)  # every refusal reported one by one here
    port = Port(tls=server)
    try:
        sup, dialed = port.worker(tls=client)
        assert sup is not None and hasattr(sup, "version"), dialed  # an SSLSocket
        ours, theirs = socket.socketpair()
        relay = channel.TlsRelay(sup, ours, "test-relay")
        os.write(dialed.fd, b"x" * 300_000)  # several TLS records, more than one relay buffer
        got = b""
        while len(got) < 300_000:
            got += theirs.recv(65536)
        theirs.sendall(b"back")
        assert os.read(dialed.fd, 10) == b"back"
        dialed.close()  # the worker's end closes: its relay ends TLS, the supervisor's relay ends our end
        theirs.settimeout(10)
        assert theirs.recv(10) == b""
        relay.join(10)

        _, foreign = port.worker(tls=channel.tls_contexts(other)[1], timeout=3)
        assert isinstance(foreign, RuntimeError) and "TLS refused" in str(foreign), foreign
        _, plain = port.worker(tls=None, timeout=2)
        assert isinstance(plain, RuntimeError), plain
        _, wrong = port.worker(secret=os.urandom(32), tls=client)
        assert isinstance(wrong, RuntimeError) and "refused our proof" in str(wrong), wrong
        reasons = port.wait_refused(4)
        assert any(r.startswith("TLS refused") for r in reasons), reasons
        assert "the worker did not prove the run's secret (wrong secret)" in reasons, reasons
    finally:
        port.close()


def test_tls_settings_are_read_as_ray_reads_them(cas):
    """No RAY_USE_TLS (or "0"): no TLS; "1" or "true" with a variable missing: an error naming it."""
    cluster, _ = cas
    assert channel.tls_contexts({}) is None and channel.tls_contexts({**cluster, "RAY_USE_TLS": "0"}) is None
    assert channel.tls_contexts({**cluster, "RAY_USE_TLS": "true"}) is not None
    partial = {k: v for k, v in cluster.items() if k != "RAY_TLS_CA_CERT"}
    with pytest.raises(ValueError, match="RAY_TLS_CA_CERT is not"):
        channel.tls_contexts(partial)
