"""A remote worker's connection to the supervisor: both ends prove the run's secret without sending it, within a
deadline, inside TLS where Ray runs with TLS.

    node host (client: connect)                         supervisor (server: remote.Listener drives `serve`)
      [TLS handshake, both ends verify against the cluster's CA: only where RAY_USE_TLS is set]
      ── HELLO · token (16 B) ─────────────────────────▶  key = HMAC-SHA256(secret, token): this worker's key
      ◀── #CHALLENGE#{sha256} · 40 random bytes ───────   deliver_challenge: the node host proves the key
      ── {sha256} · HMAC(key, challenge) ─────────────▶   hmac.compare_digest ─▶ wrong: #FAILURE#, closed
      ◀── #WELCOME# ───────────────────────────────────
      ── #CHALLENGE#{sha256} · 40 random bytes ───────▶   answer_challenge: the supervisor proves the key
      ◀── {sha256} · HMAC(key, challenge) ─────────────
      hmac.compare_digest ─▶ wrong: #FAILURE#, closed, no worker forked
      ── #WELCOME# ───────────────────────────────────▶   the socket goes to the RemoteWorker that waits on token
    then the worker's msgspec frames (shared/framing.py), on the same socket (or, with TLS, relayed: TlsRelay)

Each message is framed as multiprocessing.connection frames it (a 4-byte big-endian length, at most 256 bytes).
The node host never holds the run's secret: it gets the worker's key (and its token) through Ray, so a stolen
token is worthless without the key, a key opens one connection (the token is forgotten once its connection is
taken), and a recorded exchange cannot be replayed (both challenges are fresh). What this does not give: after the
handshake the frames are neither encrypted nor integrity-protected unless TLS is on (docs/scale.md, "Trust").

Owns the handshake, its deadline, the TLS contexts and the TLS relay; it never reads a frame and never decides
which worker a connection belongs to (remote.Listener does).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import ssl
import struct
import threading
import time
from typing import Generator

MAGIC = b"LWSUP02\n"
TOKEN_BYTES = 16
SECRET_BYTES = 32
HANDSHAKE_SECONDS = 10.0  # a connection that has not finished its handshake by then is closed (either end)

# Why not call multiprocessing.connection.deliver_challenge / answer_challenge themselves: on Python 3.11 (the
# oldest we support) they use HMAC-MD5 and compare with `==`, check the challenge with an `assert` (gone under -O),
# and block in recv_bytes without any deadline, which would let one silent peer hold the supervisor's listener.
# What follows mirrors Python 3.12's version exactly (the same constants, the `{sha256}` digest prefix inside
# the challenge and the response, hmac.compare_digest, each end challenging the other in the same order), with
# every read and write bounded by the handshake's deadline and no fallback to MD5.
_CHALLENGE = b"#CHALLENGE#"
_WELCOME = b"#WELCOME#"
_FAILURE = b"#FAILURE#"
_DIGEST = b"{sha256}"
MESSAGE_LENGTH = 40  # random bytes in a challenge, as multiprocessing.connection's
MAX_MESSAGE = 256  # as multiprocessing.connection's recv_bytes(256): a longer one is refused unread
_HEADER = struct.Struct("!i")

# What a handshake step waits for: the socket readable or writable (selectors' values).
READ, WRITE = 1, 2


class HandshakeRefused(ConnectionError):
    """The peer failed to prove the run's secret (or refused our proof), or TLS verification failed: not retried."""


class HandshakeBroken(ConnectionError):
    """The connection closed or broke before the handshake ended (a flood's eviction, a restart): may be retried."""


def worker_key(secret: bytes, token: bytes) -> bytes:
    """The key one worker's connection proves: bound to its token, so a token alone opens nothing."""
    return hmac.new(secret, b"layerwise worker key " + token, hashlib.sha256).digest()


# ---- the protocol, as generators: each yields READ or WRITE when the (non-blocking) socket must wait ---------
Steps = Generator[int, None, object]


def _send(sock: socket.socket, data: bytes) -> Steps:
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        try:
            n = sock.send(view)
        except (BlockingIOError, ssl.SSLWantWriteError):
            yield WRITE
            continue
        except ssl.SSLWantReadError:
            yield READ
            continue
        view = view[n:]


def _recv_exact(sock: socket.socket, n: int, what: str) -> Steps:
    # exactly n bytes, never more: what follows the handshake on this socket is the worker's, not ours
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except (BlockingIOError, ssl.SSLWantReadError):
            yield READ
            continue
        except ssl.SSLWantWriteError:
            yield WRITE
            continue
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError) as exc:
            raise HandshakeBroken(f"the connection broke waiting for {what} ({exc.__class__.__name__})") from None
        if not chunk:
            raise HandshakeBroken(f"the connection closed waiting for {what}")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket, what: str) -> Steps:
    (length,) = _HEADER.unpack((yield from _recv_exact(sock, _HEADER.size, what)))
    if not 0 < length <= MAX_MESSAGE:
        raise HandshakeRefused(f"not our handshake ({what} announced {length} bytes)")
    return (yield from _recv_exact(sock, length, what))


