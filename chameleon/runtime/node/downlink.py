"""From a node agent down to one of its workers: a pipe of pushed frames and a few words of shared memory.

The controller pushes the job's state (a new generation, its start, each commit,
a fault) to every node's agent; the agent hands each frame, unchanged, to each
of its workers. A worker therefore learns of a commit or a fault without a
network round trip and never polls the network while it trains.

- :class:`Downlink` (the agent's end) writes frames to the worker's pipe from a
  thread of its own, in order, so a worker busy in a long step never blocks the
  agent; once a :class:`~chameleon.runtime.protocol.messages.Flag` frame is in the pipe it
  marks the generation broken in the shared words. Everything pushed before a
  flag is therefore readable once the flag is visible — the worker that sees a
  fault re-reads its pipe and finds any commit the controller made first.
- The shared words also hold the agent's pulse, bumped every tick: a worker
  whose agent (and so, on node 0, the controller) stopped answering for the
  liveness bound leaves on its own.
- :class:`Inbox` (the worker's end) reads frames as they come and keeps what they
  say: the newest generation spec, started generations, commits, flags, the end.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection

from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.errors import ControllerLost
from chameleon.faults.spec import FaultSpec
from chameleon.runtime.protocol.messages import Begin, Commit, End, Flag, GenerationSpec, Inject, Moves, Publish

_PULSE, _FLAGS = 0, 1
RING = 64  # flags of the last RING generations are kept; a worker is never that many generations behind


def board_words(ctx):
    """Shared words for one worker's board, from a ``multiprocessing`` context."""
    return ctx.RawArray("q", _FLAGS + RING)


def flagged(words, generation: int) -> bool:
    """Whether ``generation`` was flagged broken on a board."""
    return words[_FLAGS + generation % RING] == generation + 1


class Downlink:
    """The agent's end of one worker's downlink (see the module doc)."""

    def __init__(self, conn: Connection, words):
        self.conn, self.words = conn, words
        self._queue: queue.SimpleQueue[tuple[bytes, int | None] | None] = queue.SimpleQueue()
        threading.Thread(target=self._write, name="chameleon-downlink", daemon=True).start()

    def push(self, frame: bytes, *, flags: int | None = None) -> None:
        """Send ``frame``; ``flags``: the generation it flags broken, marked once the frame is in the pipe."""
        self._queue.put((frame, flags))

    def pulse(self) -> None:
        self.words[_PULSE] += 1

    def close(self) -> None:
        self._queue.put(None)

    def _write(self) -> None:
        while (item := self._queue.get()) is not None:
            frame, flags = item
            try:
                self.conn.send_bytes(frame)
            except OSError:
                return  # the worker is gone; its exit is reported by its sentinel
            if flags is not None:
                self.words[_FLAGS + flags % RING] = flags + 1
        self.conn.close()


class Inbox:
    """A worker's end of its downlink: what the controller pushed, as far as it has been read.

    Args:
        conn: the pipe's reading end.
        words: the shared board.
        silence_s: how long the agent's pulse may stand still before the worker leaves
            (:class:`~chameleon.runtime.protocol.errors.ControllerLost`).
    """

    def __init__(self, conn: Connection, words, *, silence_s: float):
        self.conn, self.words, self.silence_s = conn, words, silence_s
        self.spec: GenerationSpec | None = None
        self.moves: dict = {}
        self.begun: set[int] = set()
        self.commits: dict[tuple[int, int], Commit] = {}
        self.flags: set[int] = set()
        self.injected: list[FaultSpec] = []  # faults the controller fired at their time that the worker paces
        self.ended = False
        self._pulse, self._pulse_seen = -1, time.monotonic()

    def flagged(self, generation: int) -> bool:
        """Whether ``generation`` is broken (from shared memory: no system call)."""
        return flagged(self.words, generation)

    def pump(self, timeout_s: float) -> None:
        """Read every frame that arrives within ``timeout_s`` (at least those already waiting).

        Raises:
            ControllerLost: the agent is gone, or its pulse stood still for ``silence_s``.
        """
        try:
            ready = self.conn.poll(timeout_s)
            while ready:
                self._keep(codec.decode(self.conn.recv_bytes()))
                ready = self.conn.poll()
        except (EOFError, OSError) as err:
            raise ControllerLost("its node agent is gone") from err
        self.alive()

    def alive(self) -> None:
        """Raise :class:`ControllerLost` once the agent's pulse stood still for ``silence_s``."""
        pulse, now = self.words[_PULSE], time.monotonic()
        if pulse != self._pulse:
            self._pulse, self._pulse_seen = pulse, now
        elif now - self._pulse_seen > self.silence_s:
            raise ControllerLost(f"no word from its node agent for {self.silence_s:.0f} s")

    def _keep(self, message: object) -> None:
        match message:
            case Moves(generation=g, manifest=manifest):
                self.moves[g] = manifest
            case Publish(spec=spec):
                if spec.moves:  # its Moves came first, on the same pipe (a node that joined later has none:
                    spec = replace(spec, manifest=self.moves.pop(spec.generation, None))  # none of it is a member)
                if self.spec is None or spec.generation > self.spec.generation:
                    self.spec = spec
            case Begin(generation=g):
                self.begun.add(g)
            case Commit():
                self.commits[message.generation, message.step] = message
            case Flag(generation=g):
                self.flags.add(g)
            case End():
                self.ended = True
            case Inject(fault=fault):
                self.injected.append(fault)
            case _:
                raise ControllerLost(f"its node agent pushed {type(message).__name__}, which is not a pushed message")

    def forget(self, generation: int) -> None:
        """Drop what is kept of generations before ``generation`` (they are over for this worker)."""
        self.commits = {k: c for k, c in self.commits.items() if k[0] >= generation}
        self.begun = {g for g in self.begun if g >= generation}
        self.flags = {g for g in self.flags if g >= generation}
        self.moves = {g: m for g, m in self.moves.items() if g >= generation}
