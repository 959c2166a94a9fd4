"""A link reads what its socket signals: frames larger than one read, frames behind them, and the peer's close."""

from __future__ import annotations

import select
import selectors
import socket
import threading

import torch

from chameleon.runtime.node.wire import Link
from chameleon.runtime.protocol.messages import FinalShards, Lease


def linked() -> tuple[Link, Link]:
    a, b = socket.socketpair()
    key = b"k" * 32
    return Link(a, key, mine=b"a", theirs=b"b", peer="a"), Link(b, key, mine=b"b", theirs=b"a", peer="b")


def test_every_message_arrives_whole_and_in_order_read_as_the_socket_signals_then_the_close():
    sender, receiver = linked()
    big = torch.arange(3 << 18, dtype=torch.float32)  # 3 MiB: several reads of the socket
    sent = [Lease(1, 0), FinalShards(2, 0, {"w": (((0, big.numel()),), big)}), *(Lease(1, g) for g in range(1, 200))]

    def send_all():
        for message in sent:
            sender.send(message)
            while sender.pending:
                select.select([], [sender.sock], [], 5.0)
                sender.flush()
        sender.close()

    thread = threading.Thread(target=send_all)
    thread.start()
    got, closed = [], False
    with selectors.DefaultSelector() as watch:
        watch.register(receiver.sock, selectors.EVENT_READ)
        while not closed:
            assert watch.select(timeout=10.0), "the socket went quiet before the close"
            try:
                got += [message for message, _ in receiver.receive()]
            except EOFError:
                closed = True
    thread.join()
    assert [type(m) for m in got] == [type(m) for m in sent] and got[0] == sent[0] and got[2:] == sent[2:]
    assert torch.equal(got[1].shards["w"][1], big)
