"""The control plane at scale: the real controller against thousands of emulated devices.

Usage::

    python benchmarks/bench_control_plane.py [--devices N ...] [--json FILE] [--plot PNG] [--quick] [--step-s 0.5]
                                             [--after 14] [--lose 1]
    python benchmarks/bench_control_plane.py --report FILE [--plot PNG]

For each size (64 → 8,192 devices, 8 per node; ``--devices`` picks sizes) it starts the
real :class:`~chameleon.runtime.control.controller.Controller` in this process — its protocol
core, the real selector and planner on Llama-2-7B shapes (the analytic H100 profile,
one 8-stage pipeline per node), its links and its recorder — and node agents that
speak the real protocol (:class:`~chameleon.runtime.node.agent.Agent` over real
authenticated links on loopback), packed by the hundred into a few emulator
processes. Only the workers are emulated: a step is a sleep of ``--step-s`` with
±10 % jitter on the job's first plan, and on any other scaled by its slowest pipeline's 1F1B length
((micro-batches + stages − 1) × its largest stage's layers: a re-plan onto fewer devices steps slower, as
real ones do, so a growth back can pay), after which each device hands its agent the ``Synced`` its plan implies
(the samples of the micro-batches whose last stage it runs), and a commit starts the
next step. Node 0's agent runs in the controller's process, as always; a thread wakes the
controller's loop when its emulated workers' next report is due.

Each run trains ``WARM + WINDOW`` steps, closes the last node's link (the last ``--lose``
nodes' at once: a rack) as the kernel does when an agent is SIGKILLed, lets the job recover,
brings the nodes back with the registration a restarted agent makes, lets the job grow back, and ends ``--after`` steps after the
fault (14 by default; at 8,192 devices the growth is sometimes decided after the 14th, so
``docs/scale.md``'s sweeps pass ``--after 40``). Per size:

- ``commit_overhead_ms_p50/p99``: a commit's publication minus the slowest device's
  ``Synced`` (``metrics.jsonl``'s ``commit_s``; one host, one clock) over the window's
  steps; ``commit_delivered_ms_p99``: the last node's receipt of the commit minus the same;
- ``controller_cpu_ms_per_step``: CPU time of the controller's process and of its planning
  process (every thread, from ``/proc``'s schedstat) per step over the window;
- ``controller_peak_gb``: the peak resident memory of the controller's process (this one,
  node 0's agent in it; its peak is reset as each size starts) plus its planning process's;
- ``store_ops_per_step``: store operations of the control plane per step (workers count
  theirs; the emulated ones, like the real ones, have none to make) and the store's key
  count before and after the run (server side: it must not move);
- ``control_bytes_per_step``: bytes on every agent link, both ways, per step;
- ``fault_to_generation_s``: the node's link closed → the next generation received by
  every surviving node (``decide_s``: the controller's decision within it);
- ``rejoin_to_generation_s``: the first returning agent's hello → the grown generation received by every one
  (``growth``: the choice, "declined: …" when the decision kept the plan, "not grown by the end" when no
  growth was decided before the last step).

``--quick`` (CI) runs 64 devices with 0.25 s steps and a shorter window.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import heapq
import json
import multiprocessing as mp
import os
import random
import selectors
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import header

from chameleon.config import Config
from chameleon.layout.plan import Plan, even_plan, micro_batch_ranges
from chameleon.layout.schedule import executors
from chameleon.runtime.control.controller import Controller
from chameleon.runtime.node.agent import Agent
from chameleon.runtime.node.wire import connect, job_key
from chameleon.runtime.protocol import codec
from chameleon.runtime.protocol.messages import (
    Begin,
    Commit,
    Done,
    End,
    Exited,
    Flag,
    Hello,
    Lease,
    Publish,
    Ready,
    Shutdown,
    Standby,
    Synced,
    Welcome,
    sample_ranges,
)
from chameleon.runtime.protocol.position import Position
from chameleon.runtime.protocol.timeouts import Timeouts

SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
PER_NODE = 8
LAYERS = 32  # Llama-2-7B's
FIRST_PIPELINE = even_plan(dp=1, pp=PER_NODE, tp=1, n_layers=LAYERS, global_batch=PER_NODE, micro_batch=1)
NODES_PER_PROCESS = 256
SECRET = "bench-control-plane"
WARM, WINDOW, AFTER = 6, 20, 14  # steps before the measured window, in it, and from the fault to the end (default)
BACK_AFTER = 4  # the lost node returns this many steps after its loss (default)


def config_for(devices: int, *, steps: int, port: int) -> tuple[Config, Plan]:
    """Llama-2-7B shapes, one 8-stage pipeline per node, 8 micro-batches of one sequence per pipeline."""
    from hydra import compose, initialize_config_dir

    from chameleon.config import CONF_DIR, register_configs, to_config

    nodes = devices // PER_NODE
    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[
            "+recipe=llama7b", "cluster=h100_32", f"launcher.nnodes={nodes}", "launcher.node_rank=0",
            "launcher.master_addr=127.0.0.1", f"launcher.master_port={port}", f"launcher.control_port={port + 1}",
            f"launcher.nproc_per_node={PER_NODE}", f"parallel.dp={nodes}", "parallel.pp=8",
            f"train.global_batch={8 * nodes}", f"train.steps={steps}", "failure=none", "ckpt.interval=0",
            "output.progress=false", "output.save_params=false", "report.plots=false", "train.clip_norm=0",
            "ft.heartbeat_timeout_s=5", "launcher.join_timeout_s=600",
        ])
    plan = even_plan(dp=nodes, pp=PER_NODE, tp=1, n_layers=LAYERS, global_batch=PER_NODE * nodes, micro_batch=1)
    return to_config(cfg), plan


# ----- emulated workers --------------------------------------------------------------------------


class EmulatedPool:
    """A node's workers that do no math: a step is a sleep; what they report follows the pushed plan.

    It has the interface of a node's worker pool (:class:`chameleon.runtime.node.agent.Pool`); its timers fire
    when its loop calls :meth:`tick`.
    """

    def __init__(self, agent: Agent, *, step_s: float, steps: int, seed: int, seen=None):
        """``step_s``: a step's duration on a plan of one 8-stage pipeline per node (the job's first)."""
        self.agent, self.steps, self.seen = agent, steps, seen
        self.pace = step_s / _length(FIRST_PIPELINE)  # seconds per layer-micro-batch (:func:`_length`)
        self.rng = random.Random(seed)
        self.generation = -1
        self.alive: set[int] = set()
        self.spec = None
        self.runs: dict[int, list[tuple[int, int]]] = {}  # per trainer here: the sample offsets it reports
        self.timers: list[tuple[float, int, object]] = []
        self.count = 0
        self.standby: set[int] = set()

    def start(self, devices, faults) -> None:
        """Workers that start now see the newest generation, as real ones are greeted with it."""
        self.alive |= set(devices)
        if self.spec is not None:
            self._establish(set(devices))

    def push(self, message: object, frame: bytes) -> None:
        if self.seen is not None:
            self.seen(message)
        match message:
            case Publish(spec=spec):
                self.spec, self.timers = spec, []
                self._establish(self.alive)
            case Begin(generation=g) if self._current(g):
                self._step(self.spec.resume_step)
            case Commit(generation=g, step=k, order=order) if self._current(g):
                if order.switch_to is not None:
                    return
                if order.stop or k + 1 == self.steps:  # done, as a real worker reports after its last step
                    for d in sorted(self.alive & set(self.spec.devices)):
                        self._at(0.0, Done(d, g))
                else:
                    self._step(k + 1)
            case Flag(generation=g) if self._current(g):
                self.timers = []
            case End():
                self.timers = []

    def _establish(self, devices: set[int]) -> None:
        """Members of the newest generation get ready; the others wait on standby."""
        spec = self.spec
        self.runs = _runs_of(spec.plan, self.alive & set(spec.plan.devices))
        for d in sorted(devices & set(spec.devices)):
            self._at(0.001, Ready(d, spec.generation))
        self._standby()

    def _current(self, generation: int) -> bool:
        return self.spec is not None and generation == self.spec.generation

    def _standby(self) -> None:
        for d in sorted(self.alive - set(self.spec.devices) - self.standby):
            self.standby.add(d)
            self._at(0.0, Standby(d, self.spec.generation))

    def _step(self, k: int) -> None:
        spec, batch = self.spec, self.spec.plan.global_batch
        for d, runs in self.runs.items():
            delay = self.pace * _length(spec.plan) * self.rng.uniform(0.9, 1.1)
            samples = tuple((k * batch + lo, k * batch + hi) for lo, hi in runs)
            self._at(delay, Synced(d, spec.generation, k, 1e-3 * sum(hi - lo for lo, hi in runs), samples, delay))

    def _at(self, delay: float, message: object) -> None:
        self.count += 1
        heapq.heappush(self.timers, (time.monotonic() + delay, self.count, message))

    def next_at(self) -> float:
        return self.timers[0][0] if self.timers else float("inf")

    def tick(self) -> None:
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            self.agent.from_worker(heapq.heappop(self.timers)[2])

    def signal(self, device: int, signum: int) -> None:
        if device in self.alive:
            self.alive.discard(device)
            self.agent.report(Exited(device, self.generation, -signum, Position(self.generation, -1, "idle"),
                                     time.time(), "injected or fenced"))

    def positions(self) -> dict:
        return {d: (Position(self.generation, -1, "commit"), 0.0) for d in self.alive}

    def waitables(self) -> list:
        return []  # emulated workers have no pipes: on_ready is never called

    def on_ready(self, item) -> None:
        raise AssertionError("emulated workers have no pipes to wait on")

    def stop(self, *, grace_s: float) -> None:
        self.timers = []


class WokenPool(EmulatedPool):
    """Node 0's emulated workers, inside the controller: a thread wakes the controller's loop (through a pipe it
    watches) when their next timer is due, and the loop fires it."""

    def __init__(self, agent: Agent, **kw):
        super().__init__(agent, **kw)
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self._changed = threading.Event()
        threading.Thread(target=self._wake, daemon=True).start()

    def _at(self, delay: float, message: object) -> None:
        super()._at(delay, message)
        self._changed.set()

    def _wake(self) -> None:
        while True:
            self._changed.wait(max(0.0, min(self.next_at() - time.monotonic(), 1.0)))
            self._changed.clear()
            if self.next_at() <= time.monotonic():
                os.write(self._w, b"x")
                time.sleep(0.001)

    def waitables(self) -> list:
        return [self._r]

    def on_ready(self, item) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._r, 4096)
        self.tick()


def _runs_of(plan: Plan, devices: set[int]) -> dict[int, list[tuple[int, int]]]:
    """The sample offsets (within a step) each trainer of ``devices`` reports: the micro-batches whose last stage
    it runs (as TP rank 0), as real workers report them."""
    every = _all_runs(plan)
    return {d: every.get(d, []) for d in devices}


_RUNS: dict[int, tuple[Plan, dict]] = {}
_LENGTHS: dict[int, tuple[Plan, int]] = {}


def _length(plan: Plan) -> int:
    """How long ``plan``'s step is, in layer-micro-batches: its slowest pipeline's (micro-batches + stages − 1) × its
    largest stage's layers (1F1B's fill, steady state and drain; reroutes left out). Found once per plan."""
    if id(plan) not in _LENGTHS:
        _LENGTHS[id(plan)] = plan, max((p.micro_batches + p.n_stages - 1) * max(st.n_layers for st in p.stages)
                                       for p in plan.pipelines if p.stages)
    return _LENGTHS[id(plan)][1]


def _all_runs(plan: Plan) -> dict[int, list[tuple[int, int]]]:
    """:func:`_runs_of` for every device of ``plan``, found once per plan in an emulator process (every node of a
    real job finds its own, at the same time)."""
    if id(plan) not in _RUNS:
        size, ids = plan.micro_batch_size, {}
        for j, (pipe, micro) in enumerate(zip(plan.pipelines, micro_batch_ranges(plan))):
            for i in range(pipe.micro_batches):
                d = executors(plan, j, pipe.n_stages - 1, i)[0]
                ids.setdefault(d, []).extend(range((micro.start + i) * size, (micro.start + i + 1) * size))
        _RUNS[id(plan)] = (plan, {d: list(sample_ranges(own)) for d, own in ids.items()})
    return _RUNS[id(plan)][1]


class _Decoded:
    """One emulator process's decoding of what its nodes receive: a frame broadcast to every node is the same bytes,
    decoded once here (each real node decodes its own copy, all at the same time). The frames used last are kept, as
    each node's own frames (its part of a manifest, its lease renewal) arrive between the copies of a broadcast."""

    KEEP = 4

    def __init__(self):
        self.recent: dict[bytes, object] = {}

    def __call__(self, payload: bytes) -> object:
        message = self.recent.pop(payload, None)
        if message is None:
            message = codec.decode(payload)
            if len(self.recent) >= self.KEEP:
                del self.recent[next(iter(self.recent))]  # the one used longest ago
        self.recent[payload] = message
        return message


