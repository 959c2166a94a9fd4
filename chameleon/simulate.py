"""``python -m chameleon.simulate``: policies compared on a simulated long run under a fault trace.

Example::

    python -m chameleon.simulate      # the tiny model on the local devices, faults at a demonstration rate
    python -m chameleon.simulate +recipe=llama7b cluster=ascend910b_32 trace=oobleck trace.interval_s=1800 \\
        sim.horizon_h=8
    python -m chameleon.simulate --multirun +recipe=llama7b cluster=ascend910b_32 trace=oobleck \\
        trace.interval_s=21600,3600,600
    python -m chameleon.sim.report multirun/DATE/TIME     # one table across the sweep
    python -m chameleon.simulate +recipe=llama7b cluster=ascend910b_32 trace=llama3 \\
        sim.horizon_h=1296                                # Llama 3's fault rate, 54 days
    python -m chameleon.simulate +recipe=llama70b cluster=h100_32 cluster.n_devices=512 trace=falcon \\
        sim.horizon_h=72                                  # fail-stop faults and fail-slow devices

Every policy in ``sim.policies`` (Chameleon's and the baselines of
:mod:`chameleon.sim.baselines`) runs on the same trace from the same plan
(:func:`starting_plan`), driving the real planner, estimator and selector; every
ratio divides by the planner's best failure-free plan on the whole cluster. The run
dir gets ``summary.json`` (every run, its time breakdown by
:data:`~chameleon.report.breakdown.TIME_PARTS`, its ETTR and each recovery),
``table.md``, ``throughput.png`` and ``breakdown.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from chameleon import cli
from chameleon.config import (
    CONF_DIR, ConfigError, FaultToleranceConfig, build_plan, check_batch, model_config, register_configs, typed,
)
from chameleon.decision.config import ClusterConfig, PolicyConfig
from chameleon.decision.profiler import device_overheads, load_profile
from chameleon.layout.geometry import tp_units
from chameleon.layout.plan import Plan
from chameleon.report.outputs import write_json
from chameleon.report.progress import progress_bar
from chameleon.sim import report
from chameleon.sim.config import SimConfig, SimPolicy, TraceConfig
from chameleon.sim.engine import RunResult, Setup, simulate
from chameleon.sim.policies import Planning
from chameleon.sim.traces import Event, build_trace, describe, node_devices, nominal_mtbf_s, nominal_slow_mtbf_s, read_csv

USAGE = """
usage: python -m chameleon.simulate [+recipe=NAME] [cluster=NAME] [trace=KIND] [sim.horizon_h=H] [KEY=VALUE ...]

Days of training on a large cluster under a fault trace, in seconds: every policy of sim.policies on
the same trace, each decision made by the real planner, estimator and selector. Traces: poisson
(per-device and per-node MTBFs, repairs), oobleck (a node removed every trace.interval_s), csv
(an Oobleck-format file, trace.path=FILE: lines ms,add|remove,nodeX), none; any of them with fail-slow
devices (trace.slow_rate_per_device_h, trace.slow_factor, trace.slow_duration_s), and falcon: Llama 3's
fault rate with fail-slow devices in the range of Alibaba's FALCON study.

  python -m chameleon.simulate                                    the tiny model on the 4 local devices, faults at a
                                                                  demonstration rate (trace=demo: a device a day)
  python -m chameleon.simulate +recipe=llama7b cluster=ascend910b_32 trace=oobleck trace.interval_s=1800
