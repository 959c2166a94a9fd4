"""Authenticated message links between node agents and the controller, over TCP.

Both ends hold the job's secret. On connect they prove it to each other with a
challenge–response (HMAC-SHA256 of a fresh random nonce, each way) before anything
else is read; a peer that cannot answer within ``HANDSHAKE_S`` is refused. After
that every frame on the wire is ``u32 length ‖ HMAC(key, direction ‖ sequence ‖
payload) ‖ payload``: a message that was forged, altered, replayed or reordered fails
verification, and the link is dropped without acting on it. Payloads are
:mod:`chameleon.runtime.protocol.codec` frames (JSON and raw tensor bytes): even a peer that
holds the secret can make the other end build only the codec's registered types.

A link's socket is non-blocking: :meth:`Link.send` queues what the kernel does not
take at once and :meth:`Link.flush` sends it when the socket is writable, so a
stalled peer can never block the controller's loop; :meth:`Link.receive` returns
every whole message that has arrived. The same encoded payload can be sent on many
links (:meth:`Link.send_payload`): a broadcast is encoded once.

This authenticates and integrity-protects the control traffic; it does not encrypt it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import queue
import secrets
import select
import socket
import struct
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.errors import LaunchError

HANDSHAKE_S = 5.0
_NONCE = 32
_MAC = 32
_LEN = struct.Struct("<I")
_MAX_FRAME = 1 << 30
_READ = 1 << 20  # bytes asked of the socket at a time
_AGENT, _CONTROLLER = b"agent", b"controller"


class AuthError(ConnectionError):
    """A peer did not prove the job's secret, or a message failed verification."""


class SecretMismatch(AuthError):
    """The controller and this agent do not hold the same secret."""


def job_key(secret: str) -> bytes:
    """The MAC key of a job's secret."""
    return hashlib.sha256(b"chameleon-control:" + secret.encode()).digest()


class Link:
    """One authenticated, ordered message channel over a non-blocking socket (see the module doc)."""

    def __init__(self, sock: socket.socket, key: bytes, *, mine: bytes, theirs: bytes, peer: str):
        self.sock, self.peer = sock, peer
        sock.setblocking(False)
        self._mac = hmac.new(key, digestmod=hashlib.sha256)
        self._mine, self._theirs = mine, theirs
        self._sent = self._received = 0
        self._out = bytearray()
        self._in = bytearray()
        self._closed = False
        self._early: list[tuple[object, bytes]] = []  # received, not yet returned (after a recv)
        self.decode = codec.decode
        self._lock = threading.Lock()
        self.bytes_sent = self.bytes_received = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: object) -> None:
        """Send ``message`` (queued if the socket cannot take it now).

        Raises:
            OSError: the link is broken.
        """
        self.send_payload(codec.encode(message))

    def send_payload(self, payload: bytes) -> None:
        """Send an encoded message (:func:`chameleon.runtime.protocol.codec.encode`)."""
        with self._lock:
            mac = self._digest(self._mine, self._sent, payload)
            self._sent += 1
            self._out += _LEN.pack(_MAC + len(payload)) + mac + payload
            self._flush()

    @property
    def buffered(self) -> bool:
        """True while messages already read wait for :meth:`receive` (its socket will not signal them)."""
        return bool(self._early)

    @property
    def pending(self) -> bool:
        """True while queued bytes wait for the socket to become writable."""
        return bool(self._out)

    def flush(self) -> None:
        """Send what the socket takes now of the queued bytes."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        while self._out:
            try:
                sent = self.sock.send(self._out)
            except BlockingIOError:
                return
            self.bytes_sent += sent
            del self._out[:sent]

    def receive(self) -> list[tuple[object, bytes]]:
        """Every whole message that has arrived, with its encoded payload (to forward unchanged).

        Raises:
            EOFError: the peer closed the link (after every message it sent was returned).
            AuthError: a message failed verification (the link must be dropped).
        """
        while True:
            try:
                chunk = self.sock.recv(_READ)
            except BlockingIOError:
                break
            except OSError as err:
                raise EOFError(str(err)) from err
            if not chunk:
                self._closed = True
                break
            self.bytes_received += len(chunk)
            self._in += chunk
            if len(chunk) < _READ:
                break  # drained for now: what comes later signals the socket again (one recv a message, not two)
        out, self._early = self._early, []
        while len(self._in) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._in)
            if not _MAC <= size <= _MAX_FRAME:
                raise AuthError(f"a frame from {self.peer} has an impossible length ({size})")
            if len(self._in) < _LEN.size + size:
                break
            frame = bytes(self._in[_LEN.size:_LEN.size + size])
            del self._in[:_LEN.size + size]
            mac, payload = frame[:_MAC], frame[_MAC:]
            if not hmac.compare_digest(mac, self._digest(self._theirs, self._received, payload)):
                raise AuthError(f"a message from {self.peer} failed verification (forged, altered or replayed)")
            self._received += 1
            try:
                out.append((self.decode(payload), payload))
            except codec.CodecError as err:
                raise AuthError(f"a message from {self.peer} is malformed: {err}") from None
        if not out and self._closed:
            raise EOFError(f"{self.peer} closed the link")
        return out

    def recv(self, timeout_s: float) -> object | None:
        """The next message within ``timeout_s`` (None if none came); those after it wait for :meth:`receive`."""
        deadline = time.monotonic() + timeout_s
        while not self._early:
            self._early = self.receive()
            left = deadline - time.monotonic()
            if self._early or left <= 0:
                break
            select.select([self.sock], [], [], left)
        return self._early.pop(0)[0] if self._early else None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def close_with(self, message: object, *, timeout_s: float = 1.0) -> None:
        """Send a last ``message``, waiting at most ``timeout_s`` for the socket to take it, and close."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(OSError):
            self.send(message)
            while self.pending and time.monotonic() < deadline:
                select.select([], [self.sock], [], max(0.0, deadline - time.monotonic()))
                self.flush()
        self.close()

    def _digest(self, direction: bytes, sequence: int, payload: bytes) -> bytes:
        mac = self._mac.copy()
        mac.update(direction + sequence.to_bytes(8, "big", signed=True))
        mac.update(payload)
        return mac.digest()