# ----- emulator processes -------------------------------------------------------------------------


class _Node:
    """One emulated node: a real agent on a real link, its workers emulated."""

    def __init__(self, node: int, config: Config, step_s: float, record: dict):
        self.node, self.config, self.step_s, self.record = node, config, step_s, record
        self.devices = tuple(range(node * PER_NODE, (node + 1) * PER_NODE))
        self.link = self.pool = None
        self.sent = 0.0

    def join(self, port: int, *, returning: bool, decode) -> None:
        deadline = time.monotonic() + 600
        while True:
            try:
                self.link = connect("127.0.0.1", port, job_key(SECRET), timeout_s=60)
                self.link.decode = decode
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        hello_t = time.time()
        self.link.send(Hello(self.node, self.devices, os.getpid(), f"127.0.{self.node // 250}.{self.node % 250 + 2}",
                             f"emulated-host-{self.node}", self.config, returning=returning))
        welcome = self.link.recv(600)
        if not isinstance(welcome, Welcome):
            raise RuntimeError(f"node {self.node} was not admitted: {welcome}")
        if returning and self.record["hello_back"] is None:  # the first of the nodes coming back
            self.record["hello_back"] = hello_t
        agent = Agent(node=self.node, devices=self.devices, report=self.report)
        self.pool = EmulatedPool(agent, step_s=self.step_s, steps=self.config.train.steps, seed=self.node,
                                 seen=self._seen)
        agent.pool = self.pool
        agent.generation = self.pool.generation = welcome.generation
        self.pool.start(welcome.start.devices, welcome.start.faults)

    def report(self, message: object) -> None:
        try:
            self.link.send(message)
        except OSError:
            pass  # the controller dropped this node: its next read sees the link closed
        self.sent = time.monotonic()

    def _seen(self, message: object) -> None:
        now = time.time()
        if isinstance(message, Commit):
            self.record["commits"].setdefault(str(message.step), []).append((now, message.t_published))
        elif isinstance(message, Publish):
            member = self.devices[0] in message.spec.devices
            self.record["publishes"].append((self.node, message.generation, now, member))