"""

register_configs()


def check(cfg: DictConfig) -> None:
    """Refuse a simulation that cannot run: bad horizon, policies, trace keys or trace file.

    Raises:
        ConfigError: naming the key and the fix.
    """
    sim, trace = typed(cfg, "sim", SimConfig), typed(cfg, "trace", TraceConfig)
    cluster = typed(cfg, "cluster", ClusterConfig)
    device_overheads(cluster)  # raises ValueError naming a key out of range
    check_batch(cfg.train)
    _require(sim.horizon_h > 0, f"sim.horizon_h={sim.horizon_h}: must be > 0")
    _require(sim.policies, f"sim.policies names nothing: pick from {', '.join(SimPolicy)}")
    _require(cluster.n_devices >= 1, f"cluster.n_devices={cluster.n_devices}: must be ≥ 1")
    _require(trace.interval_s > 0, f"trace.interval_s={trace.interval_s}: must be > 0")
    _require(trace.n_removals >= 0, f"trace.n_removals={trace.n_removals}: must be ≥ 0")
    _require(trace.node_size >= 1, f"trace.node_size={trace.node_size}: must be ≥ 1")
    _require(trace.device_mtbf_h > 0, f"trace.device_mtbf_h={trace.device_mtbf_h}: must be > 0")
    _require(trace.node_mtbf_h is None or trace.node_mtbf_h > 0, f"trace.node_mtbf_h={trace.node_mtbf_h}: null or > 0")
    _require(trace.repair_h is None or trace.repair_h >= 0, f"trace.repair_h={trace.repair_h}: null or ≥ 0")
    _require(trace.slow_rate_per_device_h >= 0, f"trace.slow_rate_per_device_h={trace.slow_rate_per_device_h}: must be ≥ 0 "
             "(0: no fail-slow device)")
    _require_range("trace.slow_factor", trace.slow_factor, low=1.0, what="time factors ≥ 1")
    _require_range("trace.slow_duration_s", trace.slow_duration_s, low=0.0, what="seconds > 0", strict=True)
    _require(sim.failstop.detect_s >= 0, f"sim.failstop.detect_s={sim.failstop.detect_s}: must be ≥ 0")
    if trace.kind == "csv":
        _check_csv(trace, n_devices=cluster.n_devices)
    if sim.initial == "recipe":
        _require_whole_cluster(build_plan(cfg), n_devices=cluster.n_devices)


def _check_csv(trace: TraceConfig, *, n_devices: int) -> None:
    _require(bool(trace.path), "trace=csv needs trace.path=FILE (lines 'ms,add|remove,nodeX')")
    path = Path(trace.path).expanduser()
    _require(path.is_file(), f"trace.path={trace.path!r} is not a file: give an Oobleck-format trace")
    try:
        events = read_csv(path, node_size=trace.node_size)
    except (ValueError, OSError) as err:
        raise ConfigError(f"trace.path: {err}") from None
    n_nodes = n_devices // trace.node_size
    stray = next((e for e in events if max(e.devices) >= n_devices), None)
    _require(stray is None, f"trace.path={trace.path!r} names node{(stray.devices[0] // trace.node_size) if stray else 0} "
             f"at {stray.time_s if stray else 0:g} s, but the cluster has {n_nodes} trace nodes (cluster.n_devices / "
             "trace.node_size): give a trace of this cluster, or a larger cluster.n_devices")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _require_range(key: str, value: list[float], *, low: float, what: str, strict: bool = False) -> None:
    """``value`` is ``[low, high]`` with ``low ≤ high``, both above ``low`` (at or above it unless ``strict``)."""
    ok = len(value) == 2 and value[0] <= value[1] and (value[0] > low if strict else value[0] >= low)
    _require(ok, f"{key}={list(value)}: give [low, high], {what}, low ≤ high")


def _require_whole_cluster(plan: Plan, *, n_devices: int) -> None:
    _require(len(plan.devices) == n_devices, f"the recipe's plan uses {len(plan.devices)} devices but cluster.n_devices="
             f"{n_devices}: set sim.initial=planner to plan the whole cluster, or match parallel.* to it")


def prepare(cfg: DictConfig) -> tuple[Setup, tuple[Event, ...], float, SimConfig]:
    """The simulation of a composed config: setup, trace events, horizon in seconds, sim options.

    Raises:
        ValueError: When ``sim.initial=recipe`` and the recipe's devices differ from ``cluster.n_devices``, or no
            plan fits the cluster.
    """
    sim, trace = typed(cfg, "sim", SimConfig), typed(cfg, "trace", TraceConfig)
    cluster, policy = typed(cfg, "cluster", ClusterConfig), typed(cfg, "policy", PolicyConfig)
    profile = load_profile(model_config(cfg), cluster, micro_batch=cfg.train.micro_batch, seq_len=cfg.train.seq_len, tp=cfg.parallel.tp,
                           recompute=cfg.train.recompute)
    planning = Planning(profile, policy)
    units = tp_units(range(cluster.n_devices), cfg.parallel.tp)
    n_micro = cfg.train.global_batch // cfg.train.micro_batch
    reference = reference_plan(planning, units, n_micro=n_micro, micro_batch_size=cfg.train.micro_batch, idle=sim.reference_idle)
    plan = starting_plan(cfg, planning, units, n_micro=n_micro, initial=sim.initial)
    horizon_s = sim.horizon_h * 3600
    events = build_trace(trace, n_devices=cluster.n_devices, devices_per_node=cluster.devices_per_node, horizon_s=horizon_s)
    mtbf = nominal_mtbf_s(trace, n_devices=cluster.n_devices, devices_per_node=cluster.devices_per_node, events=events, horizon_s=horizon_s)
    domains = fault_domains(trace, n_devices=cluster.n_devices)
    setup = Setup(planning, plan, reference, policy, sim, mtbf, cluster.n_devices, domains,
                  slow_mtbf_s=nominal_slow_mtbf_s(trace, n_devices=cluster.n_devices), ft=typed(cfg, "ft", FaultToleranceConfig),
                  tp_sizes=model_config(cfg).tp_sizes)
    return setup, events, horizon_s, sim


def fault_domains(trace: TraceConfig, *, n_devices: int) -> tuple[tuple[int, ...], ...] | None:
    """The device groups the trace fails together: its nodes for ``oobleck`` and ``csv`` traces of nodes
    larger than a device, else None (devices fail alone; a ``poisson`` trace's node faults are rare beside them)."""
    if trace.kind not in ("oobleck", "csv") or trace.node_size == 1:
        return None
    return tuple(node_devices(n, trace.node_size) for n in range(-(-n_devices // trace.node_size)))


def reference_plan(planning: Planning, units, *, n_micro: int, micro_batch_size: int, idle: int) -> Plan:
    """The planner's best failure-free plan on ``units``, up to ``idle`` of them left idle.

    Raises:
        ValueError: When no plan fits the whole cluster.
    """
    best = None
    for n in range(len(units), max(len(units) - idle, 1) - 1, -1):
        plan = planning.best(units[:n], n_micro=n_micro, micro_batch_size=micro_batch_size)
        if plan is not None and (best is None or plan.global_batch / planning.t_step(plan) > best.global_batch / planning.t_step(best)):
            best = plan
    if best is None:
        raise ValueError(f"no plan fits {len(units)} stage units: widen policy.pp_lengths / policy.dp_degrees or cluster.memory_gb")
    return best


def starting_plan(cfg: DictConfig, planning: Planning, units, *, n_micro: int, initial: str) -> Plan:
    """The plan every policy starts from: the recipe's when ``initial`` is ``recipe``, else the planner's fastest even
    plan on ``units`` (equal pipelines, as torchft and ReCycle replicate them).

    Raises:
        ValueError: When the recipe's plan does not use every device, or no even plan fits.
    """
    if initial == "recipe":
        plan = build_plan(cfg)
        _require_whole_cluster(plan, n_devices=cfg.cluster.n_devices)
        return plan
    plan = planning.best_even(units, n_micro=n_micro, micro_batch_size=cfg.train.micro_batch)
    if plan is None:
        raise ValueError(f"no even plan fits {len(units)} stage units: widen policy.pp_lengths / policy.dp_degrees or cluster.memory_gb")
    return plan


def run(cfg: DictConfig) -> tuple[list[RunResult], tuple[Event, ...]]:
    """Every policy of ``sim.policies`` on the config's trace."""
    setup, events, horizon_s, sim = prepare(cfg)
    names = progress_bar(sim.policies, desc="policies", wanted=sim.progress)
    return [simulate(setup, name, events, horizon_s=horizon_s, progress=sim.progress) for name in names], events


def write_outputs(results: list[RunResult], events: tuple[Event, ...], out: Path, *, overrides: list[str], plots: bool) -> str:
    """``summary.json``, ``table.md`` and the plots in ``out``; returns the table."""
    runs = [r.to_dict() for r in results]
    title = " ".join(overrides)
    text = report.table(runs)
    write_json(out / "summary.json", {"overrides": overrides, "n_events": len(events), "runs": runs})
    (out / "table.md").write_text(text + "\n")
    if plots:
        report.plot_timeline(results, events, out / "throughput.png", title=title)
        report.plot_breakdown(runs, out / "breakdown.png", title=title)
    return text


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def _job(cfg: DictConfig) -> None:
    try:
        check(cfg)
    except ConfigError as err:
        cli.fail(err)
    results, events = run(cfg)
    hydra_cfg = HydraConfig.get()
    out = Path(hydra_cfg.runtime.output_dir)
    text = write_outputs(results, events, out, overrides=list(hydra_cfg.overrides.task), plots=cfg.sim.plots)
    kinds = {kind: sum(e.kind == kind for e in events) for kind in ("remove", "add", "slow")}
    slow = f", {kinds['slow']} devices slowed down" if kinds["slow"] else ""
    print(f"trace={hydra_cfg.runtime.choices.trace} ({describe(typed(cfg, 'trace', TraceConfig))}): {kinds['remove']} faults and "
          f"{kinds['add']} re-joins{slow} within {cfg.sim.horizon_h:g} h; outputs in {out}\n{text}")
    print(json.dumps({r.policy: round(r.throughput, 4) for r in results}))


def main() -> None:
    cli.run("simulate", USAGE, _job, check)


if __name__ == "__main__":
    main()