def _response(key: bytes, challenge: bytes) -> bytes:
    return _DIGEST + hmac.new(key, challenge, hashlib.sha256).digest()


def _deliver_challenge(sock: socket.socket, key: bytes, peer_role: str) -> Steps:
    """The peer must answer our fresh challenge with HMAC(key, challenge)."""
    challenge = _DIGEST + os.urandom(MESSAGE_LENGTH)
    yield from _send(sock, _CHALLENGE + challenge)
    answer = yield from _recv(sock, f"the {peer_role}'s answer to our challenge")
    if not hmac.compare_digest(answer, _response(key, challenge)):
        yield from _send(sock, _FAILURE)
        raise HandshakeRefused(f"the {peer_role} did not prove the run's secret (wrong secret)")
    yield from _send(sock, _WELCOME)


def _answer_challenge(sock: socket.socket, key: bytes, peer_role: str) -> Steps:
    """Prove the key to the peer: answer its challenge; it says WELCOME or FAILURE."""
    message = yield from _recv(sock, f"the {peer_role}'s challenge")
    if not message.startswith(_CHALLENGE + _DIGEST) or len(message) < len(_CHALLENGE + _DIGEST) + 20:
        raise HandshakeRefused(f"the {peer_role} sent no challenge of ours")
    yield from _send(sock, _response(key, message[len(_CHALLENGE):]))
    verdict = yield from _recv(sock, f"the {peer_role}'s verdict on our answer")
    if verdict != _WELCOME:
        raise HandshakeRefused(f"the {peer_role} refused our proof of the run's secret (it holds another one)")


def _tls_handshake(sock: ssl.SSLSocket) -> Steps:
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            yield READ
        except ssl.SSLWantWriteError:
            yield WRITE
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError) as exc:
            raise HandshakeBroken(f"the connection broke during TLS ({exc.__class__.__name__})") from None
        except ssl.SSLError as exc:  # certificate verification, protocol: the peer is not one of the cluster's
            raise HandshakeRefused(f"TLS refused: {exc.reason or exc}") from None


def serve(sock: socket.socket, secret: bytes, tls: ssl.SSLContext | None) -> Steps:
    """The supervisor's side on an accepted non-blocking socket; returns (socket, token): the socket is the TLS one
    when `tls` is set. Raises HandshakeRefused or HandshakeBroken."""
    if tls is not None:
        sock = tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    try:
        if tls is not None:
            yield from _tls_handshake(sock)
        hello = yield from _recv(sock, "a worker's hello")
        if len(hello) != len(MAGIC) + TOKEN_BYTES or not hello.startswith(MAGIC):
            raise HandshakeRefused("not a worker's hello")
        token = hello[len(MAGIC):]
        key = worker_key(secret, token)
        yield from _deliver_challenge(sock, key, "worker")
        yield from _answer_challenge(sock, key, "worker")
    except BaseException:  # a refusal, or the listener closing it (GeneratorExit): the TLS socket is ours to close
        _close(sock)
        raise
    return sock, token


def client(sock: socket.socket, token: bytes, key: bytes) -> Steps:
    """The node host's side on a connected non-blocking socket (TLS already done); raises HandshakeRefused (the
    peer is not our supervisor, or refused our key) or HandshakeBroken."""
    yield from _send(sock, MAGIC + token)
    yield from _answer_challenge(sock, key, "supervisor")
    yield from _deliver_challenge(sock, key, "supervisor")


def drive(steps: Steps, sock: socket.socket, deadline: float):
    """Run a handshake's steps on one socket, blocking in select() until `deadline` at most; TimeoutError past
    it. Returns what the steps return."""
    try:
        want = next(steps)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no complete handshake within {HANDSHAKE_SECONDS:.0f}s")
            r, w, _ = select.select([sock] if want == READ else [], [sock] if want == WRITE else [], [], left)
            if not (r or w):
                continue  # the deadline check above ends it
            want = steps.send(None)
    except StopIteration as done:
        return done.value


def connect(host: str, port: int, token: bytes, key: bytes, tls: ssl.SSLContext | None,
            deadline: float) -> socket.socket:
    """A connection to the run's port with the handshake done (a TLS socket when `tls` is set), retried after a
    broken attempt (the listener under a flood closes the oldest unfinished handshakes) until `deadline`.
    Raises HandshakeRefused at once, TimeoutError (or the last OSError) once the deadline has passed."""
    backoff = 0.05
    while True:
        sock = None
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no connection to the run's port {host}:{port} within the deadline")
            sock = socket.create_connection((host, port), timeout=left)
            sock.setblocking(False)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_side=False, do_handshake_on_connect=False)
                drive(_tls_handshake(sock), sock, deadline)
            drive(client(sock, token, key), sock, deadline)
            sock.setblocking(True)
            return sock
        except HandshakeRefused:
            _close(sock)
            raise
        except (HandshakeBroken, OSError) as exc:  # TimeoutError among them
            _close(sock)
            if time.monotonic() + backoff >= deadline or isinstance(exc, TimeoutError):
                raise
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)


