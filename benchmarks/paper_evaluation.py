"""Regenerate ``docs/evaluation.md`` whole: the paper's claims against faithful baselines, simulated.

Run: ``python benchmarks/paper_evaluation.py [--out docs] [--quick]``. Llama-2-7B (``+recipe=llama7b``)
on a simulated 32-card Ascend-910B cluster (``cluster=ascend910b_32``), every policy on the same
trace: Oobleck's five removal rates (6 h … 10 min, 15 removals, horizon 16 intervals) without and
with repairs, and faults at Llama 3's published rate; then the sweep of the selector's risk goal
(:func:`risk_sweep`: both recipes, Oobleck-style and Poisson traces, Chameleon against the fixed
strategies and the oracle). The scale benchmark
(``benchmarks/bench_simulator.py``) runs last. ``--quick`` runs one rate, one seed and a small
scale run (for CI; figures not for the docs). One rate through the CLI::

    python -m chameleon.simulate +recipe=llama7b cluster=ascend910b_32 sim.initial=planner \\
        trace=oobleck trace.interval_s=1800 sim.horizon_h=8
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from chameleon.config import CONF_DIR, register_configs
from chameleon.sim import report
from chameleon.sim.config import SimPolicy
from chameleon.sim.engine import RunResult, simulate
from chameleon.simulate import prepare

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_simulator  # noqa: E402

RATES = {"6 h": 21600, "3 h": 10800, "1 h": 3600, "30 min": 1800, "10 min": 600}
HORIZON_INTERVALS = 16  # an Oobleck-style trace runs this many removal intervals
BASE = ("+recipe=llama7b", "cluster=ascend910b_32", "sim.initial=planner", "sim.progress=false")
BASELINES = ("elaswave", "oobleck", "recycle", "bamboo", "checkpoint", "torchft")
REPAIR_H = 2.0
PAPER = {"gap": 0.11, "oobleck": 1.229, "recycle": 1.355}


def compose_cfg(*overrides: str, base: tuple[str, ...] = BASE):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=[*base, *overrides])


def compose_run(*overrides: str):
    return prepare(compose_cfg(*overrides))


def run_all(*overrides: str) -> tuple[dict[str, RunResult], object, tuple]:
    """Every policy on the trace the overrides describe."""
    setup, events, horizon, _ = compose_run(*overrides)
    return {p: simulate(setup, p, events, horizon_s=horizon) for p in POLICIES}, setup, events


def oobleck_sweep(rates: dict[str, int], repair_h: float | None) -> dict[str, dict[str, RunResult]]:
    """Every policy on Oobleck's trace at each removal interval, horizon :data:`HORIZON_INTERVALS` intervals."""
    out = {}
    for label, interval in rates.items():
        repair = "null" if repair_h is None else repair_h
        out[label] = run_all("trace=oobleck", f"trace.interval_s={interval}", f"trace.repair_h={repair}",
                             f"sim.horizon_h={HORIZON_INTERVALS * interval / 3600}")[0]
    return out


def llama3(seeds: int, days: float) -> tuple[dict[str, list[float]], dict[str, float], int, float]:
    """At Llama 3's fault rate, over ``seeds`` traces: throughput ÷ reference per policy and run, each policy's
    own failure-free share, the faults seen, and the cluster MTBF."""
    shares: dict[str, list[float]] = {p: [] for p in POLICIES}
    own: dict[str, float] = {}
    faults = 0
    for seed in range(seeds):
        runs, setup, events = run_all("trace=llama3", f"trace.seed={seed}", f"sim.horizon_h={24 * days}")
        faults += sum(e.kind == "remove" for e in events)
        for p, r in runs.items():
            shares[p].append(r.throughput / r.reference_throughput)
            own[p] = r.initial_throughput / r.reference_throughput
    return shares, own, faults, setup.mtbf_s


FIXED = ("dynamic", "reroute", "checkpoint")  # one recovery strategy, always
POLICIES = tuple(p for p in SimPolicy if p not in ("tolerate", "failstop"))  # these two differ only on slow devices
RISK_POLICIES = ("chameleon", "oracle", *FIXED)
RECIPES = {"default": ("sim.initial=planner",), "llama7b": ("+recipe=llama7b", "cluster=ascend910b_32", "sim.initial=planner")}
TIE = 1e-4  # throughputs this close (relative) are a tie: the policies made the same choices, placed a little apart
ORACLE_SHARE = 0.98  # the goal: Chameleon within 2 % of the oracle
SWEEP_RATES = {"6 h": 21600, "1 h": 3600, "10 min": 600}
POISSON_PER_DAY, POISSON_REPAIR_H, POISSON_HORIZON_H = 10, 4.0, 24.0  # the sweep's Poisson trace


