"""Chameleon's runtime next to torchft 0.2.0: one worker SIGKILLed mid-step, measured side by side.

Run: ``python benchmarks/bench_torchft.py [--out docs] [--quick] [--torchft-timeout 2]`` (needs the
``peers`` extra: ``pip install -e '.[peers]'``). Both systems train the same tiny Llama on the same
sample stream, CPU/gloo, one thread per worker, one after the other in this one run:

1. **Data parallel, 4 workers.** Chameleon: ``python -m chameleon.train launcher.nproc_per_node=4
   parallel=dp failure=kill failure.rank=1 failure.phase=any``. torchft: 4 replica groups of one
   process (``torchft.Manager`` + ``ProcessGroupGloo``, a Lighthouse in this process), replica 1
   killed at a random moment of the same step and restarted at once, as torchelastic would.
2. **Pipelines, 2 × 2 workers.** Chameleon: 2 pipelines of 2 stages (``parallel=default``),
   rank 1 (pipeline 0, stage 1) killed. torchft: 2 replica groups of a 2-stage pipeline (GPipe
   over gloo point-to-point inside the group); stage 1 of group 0 killed, its stage 0 killed with
   it (a torchrun group dies whole) and the group restarted. torchft can neither reroute nor
   re-plan a pipeline: the group drops out until it heals.

Measured from the runs' own logs (Chameleon's ``events.jsonl``/``metrics.jsonl``, the torchft
workers' commit log): failure-free samples/s, kill → the survivors' next committed step, samples
per step and samples/s until the killed worker is back, the restarted torchft group's time to heal
back in, and the samples trained in the ``window`` seconds after the kill ÷ the failure-free rate.
torchft gets the same fault-detection budget as Chameleon's ``ft.heartbeat_timeout_s`` (2 s): its
collective timeout, the Lighthouse's join and heartbeat timeouts (``--torchft-timeout``; torchft's
own defaults are 60 s). ``--quick``: 2 data-parallel workers, a short window (CI; not for the docs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
SEED = 0
HEAL_CAP_S = 40.0  # the longest a run waits for the restarted torchft group to heal
sys.path.insert(0, str(Path(__file__).resolve().parent))
from paper_evaluation import commit  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One layout: ``groups`` data-parallel replicas of ``stages`` stages; the victim is (group, stage)."""

    name: str
    groups: int
    stages: int
    kill_step: int
    window_s: float
    victim: tuple[int, int]


@dataclass
class Result:
    """What one system did in one case (seconds, samples)."""

    system: str
    failure_free: float
    first_commit_s: float
    all_commit_s: float
    batch_after: int
    rate_after: float
    heal_s: float | None
    back_s: float | None
    window_share: float
    detail: str


# --- the torchft side --------------------------------------------------------------------------------

def _worker(group: int, rank: int, case: Case, lighthouse: str, store_port: int, incarnation: int, log: str,
            timeout_s: float, cfg: dict) -> None:
    """One torchft worker: stage ``rank`` of replica group ``group``, training until it is killed."""
    import torch.distributed as dist
    import torchft
    from torch.distributed import PrefixStore, TCPStore

    from chameleon.config import DataConfig
    from chameleon.data.stream import open_streams
    from chameleon.model.config import ModelConfig
    from chameleon.model.spec import spec_of

    torch.set_num_threads(1)
    noise = os.open(f"{log}.g{group}r{rank}i{incarnation}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(noise, 1)
    os.dup2(noise, 2)  # torchft's own logging, kept out of the report
    model = ModelConfig(**cfg["model"])
    train = cfg["train"]
    n_layers, stages = model.n_layers, case.stages
    per_stage = n_layers // stages
    layers = (rank * per_stage, (rank + 1) * per_stage)
    first, last = rank == 0, rank == stages - 1
    spec = spec_of(model)
    names = spec.stage_param_names(model, layers, first=first, last=last)
    params = {k: v.requires_grad_() for k, v in spec.init_params(model, train["seed"], names=names).items()}
    opt = torch.optim.AdamW(params.values(), lr=train["lr"], betas=(train["beta1"], train["beta2"]), eps=train["eps"],
                            weight_decay=train["weight_decay"])
    store = TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
    if stages > 1:
        dist.init_process_group("gloo", store=PrefixStore("pipeline", store), rank=rank, world_size=stages,
                                timeout=timedelta(seconds=60))

    def state() -> dict:
        return {"params": {k: v.detach() for k, v in params.items()}, "optim": opt.state_dict()}

    def load(sd: dict) -> None:
        with torch.no_grad():
            for k, v in sd["params"].items():
                params[k].copy_(v)
        opt.load_state_dict(sd["optim"])

    timeout = timedelta(seconds=timeout_s)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout), load_state_dict=load, state_dict=state, min_replica_size=1,
        store_addr="127.0.0.1", store_port=store_port, rank=rank, world_size=stages, lighthouse_addr=lighthouse,
        replica_id=f"group{group}", timeout=timeout, quorum_timeout=timedelta(seconds=60),
    )
    optimizer = torchft.Optimizer(manager, opt)
    stream = open_streams(DataConfig(), seq_len=train["seq_len"], seed=train["seed"]).train
    per_group = train["global_batch"] // case.groups
    micro = train["micro_batch"]
    out = open(log, "a")
    while True:
        t_start = time.time()
        optimizer.zero_grad()
        step = manager.current_step()
        base = step * train["global_batch"] + group * per_group
        batches = [stream.batch(range(base + m, base + m + micro)) for m in range(0, per_group, micro)]
        _forward_backward(params, model, batches, layers, first, last, rank, stages, per_group * train["seq_len"])
        flat = torch.cat([p.grad.flatten() for p in params.values()])
        manager.allreduce(flat).wait()
        offset = 0
        for p in params.values():
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
        committed = manager.current_step() > step
        out.write(json.dumps({"group": group, "rank": rank, "incarnation": incarnation, "step": step, "committed": committed,
                              "participants": manager.num_participants(), "t_start": t_start, "t": time.time(),
                              "samples": per_group}) + "\n")
        out.flush()