def emulate(nodes: list[int], config: Config, port: int, step_s: float, window: int, victims: frozenset[int],
            back_after: int, watch: int, planning: mp.Value, out: str) -> None:
    """Run ``nodes``' agents until the job ends (``window``: the measured steps after ``WARM``; ``victims``: the nodes
    to lose at once and bring back ``back_after`` steps later, those of them here; ``watch``: the controller's pid
    and ``planning`` its planning process's, whose CPU time the process of node 1 reads)."""
    record = {"commits": {}, "publishes": [], "bytes": {}, "cpu": {}, "kill": None, "hello_back": None}
    gc.freeze()
    decode = _Decoded()
    emulated = {n: _Node(n, config, step_s, record) for n in nodes}
    for node in emulated.values():
        node.join(port, returning=False, decode=decode)
    selector = selectors.DefaultSelector()
    for node in emulated.values():
        selector.register(node.link, selectors.EVENT_READ, node)
    lease_s, live = Timeouts.of(config).renew_s, set(emulated)
    lost_here = sorted(victims & set(emulated))  # the victims among this process's nodes
    kill_at = WARM + window + 1
    back_at = kill_at + back_after
    while live:
        wake = min((emulated[n].pool.next_at() for n in live), default=float("inf"))
        ready = [node for n in live if (node := emulated[n]).link.buffered]
        ready += [key.data for key, _ in selector.select(timeout=0 if ready else
                                                          min(max(0.0, wake - time.monotonic()), 0.05))]
        for node in ready:
            if node.node not in live:
                continue
            try:
                messages = node.link.receive()
            except EOFError:
                messages = [(Shutdown(-1, "closed"), b"")]
            for message, frame in messages:
                if isinstance(message, Shutdown):
                    selector.unregister(node.link)
                    node.link.close()
                    live.discard(node.node)
                    break
                node.pool.agent.obey(message, frame)
                if isinstance(message, Commit) and node.node == min(live):
                    step = message.step
                    if step in (WARM, WARM + window):
                        record["bytes"][str(step)] = sum(emulated[n].link.bytes_sent + emulated[n].link.bytes_received
                                                         for n in live)
                        if 1 in emulated:
                            record["cpu"][str(step)] = _cpu_ns(watch) + _cpu_ns(planning.value)
                    if lost_here and step == kill_at and record["kill"] is None:
                        record["kill"] = time.time()
                        for victim in lost_here:
                            lost = emulated[victim]
                            selector.unregister(lost.link)
                            lost.link.sock.close()  # as the kernel closes a SIGKILLed agent's socket
                            live.discard(victim)
                    elif lost_here and step >= back_at and record["kill"] and record["hello_back"] is None:
                        for victim in lost_here:
                            back = emulated[victim]
                            back.join(port, returning=True, decode=decode)
                            selector.register(back.link, selectors.EVENT_READ, back)
                            live.add(victim)
        for n in list(live):
            node = emulated[n]
            node.pool.tick()
            if time.monotonic() - node.sent > lease_s:
                node.report(Lease(n, node.pool.agent.generation))
            if node.link.pending:
                node.link.flush()
    Path(out).write_text(json.dumps(record))