def _close(sock) -> None:
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass


# ---- TLS: Ray's own certificates ---------------------------------------------------------------------------------
TLS_ENV = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


def tls_wanted(environ=os.environ) -> bool:
    """Whether Ray runs with TLS here: as ray._common.tls_utils reads RAY_USE_TLS."""
    return environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def tls_contexts(environ=os.environ) -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """(server, client) contexts from Ray's TLS variables, None where Ray runs without TLS. As Ray's gRPC does
    (ray._common.tls_utils.load_certs_from_env, grpc_utils.init_grpc_channel), every node presents the same
    RAY_TLS_SERVER_CERT / KEY as server and as client and both ends require a peer certificate signed by
    RAY_TLS_CA_CERT. Raises ValueError naming what is missing or unreadable."""
    if not tls_wanted(environ):
        return None
    missing = [v for v in TLS_ENV if not environ.get(v)]
    if missing:
        raise ValueError(f"RAY_USE_TLS is set but {', '.join(missing)} is not: Ray's TLS needs "
                         "RAY_TLS_SERVER_CERT, RAY_TLS_SERVER_KEY and RAY_TLS_CA_CERT")
    cert, key, ca = (environ[v] for v in TLS_ENV)
    contexts = []
    for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # The peer is any holder of a certificate of the cluster's CA, as for Ray itself: one certificate is
        # shared by every node and names whatever its deployment chose, so no host name is matched.
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_cert_chain(cert, key)
            ctx.load_verify_locations(ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"Ray's TLS certificates cannot be used ({cert}, {key}, {ca}): "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
        contexts.append(ctx)
    return contexts[0], contexts[1]


class TlsRelay:
    """Bytes both ways between a TLS connection and a plain socket (the end a worker or a Reader/Writer uses),
    on one thread: an OpenSSL connection must not be read and written by two threads at once. Either side's end
    (EOF or an error) flushes what the other side is owed, within FLUSH_SECONDS, then closes both, so EOF still
    means the peer is gone."""

    CHUNK = 65536
    FLUSH_SECONDS = 5.0
    POLL = 1.0  # close() is noticed within it

    def __init__(self, tls: ssl.SSLSocket, plain: socket.socket, name: str):
        self.tls, self.plain = tls, plain
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        tls, plain = self.tls, self.plain
        tls.setblocking(False)
        plain.setblocking(False)
        to_plain, to_tls = bytearray(), bytearray()
        ended_at = None  # when one side ended: the other gets what it is owed, then both close
        try:
            while not self._closed:
                wait_r, wait_w, moved = set(), set(), False
                if ended_at is None and len(to_plain) < self.CHUNK:
                    got = _read(tls, wait_r, wait_w)
                    if got is None:
                        ended_at = time.monotonic()
                    elif got:
                        to_plain += got
                        moved = True
                if ended_at is None and len(to_tls) < self.CHUNK:
                    got = _read(plain, wait_r, wait_w)
                    if got is None:
                        ended_at = time.monotonic()
                    elif got:
                        to_tls += got
                        moved = True
                for buf, sock in ((to_plain, plain), (to_tls, tls)):
                    if buf:
                        n = _write(sock, buf, wait_r, wait_w)
                        if n:
                            del buf[:n]
                            moved = True
                if ended_at is not None and (not (to_plain or to_tls)
                                             or time.monotonic() - ended_at > self.FLUSH_SECONDS):
                    return
                if not moved:
                    select.select(list(wait_r), list(wait_w), [], self.POLL)
        except OSError:
            return  # a reset or a timed-out peer (TCP_USER_TIMEOUT): both ends close, as a dropped pipe would
        finally:
            _close(tls)
            _close(plain)


def _read(sock, wait_r: set, wait_w: set) -> bytes | None:
    """Bytes read now (b'' if none yet, noting what to wait for), None at the end of the stream."""
    try:
        data = sock.recv(TlsRelay.CHUNK)
    except (BlockingIOError, ssl.SSLWantReadError):
        wait_r.add(sock)
        return b""
    except ssl.SSLWantWriteError:
        wait_w.add(sock)
        return b""
    except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
        return None
    return data or None


def _write(sock, buf: bytearray, wait_r: set, wait_w: set) -> int:
    try:
        return sock.send(buf[:TlsRelay.CHUNK])
    except (BlockingIOError, ssl.SSLWantWriteError):
        wait_w.add(sock)
    except ssl.SSLWantReadError:
        wait_r.add(sock)
    return 0