def risk_traces(rates: dict[str, int], devices: int, node: int) -> dict[str, tuple[str, ...]]:
    """The goal's sweep on a cluster of ``devices`` in nodes of ``node``: Oobleck-style removals (a card, and on
    several nodes a whole node) at each rate, without and with returns :data:`REPAIR_H` later, and Poisson faults."""
    sizes = (1, node) if devices > node else (1,)
    traces = {}
    for size in sizes:
        for label, interval in rates.items():
            for repair in ("null", REPAIR_H):
                what = "card" if size == 1 else f"node of {size}"
                back = "never back" if repair == "null" else f"back after {repair:g} h"
                traces[f"a {what} every {label}, {back}"] = (
                    "trace=oobleck", f"trace.interval_s={interval}", f"trace.repair_h={repair}", f"trace.node_size={size}",
                    f"sim.horizon_h={HORIZON_INTERVALS * interval / 3600}")
    traces[f"Poisson, ~{POISSON_PER_DAY} faults a day"] = (
        "trace=poisson", f"trace.device_mtbf_h={devices * 24 / POISSON_PER_DAY:g}", f"trace.repair_h={POISSON_REPAIR_H:g}",
        f"sim.horizon_h={POISSON_HORIZON_H:g}")
    return traces


def risk_sweep(rates: dict[str, int], recipes: tuple[str, ...] = tuple(RECIPES)) -> list[dict]:
    """Chameleon, the oracle and the fixed strategies on every trace of the goal's sweep, one row per trace."""
    rows = []
    for recipe in recipes:
        base = (*RECIPES[recipe], "sim.progress=false")
        cluster = compose_cfg(base=base).cluster
        for label, overrides in risk_traces(rates, cluster.n_devices, cluster.devices_per_node).items():
            setup, events, horizon, _ = prepare(compose_cfg(*overrides, base=base))
            runs = {p: simulate(setup, p, events, horizon_s=horizon) for p in RISK_POLICIES}
            rows.append({"recipe": recipe, "devices": cluster.n_devices, "trace": label, "overrides": " ".join(overrides),
                         "runs": runs,
                         "avoidable_halts": [p for p, r in runs.items() if _avoidable_halt(r)]})
    return rows


def _avoidable_halt(run: RunResult) -> bool:
    """The run stopped while devices were left (a checkpoint reload onto them would have gone on)."""
    return run.halted_at is not None and any(r["choice"] == "halt" and r["devices_left"] > 0 for r in run.recoveries)