def connect(host: str, port: int, key: bytes, *, timeout_s: float = HANDSHAKE_S) -> Link:
    """The agent's end: connect to the controller and prove the secret both ways.

    Raises:
        OSError: the controller cannot be reached.
        SecretMismatch: the controller refused our proof of the secret, or could not prove it itself.
        AuthError: the peer is no controller (it sent no valid challenge).
    """
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        _tune(sock)
        challenge = _read(sock, _NONCE, timeout_s, f"{host}:{port}")
        mine = secrets.token_bytes(_NONCE)
        _write(sock, _handshake_mac(key, _AGENT, challenge) + mine)
        try:
            answer = _read(sock, _MAC, timeout_s, "the controller")
        except AuthError:  # it drops a peer whose proof fails
            raise SecretMismatch(f"the controller at {host}:{port} did not accept our proof of the secret") from None
        if not hmac.compare_digest(answer, _handshake_mac(key, _CONTROLLER, mine)):
            raise SecretMismatch(f"the controller at {host}:{port} does not hold this job's secret")
    except BaseException:
        sock.close()
        raise
    return Link(sock, key, mine=_AGENT, theirs=_CONTROLLER, peer=f"controller {host}:{port}")


def accept(sock: socket.socket, key: bytes, *, timeout_s: float = HANDSHAKE_S) -> Link:
    """The controller's end of a freshly accepted connection: challenge it, then answer its challenge.

    Raises:
        AuthError: the peer did not prove the secret in time; the connection is closed.
    """
    peer = "{}:{}".format(*sock.getpeername()[:2])
    try:
        _tune(sock)
        challenge = secrets.token_bytes(_NONCE)
        _write(sock, challenge)
        reply = _read(sock, _MAC + _NONCE, timeout_s, peer)
        if not hmac.compare_digest(reply[:_MAC], _handshake_mac(key, _AGENT, challenge)):
            raise AuthError(f"{peer} does not hold this job's secret")
        _write(sock, _handshake_mac(key, _CONTROLLER, reply[_MAC:]))
    except BaseException:
        sock.close()
        raise
    return Link(sock, key, mine=_CONTROLLER, theirs=_AGENT, peer=peer)


class Listener:
    """Accepts agents on ``(host, port)`` in a thread; each is authenticated in a thread of its own.

    Authenticated links and refusals arrive on :attr:`arrivals` as ``(link, None)`` or
    ``(None, "peer: why")``; :meth:`fileno` becomes readable whenever one arrives, so
    the controller's event loop can wait on it.
    """

    def __init__(self, host: str, port: int, key: bytes):
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=1024)
        self.port = self._sock.getsockname()[1]
        self._key = key
        self.arrivals: queue.SimpleQueue[tuple[Link | None, str | None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        threading.Thread(target=self._accept_forever, name="chameleon-listener", daemon=True).start()

    def fileno(self) -> int:
        return self._wake_r

    def drain(self) -> list[tuple[Link | None, str | None]]:
        """Everything that arrived since the last call."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 1 << 16)
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


def _handshake_mac(key: bytes, direction: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, direction + (-1).to_bytes(8, "big", signed=True) + nonce, hashlib.sha256).digest()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _write(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _read(sock: socket.socket, size: int, timeout_s: float, who: str) -> bytes:
    """A handshake message of exactly ``size`` bytes within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    data = b""
    want = _LEN.size + size
    while len(data) < want:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuthError(f"{who} sent nothing within {timeout_s:.0f} s of connecting" if not data else
                            f"{who} sent a malformed handshake (too short)")
        sock.settimeout(left)
        try:
            chunk = sock.recv(want - len(data))
        except TimeoutError:
            continue
        except OSError as err:
            raise AuthError(f"{who} closed the connection or sent a malformed handshake: {err}") from err
        if not chunk:
            raise AuthError(f"{who} closed the connection during the handshake")
        data += chunk
        if len(data) >= _LEN.size and _LEN.unpack_from(data)[0] != size:
            raise AuthError(f"{who} sent a malformed handshake ({_LEN.unpack_from(data)[0]} bytes)")
    sock.settimeout(None)
    return data[_LEN.size:]


def open_meeting_points(launcher, secret: str) -> tuple[dist.TCPStore, Listener | None]:
    """Node 0's c10d store (every generation's rendezvous) and, with several nodes, its listener for the agents.

    Raises:
        LaunchError: a port was taken since the job was checked (names the key and the fix).
    """
    from chameleon.runtime.node.preflight import ports_problem

    try:
        store = dist.TCPStore(launcher.master_addr, launcher.master_port, is_master=True,
                              timeout=timedelta(seconds=launcher.timeout_s), wait_for_workers=False)
        listener = Listener(launcher.master_addr, launcher.control_port, job_key(secret)) \
            if launcher.nnodes > 1 else None
    except (dist.DistNetworkError, OSError) as err:
        raise LaunchError(ports_problem(launcher) or str(err)) from None
    return store, listener