def _cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in nanoseconds (0 for a process that is gone)."""
    total = 0
    tasks = []
    with contextlib.suppress(OSError):
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    for task in tasks:
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total


# ----- one size -----------------------------------------------------------------------------------


def _peak_rss_gb(pid: int | str) -> float:
    """The peak resident memory of ``pid`` (``self``: this process) so far, from ``/proc``; 0 once it is gone."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return 0.0


class _PeakWatch(threading.Thread):
    """Samples the planning process's peak memory while it lives (it ends with the controller)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak_gb, self.stopped = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.2):
            self.peak_gb = max(self.peak_gb, _peak_rss_gb(self.pid))


def _free_ports() -> int:
    """A port p with p and p + 1 free (the store and the agents' link)."""
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue


def run_size(devices: int, *, step_s: float, window: int, after: int = AFTER, lose: int = 1,
             back_after: int = BACK_AFTER) -> dict:
    nodes = devices // PER_NODE
    steps = WARM + window + after
    port = _free_ports()
    config, plan = config_for(devices, steps=steps, port=port)
    victims = frozenset(range(nodes - lose, nodes))
    remote = list(range(1, nodes))
    chunks = [remote[i:i + NODES_PER_PROCESS] for i in range(0, len(remote), NODES_PER_PROCESS)]
    ctx = mp.get_context("spawn")
    planning = ctx.Value("i", 0)
    Path("/proc/self/clear_refs").write_text("5")  # this process's peak memory counts from here
    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp) / f"emulator{i}.json") for i in range(len(chunks))]
        procs = [ctx.Process(target=emulate, args=(chunk, config, port + 1, step_s, window, victims, back_after,
                                                   os.getpid(), planning, out), daemon=True)
                 for chunk, out in zip(chunks, outs)]
        for p in procs:
            p.start()
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        controller = Controller(config, plan=plan, run_dir=run_dir, secret=SECRET, local_pool=lambda agent: WokenPool(
            agent, step_s=step_s, steps=steps, seed=0))
        planning.value = controller.planning.pid
        watch = _PeakWatch(planning.value)
        watch.start()
        keys_before = controller.store.num_keys()
        t0 = time.time()
        controller.run()
        wall = time.time() - t0
        watch.stopped.set()
        peak_gb = _peak_rss_gb("self") + watch.peak_gb
        keys_after = controller.store.num_keys()
        for p in procs:
            p.join(timeout=120)
        records = [json.loads(Path(out).read_text()) for out in outs]
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return {**summarise(devices, nodes, step_s, window, records, metrics, events, keys_before, keys_after, wall,
                        peak_gb, victims), "back_after": back_after}


