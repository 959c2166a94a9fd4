"""Authenticated message links between node agents and the controller, over TCP.

Both ends hold the job's secret. On connect they prove it to each other with a
challenge–response (HMAC-SHA256 of a fresh random nonce, each way) before anything
is unpickled; a peer that cannot answer within ``HANDSHAKE_S`` is refused. After
that every message is ``HMAC(key, direction ‖ sequence ‖ payload) ‖ payload``: a
message that was forged, altered, replayed or reordered fails verification, and the
link is dropped without acting on it. Payloads are pickles of the typed messages
(:mod:`chameleon.runtime.messages`), read only after their MAC checks out.

This authenticates and integrity-protects the control traffic; it does not encrypt it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pickle
import queue
import secrets
import socket
import struct
import threading
from multiprocessing.connection import Connection

HANDSHAKE_S = 5.0
_NONCE = 32
_MAC = 32
_HANDSHAKE_MAX = 256  # bytes a peer may send before it is authenticated
_AGENT, _CONTROLLER = b"agent", b"controller"


class AuthError(ConnectionError):
    """A peer did not prove the job's secret, or a message failed verification."""


class SecretMismatch(AuthError):
    """The controller and this agent do not hold the same secret."""


def job_key(secret: str) -> bytes:
    """The MAC key of a job's secret."""
    return hashlib.sha256(b"chameleon-control:" + secret.encode()).digest()


class Link:
    """One authenticated, ordered message channel; ``send`` is safe from several threads."""

    def __init__(self, conn: Connection, key: bytes, *, mine: bytes, theirs: bytes, peer: str):
        self.conn, self.peer = conn, peer
        self._key, self._mine, self._theirs = key, mine, theirs
        self._sent = self._received = 0
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self.conn.fileno()

    def send(self, message: object) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            mac = _mac(self._key, self._mine, self._sent, payload)
            self._sent += 1
            self.conn.send_bytes(mac + payload)

    def recv(self) -> object:
        """The next message.

        Raises:
            EOFError: the peer closed the link.
            AuthError: the message failed verification (the link must be dropped).
        """
        data = self.conn.recv_bytes()
        mac, payload = data[:_MAC], data[_MAC:]
        if not hmac.compare_digest(mac, _mac(self._key, self._theirs, self._received, payload)):
            raise AuthError(f"a message from {self.peer} failed verification (forged, altered or replayed)")
        self._received += 1
        return pickle.loads(payload)

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


def connect(host: str, port: int, key: bytes, *, timeout_s: float = HANDSHAKE_S) -> Link:
    """The agent's end: connect to the controller and prove the secret both ways.

    Raises:
        OSError: the controller cannot be reached.
        SecretMismatch: the controller refused our proof of the secret, or could not prove it itself.
        AuthError: the peer is no controller (it sent no valid challenge).
    """
    sock = socket.create_connection((host, port), timeout=timeout_s)
    conn = _connection(sock, timeout_s)
    try:
        challenge = _read(conn, _NONCE, timeout_s, f"{host}:{port}")
        mine = secrets.token_bytes(_NONCE)
        conn.send_bytes(_mac(key, _AGENT, -1, challenge) + mine)
        try:
            answer = _read(conn, _MAC, timeout_s, "the controller")
        except AuthError:  # it drops a peer whose proof fails
            raise SecretMismatch(f"the controller at {host}:{port} did not accept our proof of the secret") from None
        if not hmac.compare_digest(answer, _mac(key, _CONTROLLER, -1, mine)):
            raise SecretMismatch(f"the controller at {host}:{port} does not hold this job's secret")
        _receive_timeout(conn, 0.0)
    except BaseException:
        conn.close()
        raise
    return Link(conn, key, mine=_AGENT, theirs=_CONTROLLER, peer=f"controller {host}:{port}")


def accept(sock: socket.socket, key: bytes, *, timeout_s: float = HANDSHAKE_S) -> Link:
    """The controller's end of a freshly accepted connection: challenge it, then answer its challenge.

    Raises:
        AuthError: the peer did not prove the secret in time; the connection is closed.
    """
    peer = "{}:{}".format(*sock.getpeername()[:2])
    conn = _connection(sock, timeout_s)
    try:
        challenge = secrets.token_bytes(_NONCE)
        conn.send_bytes(challenge)
        reply = _read(conn, _MAC + _NONCE, timeout_s, peer)
        if not hmac.compare_digest(reply[:_MAC], _mac(key, _AGENT, -1, challenge)):
            raise AuthError(f"{peer} does not hold this job's secret")
        conn.send_bytes(_mac(key, _CONTROLLER, -1, reply[_MAC:]))
        _receive_timeout(conn, 0.0)
    except BaseException:
        conn.close()
        raise
    return Link(conn, key, mine=_CONTROLLER, theirs=_AGENT, peer=peer)


class Listener:
    """Accepts agents on ``(host, port)`` in a thread; each is authenticated in a thread of its own.

    Authenticated links and refusals arrive on :attr:`arrivals` as ``(link, None)`` or
    ``(None, "peer: why")``; :meth:`fileno` becomes readable whenever one arrives, so
    the controller's event loop can wait on it.
    """

    def __init__(self, host: str, port: int, key: bytes):
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._key = key
        self.arrivals: queue.SimpleQueue[tuple[Link | None, str | None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        threading.Thread(target=self._accept_forever, name="chameleon-listener", daemon=True).start()

    def fileno(self) -> int:
        return self._wake_r

    def drain(self) -> list[tuple[Link | None, str | None]]:
        """Everything that arrived since the last call."""
        os.read(self._wake_r, 4096)
        out = []
        while not self.arrivals.empty():
            out.append(self.arrivals.get())
        return out

    def close(self) -> None:
        """Stop listening: the accepting thread ends, and a connection attempt from now on is refused."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # close() alone leaves a blocked accept() accepting once more
        self._sock.close()

    def _accept_forever(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._authenticate, args=(sock,), name="chameleon-handshake", daemon=True).start()

    def _authenticate(self, sock: socket.socket) -> None:
        try:
            self.arrivals.put((accept(sock, self._key), None))
        except (AuthError, OSError, EOFError) as err:
            self.arrivals.put((None, str(err)))
        os.write(self._wake_w, b"x")


def _mac(key: bytes, direction: bytes, sequence: int, payload: bytes) -> bytes:
    return hmac.new(key, direction + sequence.to_bytes(8, "big", signed=True) + payload, hashlib.sha256).digest()


def _connection(sock: socket.socket, timeout_s: float) -> Connection:
    """A blocking :class:`Connection` on ``sock`` whose reads give up after ``timeout_s`` (until cleared)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    _receive_timeout(conn, timeout_s)
    return conn


def _receive_timeout(conn: Connection, seconds: float) -> None:
    """Bound every read on ``conn`` at the socket level (0: no bound), so a stalled peer cannot pin a thread."""
    view = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        view.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
    finally:
        view.close()


def _read(conn: Connection, size: int, timeout_s: float, who: str) -> bytes:
    """A handshake message of exactly ``size`` bytes within ``timeout_s``."""
    if not conn.poll(timeout_s):
        raise AuthError(f"{who} sent nothing within {timeout_s:.0f} s of connecting")
    try:
        data = conn.recv_bytes(_HANDSHAKE_MAX)
    except (OSError, EOFError) as err:
        raise AuthError(f"{who} closed the connection or sent a malformed handshake: {err}") from err
    if len(data) != size:
        raise AuthError(f"{who} sent a malformed handshake ({len(data)} bytes)")
    return data