def _forward_backward(params, model, batches, layers, first, last, rank, stages, tokens) -> None:
    """GPipe over point-to-point: every micro-batch forward, then every one backward; loss averaged over the group's tokens."""
    import torch.distributed as dist

    from chameleon.model.spec import spec_of

    forward = spec_of(model).stage_forward
    if stages == 1:
        for x, y in batches:
            loss = forward(params, model, x, layers=layers, first=True, last=True, targets=y)
            (loss / tokens).backward()
        return
    shape = (batches[0][0].shape[0], batches[0][0].shape[1], model.dim)
    outs = []
    for x, y in batches:
        h = x if first else torch.empty(shape)
        if not first:
            dist.recv(h, rank - 1)
            h.requires_grad_()
        out = forward(params, model, h, layers=layers, first=first, last=last, targets=y if last else None)
        if not last:
            dist.send(out.detach(), rank + 1)
        outs.append((h, out))
    for h, out in outs:
        if last:
            (out / tokens).backward()
        else:
            grad = torch.empty(shape)
            dist.recv(grad, rank + 1)
            out.backward(grad)
        if not first:
            dist.send(h.grad, rank - 1)


class _Group:
    """A replica group's processes, started (and restarted) the way torchrun would, with a fresh store each time."""

    def __init__(self, ctx, group: int, case: Case, lighthouse: str, log: Path, timeout_s: float, cfg: dict):
        self.ctx, self.group, self.case, self.lighthouse, self.log, self.timeout_s, self.cfg = ctx, group, case, lighthouse, log, timeout_s, cfg
        self.incarnation = -1
        self.procs: list = []
        self.store = None

    def start(self) -> None:
        from torch.distributed import TCPStore

        self.incarnation += 1
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.procs = [
            self.ctx.Process(target=_worker, args=(self.group, r, self.case, self.lighthouse, self.store.port, self.incarnation,
                                                  str(self.log), self.timeout_s, self.cfg), daemon=True)
            for r in range(self.case.stages)
        ]
        for p in self.procs:
            p.start()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.join()


def run_torchft(case: Case, cfg: dict, work: Path, timeout_s: float) -> tuple[list[dict], float, float]:
    """Train ``case`` under torchft, kill the victim mid-step and restart its group; the commit log, kill and restart times."""
    ms = str(int(timeout_s * 1000))
    port = _free_port()
    log = work / f"torchft_{case.name}.jsonl"
    log.write_text("")
    with open(work / f"lighthouse_{case.name}.log", "w") as noise:
        lighthouse = subprocess.Popen(
            [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"[::]:{port}", "--min_replicas", "1",
             "--quorum_tick_ms", "100", "--join_timeout_ms", ms, "--heartbeat_timeout_ms", ms],
            stdout=noise, stderr=noise,
        )
    ctx = mp.get_context("spawn")
    groups = [_Group(ctx, g, case, f"http://127.0.0.1:{port}", log, timeout_s, cfg) for g in range(case.groups)]
    try:
        for g in groups:
            g.start()
        vg, vr = case.victim
        victim_steps = _wait_for(log, vg, vr, case.kill_step - 1, case.groups)
        step_s = statistics.median(b["t"] - a["t"] for a, b in zip(victim_steps, victim_steps[1:]))
        time.sleep(random.Random(SEED).uniform(0, 0.9) * step_s)
        t_kill = time.time()
        os.kill(groups[vg].procs[vr].pid, signal.SIGKILL)
        groups[vg].kill()  # torchrun tears the whole group down
        groups[vg].start()
        t_restart = time.time()
        _wait_for_heal(log, vg, t_kill + case.window_s + 0.5, t_kill + HEAL_CAP_S)
    finally:
        for g in groups:
            g.kill()
        lighthouse.kill()
        lighthouse.wait()
    return _read(log), t_kill, t_restart