def risk_table(rows: list[dict]) -> str:
    out = ["| recipe | trace | chameleon | oracle | best fixed | ÷ best fixed | ÷ oracle | halts a checkpoint could save |",
           "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        runs = row["runs"]
        cham, oracle = runs["chameleon"].throughput, runs["oracle"].throughput
        fixed = max(FIXED, key=lambda p: runs[p].throughput)
        out.append(f"| {row['recipe']} | {row['trace']} | {cham:.3f} | {oracle:.3f} | {fixed} {runs[fixed].throughput:.3f} | "
                   f"{cham / runs[fixed].throughput:.4f} | {cham / oracle:.4f} | {', '.join(row['avoidable_halts']) or 'none'} |")
    return "\n".join(out)


def risk_goal(rows: list[dict]) -> str:
    """Which traces miss the goal (≥ the best fixed strategy, ≥ :data:`ORACLE_SHARE` of the oracle, no avoidable halt),
    and by what."""
    misses = []
    for row in rows:
        runs = row["runs"]
        cham = runs["chameleon"].throughput
        fixed = max(runs[p].throughput for p in FIXED)
        why = [f"{cham / fixed:.4f} of the best fixed" for _ in [0] if cham < fixed * (1 - TIE)]
        why += [f"{cham / runs['oracle'].throughput:.4f} of the oracle" for _ in [0] if cham < ORACLE_SHARE * runs["oracle"].throughput]
        why += [f"{p} halted while devices were left" for p in row["avoidable_halts"] if p == "chameleon"]
        if why:
            misses.append(f"{row['recipe']}, {row['trace']}: {'; '.join(why)}")
    return "met on every trace" if not misses else "missed on " + "; ".join(misses)


def risk_facts(rows: list[dict], rates: dict[str, int]) -> dict:
    """The sweep's setting as the prose quotes it: its recipes, rates, tie and oracle margins."""
    devices = {row["recipe"]: row["devices"] for row in rows}
    return dict(risk_recipes=" and ".join(f"`{r}` on {n} devices" for r, n in devices.items()),
                risk_rates=" / ".join(rates), tie=TIE, oracle_margin=1 - ORACLE_SHARE, poisson_per_day=POISSON_PER_DAY,
                poisson_repair_h=POISSON_REPAIR_H, poisson_horizon_h=POISSON_HORIZON_H)


def first_fault(run: RunResult) -> float:
    return next(r["post_over_reference"] for r in run.recoveries if r["kind"] == "fault")


def sweep_table(sweep: dict[str, dict[str, RunResult]]) -> str:
    head = ("| removal every | " + " | ".join(POLICIES)
            + " | Cham./Oobleck | Cham./ReCycle | baselines ahead of Chameleon |")
    rows = [head, "|" + "---|" * (len(POLICIES) + 4)]
    for label, runs in sweep.items():
        cham = runs["chameleon"].throughput
        ahead = [b for b in BASELINES if runs[b].throughput > cham * (1 + 1e-9)]
        rows.append(
            f"| {label} | " + " | ".join(f"{runs[p].throughput:.2f}" for p in POLICIES)
            + f" | {cham / runs['oobleck'].throughput:.3f}× | {cham / runs['recycle'].throughput:.3f}× | "
            + (", ".join(ahead) or "none") + " |"
        )
    return "\n".join(rows)


def ratio_range(sweep, baseline: str) -> tuple[float, float]:
    ratios = [runs["chameleon"].throughput / runs[baseline].throughput for runs in sweep.values()]
    return min(ratios), max(ratios)


def commit() -> str:
    """The checked-out commit, flagged when code (anything outside docs/) differs from it."""
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"],
                           capture_output=True, text=True, cwd=root).stdout
    return (head or "unknown") + (" with uncommitted changes" if dirty.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    parser.add_argument("--quick", action="store_true", help="one rate, one seed, a small scale run (CI)")
    args = parser.parse_args()
    register_configs()
    start, load_start = time.perf_counter(), os.getloadavg()
    rates = {"10 min": RATES["10 min"]} if args.quick else RATES
    seeds, days = (1, 5.0) if args.quick else (20, 54.0)
    plain = oobleck_sweep(rates, None)
    repaired = oobleck_sweep(rates, REPAIR_H)
    detail_label = "10 min" if args.quick else "30 min"
    detail = plain[detail_label]
    setup = compose_run("trace=none")[0]
    args.out.mkdir(parents=True, exist_ok=True)
    report.plot_timeline(list(detail.values()), compose_run("trace=oobleck", f"trace.interval_s={RATES[detail_label]}",
                                                            f"sim.horizon_h={HORIZON_INTERVALS * RATES[detail_label] / 3600}")[1],
                         args.out / "eval_throughput_30min.png", title=f"one card removed every {detail_label}")
    report.plot_breakdown([r.to_dict() for r in detail.values()], args.out / "eval_breakdown_30min.png",
                          title=f"one card removed every {detail_label}")
    risk_rates, risk_recipes = ({"10 min": SWEEP_RATES["10 min"]}, ("llama7b",)) if args.quick else (SWEEP_RATES, tuple(RECIPES))
    risk_rows = risk_sweep(risk_rates, risk_recipes)
    field, field_own, field_faults, field_mtbf = llama3(seeds, days)
    scale = bench_simulator.measure(devices=256 if args.quick else 4096, days=1.0 if args.quick else 30.0)
    facts = collect_facts(plain, repaired, setup)
    text = TEMPLATE.format(
        command=" ".join(["python", "benchmarks/paper_evaluation.py", *sys.argv[1:]]), commit=commit(),
        env=f"Python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPU cores",
        load_start=" ".join(f"{x:.1f}" for x in load_start), load_end=" ".join(f"{x:.1f}" for x in os.getloadavg()),
        wall=time.perf_counter() - start, repair_h=REPAIR_H, plain=sweep_table(plain), repaired=sweep_table(repaired),
        detail_label=detail_label, detail=report.table([r.to_dict() for r in detail.values()]),
        field=field_table(field, field_own), seeds=seeds, days=days, field_faults=field_faults, faults_per_run=field_faults / seeds, field_mtbf_h=field_mtbf / 3600,
        field_device_mtbf_h=field_mtbf / 3600 * setup.n_devices, scale=scale, risk=risk_table(risk_rows),
        risk_goal=risk_goal(risk_rows), **risk_facts(risk_rows, risk_rates), **facts,
    )
    (args.out / "evaluation.md").write_text(text)
    print(text)


def field_table(shares: dict[str, list[float]], own: dict[str, float]) -> str:
    rows = ["| policy | own failure-free / ref. | throughput / reference, mean | min | max | mean ÷ own failure-free |",
            "|---|---|---|---|---|---|"]
    for p, xs in shares.items():
        rows.append(f"| {p} | {own[p]:.4f} | {statistics.fmean(xs):.4f} | {min(xs):.4f} | {max(xs):.4f} | "
                    f"{statistics.fmean(xs) / own[p]:.4f} |")
    return "\n".join(rows)


def collect_facts(plain, repaired, setup) -> dict:
    """The numbers the prose quotes, all taken from the runs above."""
    ref, n, profile, sim = setup.reference, setup.n_devices, setup.planning.profile, setup.sim
    recipe_cfg = compose_cfg("trace=none", "sim.initial=recipe")
    recipe = prepare(recipe_cfg)[0]
    oobleck_trace, llama3_trace = compose_cfg("trace=oobleck").trace, compose_cfg("trace=llama3").trace
    six = plain["6 h"] if "6 h" in plain else next(iter(plain.values()))
    cham, oob, rec = six["chameleon"], six["oobleck"], six["recycle"]
    faults = [r for r in cham.recoveries if r["kind"] == "fault"]
    oob_pauses = [r["pause_s"] for r in oob.recoveries if r["kind"] == "fault"]
    rec_choices = [r["choice"] for runs in plain.values() for r in runs["recycle"].recoveries if r["kind"] == "fault"]
    fast_label = list(plain)[-1]  # the shortest interval
    fast = plain[fast_label]
    fast_oob = [r for r in fast["oobleck"].recoveries if r["kind"] == "fault"]
    target = fast["chameleon"].throughput / PAPER["oobleck"]
    horizon = fast["oobleck"].horizon_s
    oob_fast_pause = statistics.fmean(r["pause_s"] for r in fast_oob)
    oob_needed = oob_fast_pause + (fast["oobleck"].throughput - target) * horizon / (len(fast_oob) * fast["oobleck"].throughput)
    ahead = sorted({b for sweep in (plain, repaired) for runs in sweep.values() for b in BASELINES
                    if runs[b].throughput > runs["chameleon"].throughput * (1 + 1e-9)})
    lows = {b: min(ratio_range(plain, b)[0], ratio_range(repaired, b)[0]) for b in ("oobleck", "recycle")}
    o_lo, o_hi = ratio_range(plain, "oobleck")
    r_lo, r_hi = ratio_range(plain, "recycle")
    ro_lo, ro_hi = ratio_range(repaired, "oobleck")
    rr_lo, rr_hi = ratio_range(repaired, "recycle")
    return dict(
        ref_shape=" + ".join(f"{p.n_stages}-stage ×{p.micro_batches}mb" for p in ref.pipelines),
        ref_tput=setup.reference_throughput,
        start_shape=f"{setup.plan.dp} × {setup.plan.pipelines[0].n_stages} stages",
        start_share=setup.plan.global_batch / setup.planning.t_step(setup.plan) / setup.reference_throughput,
        recipe_share=recipe.plan.global_batch / recipe.planning.t_step(recipe.plan) / setup.reference_throughput,
        n_cards=n, node=profile.devices_per_node, n_nodes=-(-n // profile.devices_per_node),
        batch=recipe_cfg.train.global_batch, seq_len=recipe_cfg.train.seq_len, micro_batch=recipe_cfg.train.micro_batch,
        recipe_dp=recipe_cfg.parallel.dp, recipe_pp=recipe_cfg.parallel.pp,
        prior_h=setup.policy.mtbf_prior_s / 3600, oob_pipelines=sim.oobleck.fault_threshold + 1,
        group_create_ms=profile.group_create_s * 1e3, restart_s=profile.restart_s, communicator_s=sim.elaswave.communicator_s,
        bamboo_reconfigure_s=sim.bamboo.reconfigure_s, bamboo_overload=sim.bamboo.overload_threshold,
        bamboo_fatal_s=sim.bamboo.fatal_restart_s, torchft_timeout_s=sim.torchft.timeout_s,
        ref_step_s=setup.planning.t_step(ref), n_removals=oobleck_trace.n_removals, horizon_intervals=HORIZON_INTERVALS,
        incidents=llama3_trace.incidents, incident_days=llama3_trace.incident_days,
        incident_devices=llama3_trace.incident_devices, llama3_repair_h=llama3_trace.repair_h,
        first=first_fault(cham), gap=1 - first_fault(cham), survivors=faults[0]["devices_left"],
        linear=faults[0]["devices_left"] / n, n_faults=len(faults),
        mean_post=statistics.fmean(r["post_over_reference"] for r in faults), cham_pause=statistics.fmean(r["pause_s"] for r in faults),
        last_post=faults[-1]["post_over_reference"], last_left=faults[-1]["devices_left"], last_linear=faults[-1]["devices_left"] / n,
        fewest_peers=min(sum(q.n_stages == p.n_stages for q in setup.plan.pipelines) - 1 for p in setup.plan.pipelines),
        o_lo=o_lo, o_hi=o_hi, r_lo=r_lo, r_hi=r_hi, ro_lo=ro_lo, ro_hi=ro_hi, rr_lo=rr_lo, rr_hi=rr_hi,
        oob_first=first_fault(oob), reroute_first=first_fault(six["reroute"]), oob_ff=oob.initial_throughput / oob.reference_throughput,
        oob_pause=statistics.fmean(oob_pauses), rec_first=first_fault(rec), rec_ff=rec.initial_throughput / rec.reference_throughput,
        rec_restarts=rec_choices.count("restart"), rec_reroutes=rec_choices.count("reroute"),
        rec_halts=sum(runs["recycle"].halted_at is not None for runs in plain.values()),
        cham_choices=" ".join(sorted({r["choice"] for runs in plain.values() for r in runs["chameleon"].recoveries})),
        elas_over_cham=max(runs["elaswave"].throughput / runs["chameleon"].throughput for runs in plain.values()) - 1,
        n_rates=len(plain), first_label=next(iter(plain)),
        paper_gap=PAPER["gap"], paper_o=PAPER["oobleck"], paper_r=PAPER["recycle"],
        gap_verdict="reproduced" if 1 - first_fault(cham) <= PAPER["gap"] else "not reproduced",
        o_verdict=_verdict(o_hi, ro_hi, PAPER["oobleck"]), r_verdict=_verdict(r_hi, rr_hi, PAPER["recycle"]),
        fast_label=fast_label, oob_needed=oob_needed, oob_fast_pause=oob_fast_pause,
        oob_pause_share=statistics.fmean(oob_pauses) / RATES[fast_label],
        ahead_of_cham=", ".join(ahead) or "none",
        o_goal=_goal(lows["oobleck"], PAPER["oobleck"]), r_goal=_goal(lows["recycle"], PAPER["recycle"]),
    )


def _verdict(plain: float, repaired: float, paper: float) -> str:
    if plain >= paper:
        return "reproduced on Oobleck's traces"
    if repaired >= paper:
        return f"reproduced only with repairs; {plain:.3f}× at best on Oobleck's traces"
    return f"not reproduced: {max(plain, repaired):.3f}× at best"


def _goal(lowest: float, paper: float) -> str:
    return f"met (≥ {lowest:.3f}×)" if lowest >= paper else f"missed (down to {lowest:.3f}× against {paper:.3f}×)"


TEMPLATE = """# Evaluation: the paper's claims against faithful baselines, simulated

Generated whole by `{command}` at commit `{commit}` in {wall:.0f} s ({env}; load average
{load_start} at the start and {load_end} at the end: the host is shared with other work, which
slows the script but changes no simulated figure). Every number comes from the simulator
(`python -m chameleon.simulate`'s engine) driving the real planner, estimator and selector
(`chameleon/decision/`); nothing is measured on hardware. The real peer measured side by side
with Chameleon's runtime is in [torchft.md](torchft.md).

## Set-up

- **Cluster** `cluster=ascend910b_32`: {n_cards} Ascend-910B-class cards, {n_nodes} nodes × {node}, analytic profile
  from datasheet figures (sources and the unsure ones in `conf/cluster/ascend910b_32.yaml`). The
  paper's testbed is "a 32-card cluster"; its card model, interconnect and layout were not
  recovered.
- **Model** `+recipe=llama7b`: Llama-2-7B shape, {batch} sequences × {seq_len} tokens per step, micro-batch {micro_batch}.
- **Reference** (the denominator of every ratio below): the planner's best failure-free plan on
  the full cluster, cards allowed to idle when that is faster (`sim.reference_idle`): here
  {ref_shape}, **{ref_tput:.2f} samples/s**. The recipe's even {recipe_dp} × {recipe_pp} layout reaches
  {recipe_share:.3f} of it, so it is no reference. No ratio to the reference can exceed 1. The
  linear limit `(cards left)/{n_cards}` is not a hard bound: the planner's plans differ in efficiency
  per card (a plan on fewer cards can beat its share of the {n_cards}-card one), so it is printed beside the ratios.
- **Every policy starts** from one plan, the planner's fastest even plan on all {n_cards} cards
  ({start_shape}, {start_share:.3f} of the reference; `sim.initial=planner`): equal pipelines, as torchft
  and ReCycle replicate them. Bamboo and Oobleck lay the cards out by their own rules (shadow stages; at least
  f+1 templates): their column `own failure-free / ref.` in the detailed table.

## The baselines and what each models

Each model's module docstring names the source of every cost and what it leaves out.

| policy | models | sources | left out |
|---|---|---|---|
| `chameleon` | Eq. 8 over reroute, re-plan, neighbour takeover; D from a Gamma–Poisson posterior ({prior_h:g} h prior) | this repository | — |
| `oracle`, `dynamic`, `reroute` | Chameleon with the true D; forced to re-plan; forced to reroute (Eq. 12/13, falls back to Eq. 8 when rerouting is impossible) | this repository | — |
| `elaswave` | best re-plan after every change, a {communicator_s:g} s communicator edit, migration free (off the critical path) | arXiv 2510.00606 abstract | DVFS bubble absorption (no boost figure published) |
| `oobleck` | pipeline templates (Oobleck's `T1+T2+T3`), ≥ f+1 = {oob_pipelines} pipelines, its batch distribution, local shrink/borrow/merge on a fault, per-layer group rebuild + first-holder weight broadcast, no rerouting, repaired nodes idle | `SymbioticLab/Oobleck`: `planning/instantiator.py`, `csrc/planning/execution_result.h`, `execution/engine.py`, `tools/simulator/oobleck_simulator.py` | GPUs per node, FSDP, pipeline/FSDP group creation |
| `recycle` | even plan, reroute to same-stage peers; step = max(1F1B step, busiest device's work + its stage's sync + optimizer): every bubble filled, staggered optimizer; restart on an even plan when rerouting is impossible | arXiv 2405.14009 (abstract: decoupled backprop, staggered optimizer, bubbles) | rerouted activation transfers, deferred weight-gradient memory |
| `bamboo` | shadow forward `(2 − hidden)×` with hidden = the bubble share, shadow weights + optimizer in memory, fail-over to the predecessor, Oobleck's artifact rules: reconfigure ({bamboo_reconfigure_s:g} s) when 2·overloaded/active > {bamboo_overload:.0%}, fatal restart {bamboo_fatal_s:g} s | `uclasystem/bamboo` (`get_redundant_stage_ids`), Oobleck's `tools/simulator/bamboo_simulator.py` | lazy mode, shadow weight transfer |
| `checkpoint` | Young/Daly interval `sqrt(2·δ·MTBF)`, restart on the best even plan: {restart_s:g} s relaunch + reload + rolled-back progress; a checkpoint and a restart onto repaired cards | Young 1974 / Daly 2006; FlashRecovery (arXiv 2509.03047): 150 s on 4,800 devices; Llama 3: ≥ 90 % effective time over 419 interruptions (≤ 18.6 min each) | asynchronous checkpoints |
| `torchft` | even plan, the replica group with a failed card drops out (its samples dropped), survivors wait the {torchft_timeout_s:g} s collective timeout (its default; on these {ref_step_s:.0f}-s steps a short timeout would fire on healthy steps), heal when all its cards are back | pytorch/torchft 0.2.0 (`Manager` defaults), measured in [torchft.md](torchft.md) | Lighthouse heartbeat/join timeouts |

## The paper's three headline claims

| claim | paper (abstract) | this simulation | verdict |
|---|---|---|---|
| post-recovery gap | ≤ {paper_gap:.0%} | {gap:.1%} after the first fault (post/ref. {first:.3f}; linear limit {linear:.3f}) | {gap_verdict} |
| average throughput vs Oobleck | up to {paper_o:.3f}× | {o_lo:.3f}–{o_hi:.3f}× without repairs, {ro_lo:.3f}–{ro_hi:.3f}× with | {o_verdict} |
| average throughput vs ReCycle | up to {paper_r:.3f}× | {r_lo:.3f}–{r_hi:.3f}× without repairs, {rr_lo:.3f}–{rr_hi:.3f}× with | {r_verdict} |

## Oobleck's traces: one card removed every interval (samples/s)

{n_removals} removals, no re-join, horizon {horizon_intervals} intervals. Cham./X divides Chameleon's average throughput by X's.

{plain}

## The same traces with repairs: each card back {repair_h:g} h after its removal

{repaired}

## One rate in detail: a card removed every {detail_label}

{detail}

`× chameleon` is Chameleon's throughput ÷ the row's; `/ reference` the row's throughput ÷ the
reference's; `own failure-free / ref.` the row's own starting plan ÷ the reference; `post/ref.`
the throughput right after a fault ÷ the reference, after the first fault and averaged over all.
`ETTR` is the share of the horizon training at the reference rate. Time shares sum to the horizon:
productive (committed samples at the reference rate), degraded (the rest of the committed steps'
time), detection, decision and restore (recovery pauses, split where the policy knows its parts),
redone (aborted steps, rolled-back progress), checkpoint (blocking writes), shutdown (time after the
job stopped).

![throughput over time](eval_throughput_30min.png)
![time breakdown](eval_breakdown_30min.png)

## Faults at Llama 3's published rate (`trace=llama3`)

{incidents} unexpected interruptions in {incident_days:g} days on {incident_devices:,} GPUs is one per {field_device_mtbf_h:,.0f}
GPU-hours; on {n_cards} cards that is one fault every {field_mtbf_h:,.0f} h. {seeds} traces of {days:g}
days each (cards back after {llama3_repair_h:g} h) hold {field_faults} faults in all. Throughput ÷ reference per policy:

{field}

At this rate a {n_cards}-card job meets {faults_per_run:.1f} faults a run on average, so two things separate the policies:
what each pays without faults (the common even plan's {start_share:.3f} of the reference; Oobleck's templates,
Bamboo's redundant forward and shadow memory, checkpoint writes) and how long
one fault's damage lasts (the last column): Oobleck never takes the repaired card back, ReCycle
and torchft run degraded until the repair (ReCycle longer when a second fault forced a restart),
checkpoint-restart rolls back and relaunches twice.

## Where ours differ from the paper, and why

- **Post-recovery gap.** After the first lost card Chameleon re-plans the {survivors} survivors to
  {first:.3f} of the reference; over the {n_faults} faults of the {first_label} trace the mean is {mean_post:.3f},
  and after the last ({last_left} cards left) {last_post:.3f} (linear limit {last_linear:.3f}). The
  paper's "within {paper_gap:.2%}" is {gap_verdict}. Simulated figures inherit the estimator's error
  (measured against CPU steps in [decision.md](decision.md)) and know no stragglers or
  jitter, so a measured gap on real cards would be larger.
- **Against Oobleck we find {o_lo:.3f}–{o_hi:.3f}×, not {paper_o:.3f}×.** Modelled from its code,
  Oobleck's templates on this cluster give a failure-free plan at {oob_ff:.3f} of the reference,
  and after one fault its local re-instantiation reaches {oob_first:.3f} (Chameleon's global
  re-plan: {first:.3f}). Its reconfiguration pause (a mean of {oob_pause:.1f} s here: per-layer
  group creation at {group_create_ms:g} ms each plus the weight broadcast; its own simulator charges 10 s for
  GPT-3 6.7B) is {oob_pause_share:.2%} of the shortest interval ({fast_label}). The gap opens where Oobleck cannot
  follow: repaired cards return (it leaves them idle), and its local shrink drifts away from the
  best plan as faults accumulate. Oobleck's code reconfigures only when nodes are lost
  (`ReconfigurationEngine` listens for lost nodes; its simulator never reconfigures for added
  ones), so on the traces with repairs the returned cards idle and the ratio grows to
  {ro_hi:.3f}×. What the paper's {paper_o:.3f}× rests on — Oobleck's real
  reconfiguration on Ascend, its template set, the paper's own trace — was not recovered. At the
  fastest rate (a card every {fast_label}), Oobleck would have to pause about {oob_needed:,.0f} s
  per fault instead of {oob_fast_pause:.1f} s for Chameleon to lead it by {paper_o:.3f}×.
- **Against ReCycle we find {r_lo:.3f}–{r_hi:.3f}×.** Our ReCycle is the most favourable reading of
  its abstract: rerouted work fills every bubble and the step is never slower than the busiest
  device's work. Its first fault costs little ({rec_first:.3f} of the reference, from
  {rec_ff:.3f} on its even plan), but every further fault in the same stage piles more micro-batches
  on fewer peers; across the {n_rates} rates it rerouted {rec_reroutes} faults, restarted {rec_restarts}
  times when rerouting became impossible (no live peer, or the hosts' extra activations no longer
  fit), and stopped {rec_halts} times when a stage had lost every replica. Chameleon forced to reroute
  does worse after the first fault ({reroute_first:.3f}): the lost stage's micro-batches go to its
  {fewest_peers} same-stage peers, which carry them on top of their own; Eq. 8 re-plans instead.
- **ElasWave, the highest anchor, is ahead of Chameleon by up to {elas_over_cham:.2%}:** our model
  of it pays 1 s per change and nothing for migration, where Chameleon pays its state migration
  (a mean of {cham_pause:.1f} s per fault on the {first_label} trace). Chameleon's choices across the plain traces: {cham_choices}. With transitions this
  cheap, Eq. 8 re-plans at every rate; rerouting wins only when re-planning is dear (Eq. 8's
  crossover: `tests/test_decision_selector.py`).
- **Goal** (ahead of every modelled baseline at every rate, by at least the paper's ratios where
  its setting is matched). Baselines ahead of Chameleon at some rate: {ahead_of_cham}. Lead at
  every rate (plain and repaired traces) by at least the paper's ratio: over Oobleck {o_goal},
  over ReCycle {r_goal}.

## Pricing the next fault: Chameleon against fixed strategies and the oracle

Chameleon's selector scores each candidate by Eq. 8 less the expected cost of the next fault on
its plan (`chameleon/decision/selector.py`): the share of fault domains whose loss would leave
a layer with no replica, times a reload and the progress since the newest checkpoint (its age
and interval known), or the whole run when none exists. Its re-plans weigh the planner's best
plan, its best with every layer on two pipelines, and its best on fewer cards (the rest idle).
Like the runtime, the simulated Chameleon writes asynchronous checkpoints (Young/Daly interval,
training on while each lands) and may reload one. The sweep: {risk_recipes} (`default`: the tiny
model on this host's local devices, profiled; `llama7b` on `cluster=ascend910b_32`), each
starting from its planner's plan; Oobleck-style removals (a card, and on several nodes a whole node) every
{risk_rates}, never back or back after {repair_h:g} h, horizon {horizon_intervals} intervals; Poisson faults at
about {poisson_per_day} a day, back after {poisson_repair_h:g} h, over {poisson_horizon_h:g} h. Fixed strategies: `dynamic` and `reroute` (Chameleon
forced to one) and `checkpoint` (restart). Samples/s; ratios of Chameleon's; a halt "a
checkpoint could save" is one with live cards left.

{risk}

Goal (never below the best fixed strategy — ties within {tie:.2%} — within {oracle_margin:.0%} of the oracle, no
avoidable halt): {risk_goal}. The oracle knows when the next fault comes, not which cards it
takes, so Chameleon can beat it where a replicated plan's insurance does not pay.

## Scale benchmark

{scale}
"""


if __name__ == "__main__":
    main()
