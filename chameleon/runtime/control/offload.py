"""The planner's work and the recovery decisions in a child process, out of the controller's GIL.

At thousands of devices a precompute is seconds of Python: in a thread of the controller it holds the GIL the
event loop needs for leases and commits. :class:`InChild` runs the same requests
(:mod:`~chameleon.runtime.control.planning`) in a child process forked from the workers' forkserver (the
controller has threads: never a plain fork; a ``spawn`` child imported torch on its own, seconds that a loaded
host spent while the job trained undecided), which builds its own planner and coordinator from the core's picklable
:class:`~chameleon.runtime.control.planning.CostModel` and keeps today's two lanes, one thread each. The
precomputes' caches stay there; requests name the one they place from.

The parent's futures resolve when a result comes back (pickled: the transition or decision, and its moves already
encoded). What comes back is kept small (:func:`light`): a transition's manifest is only told by its size
(:class:`Moved`), and its :class:`~chameleon.runtime.protocol.messages.Parcels` carry every node's frame but the
:class:`~chameleon.runtime.protocol.messages.Moves` object of node 0 alone (the only node the controller hands an
object, to its agent in-process; the others get the frame): at thousands of devices the manifest and its parts as
objects were most of the pickle, and seconds of the loop's GIL to read. A decision's also wakes the event loop (a byte on :attr:`InChild.woken`). A search that raises comes back
as its future's exception. A child that dies fails every future under way and every later one with one
:class:`~chameleon.runtime.protocol.errors.TrainingError` (:meth:`InChild.check` raises it on the loop), never a hang.

Each request runs with Python's cyclic collector paused (:meth:`~chameleon.runtime.control.planning.Workshop.serve`);
the child collects once it has sent the result back, so the collections a request deferred never fall on the next
request (at 256 devices a decision waited 0.16 s for the full collection its own arrival set off), and it freezes
what it inherited from the forkserver (torch and the modules, 257,000 objects, 0.1 s a full collection) out of
every collection.

Plans travel once: each side keeps the plans the other knows by a key (the parent's resident plan, the child's
decided ones), so a later request for the same plan names it and the child finds its own object, with the layouts
and holdings its coordinator keeps for it; the parent says when it forgets one.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import queue
import signal
import threading
import traceback
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from pathlib import Path

from chameleon.decision.coordinator import Coordinator
from chameleon.decision.planner import Planner
from chameleon.layout.plan import Plan
from chameleon.runtime.control.planning import (
    DECIDER,
    PLANNER,
    CostModel,
    Request,
    Workshop,
    collect_unless_paused,
)
from chameleon.runtime.protocol.messages import Parcels
from chameleon.runtime.protocol.errors import TrainingError

OWN_NODE = 0  # the controller's own node: its agent is handed the Moves object (controller.py: _send)
PLANS_KEPT = 8  # plans each side keeps by key
STOP_S = 5.0  # the child exits this soon when asked, or is terminated, then killed
STOPPING = {signal.SIGINT, signal.SIGTERM}
PROCESS_NAME = "chameleon-plan"


@dataclass(frozen=True)
class Known:
    """A plan by its key: ``plan`` the first time it travels, None once the receiver has it."""

    key: int
    plan: Plan | None = None


@dataclass(frozen=True)
class Job:
    ident: int
    request: Request


@dataclass(frozen=True)
class Cancel:
    ident: int


@dataclass(frozen=True)
class Forget:
    key: int


@dataclass(frozen=True)
class Model:
    cost: CostModel


@dataclass(frozen=True)
class Stop:
    """The child's cue to leave."""


@dataclass(frozen=True)
class Result:
    """A request's outcome (``ok``: its value, else its exception), and the key the child keeps its plan by."""

    ident: int
    ok: bool
    value: object
    key: int | None = None


@dataclass(frozen=True)
class Moved:
    """A manifest told by its size, in its place in a transition from the child: what the controller records of it
    (the wire bytes of each round, as :attr:`~chameleon.layout.relayout.Manifest.round_bytes`) and, by being there,
    that the transition moves state; the moves themselves travel encoded, each node's part in its frame."""

    round_bytes: tuple[int, ...]

    @property
    def wire_bytes(self) -> int:
        return sum(self.round_bytes)


def light(value: object) -> object:
    """A request's result as it goes back to the parent: a transition's manifest replaced by :class:`Moved`, and its
    parcels' Moves objects dropped but node 0's (every frame kept); anything else as it is."""
    if not isinstance(value, tuple) or len(value) != 2:
        return value
    outcome, parcels = value
    manifest = getattr(outcome, "manifest", None)
    if manifest is None:
        return value
    if parcels is not None:
        parcels = Parcels(parcels.generation, {node: (moves if node == OWN_NODE else None, payload)
                                               for node, (moves, payload) in parcels.sends.items()})
    return replace(outcome, manifest=Moved(manifest.round_bytes)), parcels


