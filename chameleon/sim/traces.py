"""Fault traces: timed removals and re-joins of devices, and fail-slow episodes.

A trace is a sorted tuple of :class:`Event`. Oobleck's artifact traces are CSV
lines ``ms,add|remove,nodeX``; :func:`read_csv` and :func:`write_csv` speak that
format, :func:`oobleck_trace` generates its fixed-interval removals (optionally
repaired) and :func:`poisson_trace` draws exponential device and node faults
with repairs, at a rate given directly or derived from published incident
counts (:func:`device_mtbf_h`). :func:`slow_trace` adds fail-slow episodes to
any of them: a device slows down by a factor, then recovers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chameleon.sim.config import TraceConfig

_LINE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*,\s*(add|remove)\s*,\s*node(\d+)\s*$")


@dataclass(frozen=True)
class Event:
    """At ``time_s`` the ``devices`` fail (``kind="remove"``), come back (``"add"``), slow down (``"slow"``: each
    op takes ``factor`` times as long) or get back to speed (``"recover"``)."""

    time_s: float
    kind: str
    devices: tuple[int, ...]
    factor: float = 1.0


def node_devices(node: int, node_size: int) -> tuple[int, ...]:
    """Devices of trace node ``node``."""
    return tuple(range(node * node_size, (node + 1) * node_size))


def read_csv(path: str | Path, *, node_size: int) -> tuple[Event, ...]:
    """Parse an Oobleck-format trace; a header or blank lines are skipped.

    Raises:
        ValueError: On a line that is neither blank, a header, nor ``ms,add|remove,nodeX``.
    """
    events = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or (n == 1 and not line.lstrip()[:1].isdigit()):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"{path}:{n}: {line!r} is not 'ms,add|remove,nodeX'")
        ms, kind, node = match.groups()
        events.append(Event(float(ms) / 1000.0, kind, node_devices(int(node), node_size)))
    return tuple(sorted(events, key=lambda e: e.time_s))


def write_csv(events: tuple[Event, ...], path: str | Path, *, node_size: int) -> Path:
    """Write the removals and re-joins of ``events`` (each a whole trace node) as ``ms,add|remove,nodeX`` lines
    (the format has no fail-slow episodes)."""
    lines = [f"{round(e.time_s * 1000)},{e.kind},node{e.devices[0] // node_size}"
             for e in events if e.kind in ("add", "remove")]
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


def oobleck_trace(
    *, n_nodes: int, interval_s: float, n_removals: int, node_size: int, seed: int, repair_s: float | None = None,
) -> tuple[Event, ...]:
    """One random live node removed every ``interval_s``, ``n_removals`` times; back ``repair_s`` later (None: never).

    Without repairs every removal takes a distinct node; with them a repaired node
    may be removed again.
    """
    rng = np.random.default_rng(seed)
    back_at = np.zeros(n_nodes)
    events = []
    for i in range(n_removals):
        t = (i + 1) * interval_s
        live = np.flatnonzero(back_at <= t)
        if not len(live):
            break
        node = int(rng.choice(live))
        events.append(Event(t, "remove", node_devices(node, node_size)))
        back_at[node] = math.inf if repair_s is None else t + repair_s
        if repair_s is not None:
            events.append(Event(t + repair_s, "add", node_devices(node, node_size)))
    return _merge(events)


def poisson_trace(
    *, n_devices: int, devices_per_node: int, horizon_s: float, device_mtbf_s: float, node_mtbf_s: float | None,
    repair_s: float | None, seed: int,
) -> tuple[Event, ...]:
    """Exponential faults per device and per node, each failed device back ``repair_s`` later.

    Every device (and node) alternates up-times drawn with its MTBF and repairs of
    ``repair_s``; a node fault takes its devices that are still up. Events at the
    same instant merge.
    """
    rng = np.random.default_rng(seed)
    down_until = np.zeros(n_devices)
    faults: list[tuple[float, tuple[int, ...]]] = []
    sources = [(device_mtbf_s, (d,)) for d in range(n_devices)]
    if node_mtbf_s is not None:
        sources += [(node_mtbf_s, tuple(range(n, min(n + devices_per_node, n_devices)))) for n in range(0, n_devices, devices_per_node)]
    for mtbf, devices in sources:
        t = rng.exponential(mtbf)
        while t < horizon_s:
            faults.append((t, devices))
            t += (repair_s or math.inf) + rng.exponential(mtbf)
    events = []
    for t, devices in sorted(faults):
        up = tuple(d for d in devices if down_until[d] <= t)
        if not up:
            continue
        down_until[list(up)] = t + (repair_s if repair_s is not None else math.inf)
        events.append(Event(t, "remove", up))
        if repair_s is not None and t + repair_s < horizon_s:
            events.append(Event(t + repair_s, "add", up))
    return _merge(events)


def slow_trace(
    *, n_devices: int, horizon_s: float, rate_per_device_h: float, factor: tuple[float, float],
    duration_s: tuple[float, float], seed: int,
) -> tuple[Event, ...]:
    """Fail-slow episodes: each device slows down after exponential times (``rate_per_device_h`` onsets per
    hour of being well), by a factor uniform in ``factor``, for a duration log-uniform in ``duration_s``, then
    recovers (a ``recover`` event). One episode per device at a time.
    Drawn from a stream of their own, so that adding them leaves a trace's faults as they were."""
    if rate_per_device_h <= 0:
        return ()
    rng = np.random.default_rng([seed, 1])
    mean_s = 3600 / rate_per_device_h
    events = []
    for device in range(n_devices):
        t = rng.exponential(mean_s)
        while t < horizon_s:
            slow, length = rng.uniform(*factor), math.exp(rng.uniform(*np.log(duration_s)))
            events += [Event(t, "slow", (device,), slow), Event(t + length, "recover", (device,))]
            t += length + rng.exponential(mean_s)
    return tuple(sorted(events, key=lambda e: e.time_s))