def summarise(devices, nodes, step_s, steps, records, metrics, events, keys_before, keys_after, wall, peak_gb,
              victims) -> dict:
    window = range(WARM, WARM + steps)
    by_step = {m["step"]: m for m in metrics if m["generation"] == 0}
    overhead = sorted(by_step[k]["commit_s"] * 1e3 for k in window)
    delivered = []
    for k in window:
        arrivals = [t for r in records for t, _ in r["commits"].get(str(k), [])]
        published = next(p for r in records for _, p in r["commits"].get(str(k), []))
        delivered.append((max(arrivals) - (published - by_step[k]["commit_s"])) * 1e3)
    cpu = next(r["cpu"] for r in records if r["cpu"])
    nbytes = sum(r["bytes"][str(WARM + steps)] - r["bytes"][str(WARM)] for r in records)
    kill = min(r["kill"] for r in records if r["kill"])
    fault = next(e for e in events if e["event"] == "fault")
    recovered = next(e for e in events if e["event"] == "recovered")
    after = [t for r in records for node, g, t, _ in r["publishes"] if g == fault["generation"] + 1 and node not in victims]
    back = min(r["hello_back"] for r in records if r["hello_back"])
    grown: dict[int, float] = {}  # each returning node's first generation as a member again
    for node, _, t, member in (p for r in records for p in r["publishes"]):
        if member and node in victims and t >= back:
            grown[node] = min(grown.get(node, t), t)
    growth = next((e for e in events if e["event"] == "grown"), None)
    declined = next((e for e in events if e["event"] == "growth"), None)
    return {
        "devices": devices, "nodes": nodes, "step_s": step_s, "lost_nodes": len(victims),
        "commit_overhead_ms_p50": statistics.median(overhead), "commit_overhead_ms_p99": _p99(overhead),
        "commit_delivered_ms_p99": _p99(sorted(delivered)),
        "controller_cpu_ms_per_step": (cpu[str(WARM + steps)] - cpu[str(WARM)]) / 1e6 / steps,
        "store_ops_per_step": 0.0, "store_keys_before_after": [keys_before, keys_after],
        "control_bytes_per_step": nbytes / steps,
        "fault_to_generation_s": max(after) - kill, "detect_s": fault["t_fault"] + fault["detect_s"] - kill,
        "decide_s": fault["decide_s"], "publish_s": recovered["publish_s"], "first_publish_s": min(after) - kill,
        "fault_choice": fault["decision"]["choice"],
        "rejoin_to_generation_s": (max(grown.values()) - back) if len(grown) == len(victims) else None,
        "growth": (growth["chosen"] if growth else f"declined: {declined['choice']}" if declined
                   else "not grown by the end"),
        "controller_peak_gb": peak_gb,
        "wall_s": wall,
    }