class PlanningDied(TrainingError):
    """The planning child process ended under way."""


class InChild:
    """A :class:`~chameleon.runtime.control.planning.Planning` in a child process (see the module doc), started at
    once from ``context`` (the workers' forkserver: torch and this module preloaded) by a thread of its own: a
    forkserver answers only once its imports are done, and they overlap the controller's start-up; requests
    meanwhile wait in the pipe."""

    def __init__(self, context):
        self._conn, child_end = context.Pipe()
        self.process = context.Process(target=serve, args=(child_end,), name="chameleon-planning", daemon=True)
        self._starter = threading.Thread(target=self._start, args=(child_end,), name="chameleon-planning-start",
                                         daemon=True)
        self.woken, self._wake = os.pipe()
        os.set_blocking(self.woken, False)
        os.set_blocking(self._wake, False)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, str]] = {}
        self._ids = itertools.count()
        self._keys = itertools.count(1)  # the parent's plan keys; the child's are negative
        self._plans: OrderedDict[int, tuple[Plan, int]] = OrderedDict()  # by id(): the plan, its key
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.died: str | None = None
        self._closing = False
        self._sender = threading.Thread(target=self._send_loop, name="chameleon-planning-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="chameleon-planning-read", daemon=True)
        self._starter.start()
        self._sender.start()
        self._reader.start()

    def _start(self, child_end) -> None:
        try:
            self.process.start()
        except Exception as err:  # noqa: BLE001 - no decision can be taken: the loop hears it (check)
            self._died(f"the planning process could not start ({type(err).__name__}: {err})")
        finally:
            child_end.close()  # the reader sees the child's end close, not only its own

    @property
    def pid(self) -> int | None:
        """The child's pid, once started (None if it could not start)."""
        self._starter.join()
        return self.process.pid

    # ----- Planning -------------------------------------------------------------------------------

    def submit(self, request: Request) -> Future:
        future = Future()
        with self._lock:
            if self.died is not None or self._closing:
                future.set_exception(PlanningDied(self.died or "planning failed: the planning process was closed"))
                return future
            ident = next(self._ids)
            self._pending[ident] = future, request.lane
            request = self._named(request)
        future.add_done_callback(lambda f: f.cancelled() and self._outbox.put(Cancel(ident)))
        self._outbox.put(Job(ident, request))
        return future

    def model(self, cost: CostModel, planner: Planner, coordinator: Coordinator) -> None:
        self._outbox.put(Model(cost))

    def check(self) -> None:
        """Raises :class:`PlanningDied` once the child died."""
        if self.died is not None:
            raise PlanningDied(self.died)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.woken, 4096)

    def close(self, grace_s: float = STOP_S) -> None:
        """Stop the child (asked, given ``grace_s``, then killed: never left behind) and fail what is still under
        way."""
        if self._closing:
            return
        self._closing = True
        self._outbox.put(Stop())
        if self.pid is not None:
            self.process.join(grace_s)
            if self.process.is_alive():  # it ignores SIGTERM (see serve)
                self.process.kill()
                self.process.join(STOP_S)
        self._outbox.put(None)
        self._sender.join(STOP_S)
        self._conn.close()
        self._reader.join(STOP_S)
        self._fail_all("the planning process was closed")
        os.close(self.woken)
        os.close(self._wake)

    # ----- plans by key ---------------------------------------------------------------------------

    def _named(self, request: Request) -> Request:
        """``request`` with each plan it carries replaced by its key (and the plan, the first time)."""
        changes = {}
        for f in fields(request):
            value = getattr(request, f.name)
            if isinstance(value, Plan):
                changes[f.name] = self._known(value)
        return replace(request, **changes) if changes else request

    def _known(self, plan: Plan) -> Known:
        entry = self._plans.get(id(plan))
        if entry is not None and entry[0] is plan:
            self._plans.move_to_end(id(plan))
            return Known(entry[1])
        key = next(self._keys)
        self._keep(plan, key)
        return Known(key, plan)

    def _keep(self, plan: Plan, key: int) -> None:
        self._plans[id(plan)] = plan, key
        while len(self._plans) > PLANS_KEPT:
            _, (_, old) = self._plans.popitem(last=False)
            self._outbox.put(Forget(old))

    # ----- the threads ----------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return  # the reader finds the child gone
            except Exception as err:  # noqa: BLE001 - a request that cannot be pickled fails alone
                if isinstance(message, Job):
                    self._resolve(Result(message.ident, False, err))

    def _read_loop(self) -> None:
        while True:
            try:
                result = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as err:  # noqa: BLE001 - a result that cannot be unpickled: the child is of no use
                self._died(f"its result could not be read ({type(err).__name__}: {err})")
                return
            self._resolve(result)
        if not self._closing and self.pid is not None:
            self.process.join(1.0)
            code = self.process.exitcode
            how = "is still running" if code is None else \
                f"exited with code {code}" + (f" (signal {-code})" if code < 0 else "")
            self._died(f"the planning process (pid {self.process.pid}) {how} and closed its pipe")

    def _resolve(self, result: Result) -> None:
        with self._lock:
            future, lane = self._pending.pop(result.ident, (None, None))
            transition = result.value[0] if result.ok and isinstance(result.value, tuple) else None
            plan = getattr(transition, "plan", None)
            if result.key is not None and isinstance(plan, Plan):
                self._keep(plan, result.key)
            elif result.key is not None:
                self._outbox.put(Forget(result.key))
        if future is None or not future.set_running_or_notify_cancel():
            return  # cancelled: it finishes unheard
        if result.ok:
            future.set_result(result.value)
        else:
            future.set_exception(result.value)
        if lane == DECIDER:
            self._ring()

    def _died(self, why: str) -> None:
        with self._lock:
            self.died = f"planning failed: {why}; no decision can be taken"
        self._ring()  # the loop, woken, finds it died (check), whatever it then finds of the futures
        self._fail_all(self.died)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(PlanningDied(why))

    def _ring(self) -> None:
        try:
            os.write(self._wake, b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken, or closed


# ----- the child ------------------------------------------------------------------------------------


def serve(conn) -> None:
    """The child's main: requests read in order (plans resolved by key as they arrive), run on their lane's
    thread, results sent back; it ends on :class:`Stop` or when the parent's end closes.

    A Ctrl-C or a SIGTERM to the process group is the controller's to handle (a preemption is a checkpoint, then
    the end): ignored here from the first instruction, and the child leaves when the controller says so. It is
    named ``chameleon-plan`` where the system shows process names (``ps``, ``top``)."""
    for signum in STOPPING:
        signal.signal(signum, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(PROCESS_NAME)
    gc.freeze()  # the forkserver's modules, never garbage (see the module doc)
    shop = Workshop()
    plans: dict[int, Plan] = {}
    keys = itertools.count(-1, -1)
    cancelled: set[int] = set()
    send_lock = threading.Lock()
    lanes = {PLANNER: queue.SimpleQueue(), DECIDER: queue.SimpleQueue()}

    def send(result: Result) -> None:
        with send_lock:
            try:
                conn.send(result)
            except (OSError, ValueError):
                os._exit(0)  # the parent is gone
            except Exception as err:  # noqa: BLE001 - a value that cannot be pickled: its text goes instead
                conn.send(Result(result.ident, False, RuntimeError(f"{type(err).__name__}: {err}"), None))

    def work(lane: queue.SimpleQueue) -> None:
        while (job := lane.get()) is not None:
            if job.ident in cancelled:
                cancelled.discard(job.ident)
                continue
            try:
                value = shop.serve(job.request)
            except Exception as err:  # noqa: BLE001 - the parent's future carries it
                send(Result(job.ident, False, _portable(err)))
                continue
            key = None
            plan = getattr(value[0], "plan", None) if isinstance(value, tuple) and value else None
            if isinstance(plan, Plan):
                key = next(keys)
                plans[key] = plan
            send(Result(job.ident, True, light(value), key))
            collect_unless_paused()

    threads = [threading.Thread(target=work, args=(q,), name=f"chameleon-{name}", daemon=True)
               for name, q in lanes.items()]
    for t in threads:
        t.start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        match message:
            case Model(cost=cost):
                shop.use(*cost.build())
            case Job(ident=ident, request=request):
                changes = {}
                for f in fields(request):
                    value = getattr(request, f.name)
                    if isinstance(value, Known):
                        if value.plan is not None:
                            plans[value.key] = value.plan
                        changes[f.name] = plans[value.key]
                lanes[request.lane].put(Job(ident, replace(request, **changes) if changes else request))
            case Cancel(ident=ident):
                cancelled.add(ident)
            case Forget(key=key):
                plans.pop(key, None)
            case Stop():
                break
    os._exit(0)  # a search under way is abandoned: nobody waits for it


def _portable(err: Exception) -> Exception:
    """``err`` if it pickles, else its text (with where it was raised)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        where = "".join(traceback.format_exception(err)[-3:])
        return RuntimeError(f"{type(err).__name__}: {err}\n{where}")