def _merge(events: list[Event]) -> tuple[Event, ...]:
    out: dict[tuple[float, str], list[int]] = {}
    for e in sorted(events, key=lambda e: (e.time_s, e.kind != "add")):
        out.setdefault((e.time_s, e.kind), []).extend(e.devices)
    return tuple(Event(t, k, tuple(sorted(ds))) for (t, k), ds in out.items())


def build_trace(cfg: TraceConfig, *, n_devices: int, devices_per_node: int, horizon_s: float) -> tuple[Event, ...]:
    """The events of ``cfg`` before ``horizon_s``.

    Raises:
        ValueError: On an unknown ``trace.kind`` or a ``csv`` trace without ``trace.path``.
    """
    repair_s = None if cfg.repair_h is None else cfg.repair_h * 3600
    if cfg.kind == "none":
        events: tuple[Event, ...] = ()
    elif cfg.kind == "poisson":
        events = poisson_trace(
            n_devices=n_devices, devices_per_node=devices_per_node, horizon_s=horizon_s,
            device_mtbf_s=device_mtbf_h(cfg) * 3600, node_mtbf_s=None if cfg.node_mtbf_h is None else cfg.node_mtbf_h * 3600,
            repair_s=repair_s, seed=cfg.seed,
        )
    elif cfg.kind == "oobleck":
        events = oobleck_trace(
            n_nodes=n_devices // cfg.node_size, interval_s=cfg.interval_s, n_removals=cfg.n_removals,
            node_size=cfg.node_size, seed=cfg.seed, repair_s=repair_s,
        )
    elif cfg.kind == "csv":
        if not cfg.path:
            raise ValueError("trace.kind=csv needs trace.path=FILE (lines 'ms,add|remove,nodeX')")
        events = read_csv(cfg.path, node_size=cfg.node_size)
    else:
        raise ValueError(f"trace.kind={cfg.kind!r}: use poisson, oobleck, csv or none")
    slow = slow_trace(n_devices=n_devices, horizon_s=horizon_s, rate_per_device_h=cfg.slow_rate_per_device_h,
                      factor=tuple(cfg.slow_factor), duration_s=tuple(cfg.slow_duration_s), seed=cfg.seed)
    events = tuple(sorted(events + slow, key=lambda e: e.time_s))
    return tuple(e for e in events if e.time_s < horizon_s and all(d < n_devices for d in e.devices))


def device_mtbf_h(cfg: TraceConfig) -> float:
    """Hours between faults of one device: ``trace.device_mtbf_h``, or derived from published incident counts.

    Raises:
        ValueError: When ``trace.incidents`` is set without ``incident_days`` and ``incident_devices``.
    """
    if cfg.incidents is None:
        return cfg.device_mtbf_h
    if not cfg.incident_days or not cfg.incident_devices or cfg.incidents < 1:
        raise ValueError(
            f"trace.incidents={cfg.incidents} needs trace.incident_days and trace.incident_devices > 0 "
            "(faults observed over that many days on that many devices)"
        )
    return cfg.incident_days * 24 * cfg.incident_devices / cfg.incidents


def describe(cfg: TraceConfig) -> str:
    """What ``cfg`` draws, in words: its fault rate or source, whether failed devices return, and its fail-slow
    episodes."""
    slow = ""
    if cfg.slow_rate_per_device_h > 0:
        (f_lo, f_hi), (d_lo, d_hi) = cfg.slow_factor, cfg.slow_duration_s
        slow = (f"; each device slows ×{f_lo:g}–{f_hi:g} every {1 / cfg.slow_rate_per_device_h:,.0f} h on average, "
                f"for {d_lo:g}–{d_hi:g} s")
    return _faults(cfg) + slow


def _faults(cfg: TraceConfig) -> str:
    back = "never back" if cfg.repair_h is None else f"back after {cfg.repair_h:g} h"
    if cfg.kind == "poisson":
        nodes = "" if cfg.node_mtbf_h is None else f", each node every {cfg.node_mtbf_h:,g} h"
        return f"each device fails every {device_mtbf_h(cfg):,.0f} h on average{nodes}, {back}"
    if cfg.kind == "oobleck":
        node = "a device" if cfg.node_size == 1 else f"a node of {cfg.node_size} devices"
        return f"{node} removed every {cfg.interval_s:g} s, {cfg.n_removals} times, {back}"
    if cfg.kind == "csv":
        return f"the events of {cfg.path}"
    return "no fault"


def nominal_mtbf_s(cfg: TraceConfig, *, n_devices: int, devices_per_node: int, events: tuple[Event, ...], horizon_s: float) -> float:
    """The cluster's mean time between faults as an operator would configure it (Young/Daly input)."""
    if cfg.kind == "poisson":
        rate = n_devices / (device_mtbf_h(cfg) * 3600)
        if cfg.node_mtbf_h is not None:
            rate += -(-n_devices // devices_per_node) / (cfg.node_mtbf_h * 3600)
        return 1 / rate
    if cfg.kind == "oobleck":
        return cfg.interval_s
    removals = sum(e.kind == "remove" for e in events)
    return horizon_s / max(removals, 1)


def nominal_slow_mtbf_s(cfg: TraceConfig, *, n_devices: int) -> float:
    """The cluster's mean time between fail-slow onsets (inf: none drawn)."""
    return math.inf if cfg.slow_rate_per_device_h <= 0 else 3600 / (cfg.slow_rate_per_device_h * n_devices)