def _p99(values: list[float]) -> float:
    return values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]


FITTED = ("commit_overhead_ms_p99", "controller_cpu_ms_per_step", "control_bytes_per_step", "fault_to_generation_s",
          "decide_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", help="the sizes to run (multiples of 8, at least 16)")
    parser.add_argument("--json", help="write the results here (a list, one object per size)")
    parser.add_argument("--quick", action="store_true", help="64 devices, shorter steps and window (CI)")
    parser.add_argument("--step-s", type=float, default=0.5, help="an emulated step's duration")
    parser.add_argument("--after", type=int, default=AFTER, help="steps from the fault to the job's end")
    parser.add_argument("--lose", type=int, default=1, help="nodes lost at once (the last ones), and back together")
    parser.add_argument("--back-after", type=int, default=BACK_AFTER,
                        help="steps from the loss to the nodes' return (a node back once the planning process has "
                             "readied its growth: more than the precompute's and the growth's seconds)")
    parser.add_argument("--plot", help="draw each figure against the number of devices into this PNG")
    parser.add_argument("--report", help="run nothing: report the sizes a --json FILE holds (table, fit, plot)")
    args = parser.parse_args()
    if args.devices and any(n % PER_NODE or n < 2 * PER_NODE for n in args.devices):
        parser.error(f"--devices {' '.join(map(str, args.devices))}: every size must be a multiple of {PER_NODE}, "
                     f"at least {2 * PER_NODE}")
    if args.lose < 1 or any(n // PER_NODE - args.lose < 2 for n in args.devices or SIZES):
        parser.error(f"--lose {args.lose}: lose at least one node, and leave node 0 and one more of every size")
    if not 1 <= args.back_after < args.after:
        parser.error(f"--back-after {args.back_after}: the nodes come back at least one step after their loss and "
                     f"before the job's end (--after {args.after})")
    if args.report and not Path(args.report).is_file():
        parser.error(f"--report {args.report}: no such file (write one with --json FILE)")
    print("| devices | nodes | commit overhead p50 / p99 (ms) | delivered p99 (ms) | controller CPU (ms/step) | "
          "store ops/step | bytes/step | node lost → next generation (s) | decide (s) | re-join → grown (s) | "
          "controller peak (GB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    if args.report:
        results = json.loads(Path(args.report).read_text())
        for r in results:
            print(_row(r))
    else:
        sizes = args.devices or ((64,) if args.quick else SIZES)
        step_s = 0.25 if args.quick else args.step_s
        header(f"real controller and agents, emulated workers, {PER_NODE} per node, {NODES_PER_PROCESS} nodes per emulator"
               + (f", {args.lose} nodes lost at once" if args.lose > 1 else "")
               + (f", back {args.back_after} steps after their loss" if args.back_after != BACK_AFTER else ""))
        results = []
        for devices in sizes:
            results.append(run_size(devices, step_s=step_s, window=8 if args.quick else WINDOW, after=args.after,
                                    lose=args.lose, back_after=args.back_after))
            print(_row(results[-1]), flush=True)
            if args.json:  # kept size by size: a later size that cannot run loses nothing
                Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"load avg after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if len(results) > 2:
        print("\nleast-squares line against nodes (a + b·nodes), and its value at 16,384 devices (2,048 nodes):")
        for key in FITTED:
            a, b = fit(results, key)
            print(f"  {key}: a = {a:.4g}, b = {b:.4g} per node → {a + b * 2048:.4g}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, Path(args.plot))


def _row(r: dict) -> str:
    rejoin = f"{r['rejoin_to_generation_s']:.3f}" if r["rejoin_to_generation_s"] is not None else r["growth"]
    return (f"| {r['devices']} | {r['nodes']} | {r['commit_overhead_ms_p50']:.2f} / {r['commit_overhead_ms_p99']:.2f} | "
            f"{r['commit_delivered_ms_p99']:.2f} | {r['controller_cpu_ms_per_step']:.1f} | {r['store_ops_per_step']:.0f} | "
            f"{r['control_bytes_per_step']:.0f} | {r['fault_to_generation_s']:.3f} | {r['decide_s']:.3f} | {rejoin} | "
            f"{_gb(r.get('controller_peak_gb'))} |")


def _gb(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def fit(results: list[dict], key: str) -> tuple[float, float]:
    """Least-squares ``a + b·nodes`` of figure ``key`` over the sizes."""
    import numpy as np

    b, a = np.polyfit([r["nodes"] for r in results], [r[key] for r in results], 1)
    return float(a), float(b)


def plot(results: list[dict], path: Path) -> None:
    """Each figure against devices on log-log axes, beside the O(devices) line through its smallest size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("commit overhead (ms)", ["commit_overhead_ms_p50", "commit_overhead_ms_p99"], 10.0),
        ("controller CPU (ms/step)", ["controller_cpu_ms_per_step"], 50.0),
        ("control bytes per step", ["control_bytes_per_step"], None),
        ("node lost → next generation (s)", ["fault_to_generation_s", "decide_s"], 1.0),
        ("re-join → grown generation (s)", ["rejoin_to_generation_s"], None),
    ]
    devices = [r["devices"] for r in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (title, keys, goal) in zip(axes, panels):
        for key in keys:
            points = [(r["devices"], r[key]) for r in results if r[key]]
            if points:
                ax.plot(*zip(*points), marker="o", label=key)
                x0, y0 = points[0]
                ax.plot(devices, [y0 * d / x0 for d in devices], ls=":", color="grey")
        if goal is not None:
            ax.axhline(goal, color="red", lw=0.8, label="goal at 8,192")
        ax.set(xscale="log", yscale="log", xlabel="devices (8 per node)", title=title)
        ax.legend(fontsize=6)
    fig.suptitle("bench_control_plane.py: dotted, O(devices) from the smallest size", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