def _wait_for_heal(log: Path, group: int, not_before: float, cap: float) -> None:
    """Sleep past ``not_before`` and until the restarted ``group`` has committed (or ``cap`` passes)."""
    while time.time() < cap:
        if time.time() >= not_before and any(e["group"] == group and e["incarnation"] > 0 and e["committed"] for e in _read(log)):
            return
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(log: Path, group: int, rank: int, step: int, groups: int, timeout_s: float = 180.0) -> list[dict]:
    """Poll the commit log until worker (group, rank) has committed ``step`` or later after 5 steps with every group in.

    Returns its full-quorum commits so far. (A group that joins late heals straight to the others' step.)
    """
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        mine = [e for e in _read(log) if e["group"] == group and e["rank"] == rank and e["committed"] and e["participants"] == groups]
        if len(mine) >= 5 and mine[-1]["step"] >= step:
            return mine
        time.sleep(0.005)
    raise TimeoutError(f"torchft workers did not reach step {step} within {timeout_s:.0f} s (see {log})")


def _read(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def torchft_result(case: Case, entries: list[dict], t_kill: float, t_restart: float, global_batch: int) -> Result:
    """The figures of one torchft run from its workers' commit log (stage 0 of each group speaks for the group)."""
    leads = sorted((e for e in entries if e["rank"] == 0 and e["committed"]), key=lambda e: e["t"])
    vg = case.victim[0]
    before = [e for e in leads if e["t"] < t_kill and e["step"] >= 3 and e["participants"] == case.groups]
    by_step: dict[int, float] = {}
    for e in before:
        by_step[e["step"]] = max(by_step.get(e["step"], 0.0), e["t"])
    steps = sorted(by_step)
    interval = statistics.median(by_step[b] - by_step[a] for a, b in zip(steps, steps[1:]))
    failure_free = global_batch / interval
    survivors = [g for g in range(case.groups) if g != vg]
    after = [e for e in leads if e["t"] > t_kill]
    firsts = [min(e["t"] for e in after if e["group"] == g and e["t_start"] > t_kill) - t_kill for g in survivors]
    healed = [e for e in after if e["group"] == vg and e["incarnation"] > 0]
    t_back = min(e["t"] for e in healed) if healed else None
    gap = [e for e in after if e["group"] != vg and (t_back is None or e["t"] < t_back) and e["t"] > t_kill + max(firsts)]
    batch_after = sum(e["samples"] for e in gap if e["step"] == gap[0]["step"]) if gap else 0
    rate_after = _rate(gap) if len(gap) > len(survivors) else 0.0
    window = sum(e["samples"] for e in after if e["t"] <= t_kill + case.window_s)
    return Result(
        "torchft", failure_free, min(firsts), max(firsts), batch_after, rate_after,
        None if t_back is None else t_back - t_restart, None if t_back is None else t_back - t_kill,
        window / (failure_free * case.window_s),
        f"{len(after)} group-steps committed after the kill; the restarted group first committed "
        + ("never" if t_back is None else f"{t_back - t_restart:.2f} s after its restart"),
    )


def _rate(entries: list[dict]) -> float:
    """Samples/s over committed group-steps, from the first commit to the last."""
    ts = sorted(e["t"] for e in entries)
    first = min(entries, key=lambda e: e["t"])
    return (sum(e["samples"] for e in entries) - first["samples"]) / (ts[-1] - ts[0]) if ts[-1] > ts[0] else 0.0


# --- the Chameleon side ------------------------------------------------------------------------------

def run_chameleon(case: Case, work: Path, steps: int) -> Path:
    """``python -m chameleon.train`` on the case's layout with the victim SIGKILLed mid-step; its run dir."""
    run_dir = work / f"chameleon_{case.name}"
    layout = ["parallel=dp"] if case.stages == 1 else [f"parallel.dp={case.groups}", f"parallel.pp={case.stages}"]
    rank = case.victim[0] * case.stages + case.victim[1]
    cmd = [sys.executable, "-m", "chameleon.train", f"launcher.nproc_per_node={case.groups * case.stages}", *layout,
           "failure=kill", f"failure.rank={rank}", f"failure.step={case.kill_step}", "failure.phase=any",
           f"failure.seed={SEED}", "ckpt=none", "output.progress=false", "output.save_params=false",
           f"train.steps={steps}", "train.eval_interval=0", f"hydra.run.dir={run_dir}"]  # torchft validates nothing
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"chameleon.train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return run_dir


def chameleon_result(case: Case, run_dir: Path, global_batch: int) -> Result:
    """The figures of one Chameleon run from its events.jsonl and metrics.jsonl."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    fault = next(e for e in events if e["event"] == "fault")
    recovered = next(e for e in events if e["event"] == "recovered")
    t_kill = fault["t_fault"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    before = [m for m in metrics if m["time"] < t_kill and m["step"] >= 3]
    failure_free = global_batch / statistics.median(b["time"] - a["time"] for a, b in zip(before, before[1:]))
    after = [m for m in metrics if m["time"] > t_kill]
    first = after[0]["time"] - t_kill
    steady = [m for m in after if m["time"] > t_kill + first + 1.0]
    rate_after = global_batch * (len(steady) - 1) / (steady[-1]["time"] - steady[0]["time"]) if len(steady) > 1 else 0.0
    window = sum(global_batch for m in after if m["time"] <= t_kill + case.window_s)
    covered = min(case.window_s, after[-1]["time"] - t_kill)
    return Result(
        "chameleon", failure_free, first, first, global_batch, rate_after, None, None,
        window / (failure_free * covered),
        f"chose {recovered['chosen']}: detect {recovered['detect_s']:.3f} s, decide {recovered['decide_s']:.3f} s, "
        f"restore {recovered['restore_s']:.3f} s, redo {recovered['redo_s']:.3f} s (total_s {recovered['total_s']:.3f} s)",
    )


# --- the run -----------------------------------------------------------------------------------------

def _measure(system: str, case: Case, cfg: dict, work: Path, timeout_s: float, batch: int) -> Result:
    work.mkdir(parents=True, exist_ok=True)
    if system == "chameleon":
        return chameleon_result(case, run_chameleon(case, work, steps=case.kill_step + int(case.window_s * 16) + 10), batch)
    entries, t_kill, t_restart = run_torchft(case, cfg, work, timeout_s)
    return torchft_result(case, entries, t_kill, t_restart, batch)


def median_result(results: list[Result]) -> Result:
    """Each figure's median over repeated runs of one system (details of every run kept)."""
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    fields = ("failure_free", "first_commit_s", "all_commit_s", "batch_after", "rate_after", "heal_s", "back_s", "window_share")
    out = {f: med([getattr(r, f) for r in results]) for f in fields}
    detail = "; ".join(f"run {i + 1}: {r.detail}" for i, r in enumerate(results))
    return Result(results[0].system, detail=detail, **out)


def training_config() -> dict:
    """The composed default config's model and train sections (what ``chameleon.train`` trains)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from chameleon.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config")
    model = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "name"}
    return {"model": model, "train": OmegaConf.to_container(cfg.train)}


def table(case: Case, results: list[Result]) -> str:
    head = ("| system | failure-free samples/s | kill → first survivor commit | kill → every survivor committed | "
            "samples/step until the worker is back | samples/s then | restarted worker: restart → commit | kill → back | "
            f"samples in {case.window_s:g} s after the kill ÷ failure-free |")
    rows = [head, "|" + "---|" * 9]
    for r in results:
        heal = "— (no re-admission)" if r.system == "chameleon" else ("never" if r.heal_s is None else f"{r.heal_s:.2f} s")
        back = "—" if r.back_s is None else f"{r.back_s:.2f} s"
        rows.append(f"| {r.system} | {r.failure_free:.1f} | {r.first_commit_s:.3f} s | {r.all_commit_s:.3f} s | "
                    f"{r.batch_after:g} | {r.rate_after:.1f} | {heal} | {back} | {r.window_share:.3f} |")
    return "\n".join(rows + [""] + [f"- {r.system}: {r.detail}" for r in results])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write torchft.md here (docs/ for the record)")
    parser.add_argument("--quick", action="store_true", help="data parallel only, a short window")
    parser.add_argument("--torchft-timeout", type=float, default=2.0, help="torchft's collective, join and heartbeat timeouts (s)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per system and case, alternating the order; medians reported")
    args = parser.parse_args()
    try:
        import torchft  # noqa: F401
    except ImportError:
        sys.exit("bench_torchft needs torchft: pip install -e '.[peers]' (torchft==0.2.0)")
    os.environ["OMP_NUM_THREADS"] = "1"
    load_start = os.getloadavg()
    start = time.perf_counter()
    cfg = training_config()
    batch = cfg["train"]["global_batch"]
    if args.quick:
        cases = [Case("dp", 2, 1, 6, 3.0, victim=(1, 0))]
    else:
        cases = [Case("dp", 4, 1, 12, 8.0, victim=(1, 0)), Case("pp", 2, 2, 12, 8.0, victim=(0, 1))]
    repeats = args.repeats
    sections = []
    with tempfile.TemporaryDirectory(prefix="bench_torchft_") as tmp:
        work = Path(tmp)
        for case in cases:
            runs: dict[str, list[Result]] = {"chameleon": [], "torchft": []}
            for i in range(repeats):  # alternate the order (A B, B A, ...) so drifting load hits both alike
                for system in ("chameleon", "torchft")[:: 1 if i % 2 == 0 else -1]:
                    runs[system].append(_measure(system, case, cfg, work / f"{case.name}{i}", args.torchft_timeout, batch))
            sections.append((case, [median_result(rs) for rs in runs.values()]))
    command = " ".join(["python", "benchmarks/bench_torchft.py", *sys.argv[1:]])
    text = REPORT.format(
        command=command, commit=commit(), wall=time.perf_counter() - start, timeout=args.torchft_timeout, repeats=repeats,
        env=f"Python {platform.python_version()}, torch {torch.__version__}, torchft 0.2.0, {os.cpu_count()} CPU cores",
        load_start=" ".join(f"{x:.1f}" for x in load_start), load_end=" ".join(f"{x:.1f}" for x in os.getloadavg()),
        model="dim {dim}, {n_layers} layers, {n_heads} heads ({n_kv_heads} for keys/values), vocab {vocab_size}".format(**cfg["model"]),
        train="{global_batch} sequences × {seq_len} tokens per step in micro-batches of {micro_batch}".format(**cfg["train"]),
        sections="\n\n".join(f"### {TITLES[c.name].format(step=c.kill_step, workers=c.groups * c.stages)}\n\n{table(c, rs)}" for c, rs in sections),
    )
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "torchft.md").write_text(text)


TITLES = {
    "dp": "Data parallel: {workers} workers, worker 1 killed at a random moment of step {step}",
    "pp": "Pipelines: 2 pipelines × 2 stages, stage 1 of pipeline 0 killed at a random moment of step {step}",
}

REPORT = """# Chameleon next to torchft, measured

Generated by `{command}` at commit `{commit}` in {wall:.0f} s ({env}; load average {load_start} at the start and
{load_end} at the end: the host is shared, and both systems ran in this one run, one after the
other ({repeats} run(s) per system and case, alternating the order, each figure the median), so
their ratios are fair while their absolute times carry the load). Both train the same
tiny Llama ({model}), the same sample stream ({train}), CPU/gloo, one thread per worker.

torchft runs as documented: a Lighthouse (`min_replicas=1`, `quorum_tick_ms=100`), one
`torchft.Manager` per worker with `ProcessGroupGloo`, `torchft.Optimizer`, state healed over
its HTTP transport, each replica group its own store as under torchrun. Its collective timeout and
the Lighthouse's join and heartbeat timeouts are {timeout:g} s, Chameleon's fault-detection budget
(`ft.heartbeat_timeout_s`); torchft's defaults are 60 s. The killed group is restarted at once, as
torchelastic would; Chameleon's runtime does not re-admit a replacement worker, it recovers on the
survivors.

{sections}

How to read it: torchft's survivors drop the killed group's samples until it heals, so its
samples per step fall by a group's share, and a survivor blocked in a gloo collective (or the
Lighthouse waiting for it) holds the next quorum for the timeout. With pipelines the whole replica
group (both stages) leaves, so half the workers idle while it restarts: torchft can neither
reroute the lost stage's micro-batches nor re-plan the survivors into a new pipeline. Chameleon
keeps the global batch on the survivors. The last column compares what each system trained in the
window after the kill with what it trains in as long without a fault; it exceeds 1 when the
survivors' plan runs faster than the failure-free one (on 2 shared cores fewer processes can be
faster). With torchft's default timeouts (60 s) its survivors would wait up to a minute; the
simulator's torchft model charges that default (`sim.torchft.timeout_s`), because on a 7B model's
10-s steps a 2-s timeout would fire on healthy steps.
"""


if __name__ == "__main__":
    main()
