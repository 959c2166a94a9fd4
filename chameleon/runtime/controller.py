"""The controller: hosts the c10d store, spawns and watches the workers, commits steps, recovers.

It holds no model state. Workers report each synced step over a pipe (their
heartbeats travel the same way); once every worker of the generation synced step
``k`` the controller checks that ``k`` trained exactly its global samples, each
once, and *commits* it (a store key), after which workers apply the optimizer step.

On a fault — a worker that exits, or one whose heartbeats stop (fenced with
SIGKILL) — the controller flags the generation broken, asks the selector which
recovery trains fastest until the next fault (Eq. 8 over reroute, dynamic,
redundant and checkpoint), derives the new plan's layout and the manifest that
realises it from the surviving replicas, and publishes the next generation. Until
every survivor has established that generation, the previous layout stays
resident, so a fault during recovery simply triggers another decision from it.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import Future, ThreadPoolExecutor
import os
import pickle
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from chameleon.config import model_config, world_size
from chameleon.data.stream import sample_ids_digest
from chameleon.decision.config import ClusterConfig, PolicyConfig
from chameleon.decision.estimator import estimate_step
from chameleon.decision.planner import Planner, precompute_single_faults
from chameleon.decision.profiler import load_profile
from chameleon.decision.selector import decide
from chameleon.layout.plan import Plan
from chameleon.layout.relayout import relayout
from chameleon.layout.spec import layout_of
from chameleon.model.llama import param_shapes, stage_param_names
from chameleon.optim import learning_rate, schedule_of
from chameleon.report.outputs import JsonLines, write_json
from chameleon.runtime.checkpoint import checkpoint_root, commit_checkpoint, latest_checkpoint, writers
from chameleon.runtime.comm import fault_key
from chameleon.runtime.faults import WORKER_PHASES, FaultSpec, planned_faults
from chameleon.runtime.worker import (
    LATEST_KEY, GenerationSpec, WorkerSpec, commit_key, spec_key, start_key, worker_main,
)

JOIN_TIMEOUT_S = 30.0
TICK_S = 0.01


class TrainingError(RuntimeError):
    """A failure the run cannot survive; the message says which and why."""


class JobRestart(TrainingError):
    """A fault under ``ft.on_fault=exit``: every worker is stopped for an outer relaunch."""


@dataclass
class StepBook:
    """Reports of one step from the devices of the current generation."""

    loss: float = 0.0
    sample_ids: list[int] = field(default_factory=list)
    step_time_s: float = 0.0
    reported: set[int] = field(default_factory=set)
    grad_norm: float | None = None


@dataclass
class Recovery:
    """Timeline of one fault, from the fault to the first step committed after it."""

    failed: list[int]
    cause: str
    step: int
    t_fault: float
    t_detect: float
    t_decided: float = 0.0
    t_started: float = 0.0
    t_first_commit: float = 0.0
    decision: dict = field(default_factory=dict)
    manifest_bytes: int = 0
    manifest_rounds: int = 0
    estimated_step_s: float = 0.0
    first_step_s: float = 0.0

    def record(self) -> dict:
        return {
            "failed_ranks": self.failed,
            "cause": self.cause,
            "step": self.step,
            "chosen": self.decision.get("choice"),
            "detect_s": self.t_detect - self.t_fault,
            "decide_s": self.t_decided - self.t_detect,
            "restore_s": self.t_started - self.t_decided,
            "redo_s": self.t_first_commit - self.t_started,
            "total_s": self.t_first_commit - self.t_fault,
            "manifest_bytes": self.manifest_bytes,
            "manifest_rounds": self.manifest_rounds,
            "first_step_s": self.first_step_s,
            "estimated_step_s": self.estimated_step_s,
            "d_s": self.decision.get("d_s"),
        }


class Controller:
    """Runs one training job: workers, commits, fault detection and recovery. See the module doc."""

    def __init__(self, config: dict, *, plan: Plan, run_dir: Path):
        self.config, self.run_dir = config, run_dir
        self.launcher, self.train, self.ft = config["launcher"], config["train"], config["ft"]
        self.model = model_config(config)
        self.shapes = param_shapes(self.model)
        self.stage_names = partial(stage_param_names, self.model)
        self.world = world_size(self.launcher)
        self.faults = planned_faults(config["failure"], world=self.world)
        self.rng = random.Random(config["failure"]["seed"])
        self.policy = PolicyConfig(**config["policy"])
        self.profile = load_profile(
            self.model, ClusterConfig(**config["cluster"]), micro_batch=self.train["micro_batch"],
            seq_len=self.train["seq_len"], tp=config["parallel"]["tp"],
        )
        self.planner = Planner(self.profile, dp_degrees=tuple(self.policy.dp_degrees), pp_lengths=tuple(self.policy.pp_lengths))
        existing = latest_checkpoint(checkpoint_root(config["ckpt"], run_dir))
        resume = config["ckpt"]["resume"]
        if existing is not None and resume is None:
            raise TrainingError(
                f"{existing.path.parent} already holds checkpoints of another run: pick a new hydra.run.dir or "
                f"ckpt.dir, or continue that run with ckpt.resume={existing.path.parent}"
            )
        self.store = dist.TCPStore(
            self.launcher["master_addr"], self.launcher["master_port"], is_master=True,
            timeout=timedelta(seconds=self.launcher["timeout_s"]), wait_for_workers=False,
        )
        self.generation = 0
        start = latest_checkpoint(Path(resume)) if resume else None
        if resume and start is None:
            raise TrainingError(f"ckpt.resume={resume} holds no complete checkpoint")
        self.first_step = start.committed_steps if start else 0
        self.spec = GenerationSpec(0, plan, tuple(sorted(plan.devices)), self.first_step, checkpoint=resume)
        self.resident = plan  # the plan whose layout the survivors' state is in
        self.started = False
        self.ready: set[int] = set()
        self.books: dict[int, StepBook] = {}
        self.losses: dict[int, float] = {}
        self.step_times: dict[int, float] = {}
        self.step_ids: dict[int, list[int]] = {}
        self.commit_times: dict[int, float] = {}
        self.committed = self.first_step - 1
        self.recoveries: list[Recovery] = []
        self.pending: Recovery | None = None
        self.fault_times: list[float] = []
        self.last_seen: dict[int, float] = {}
        self.done: set[int] = set()
        self.timers: list[tuple[float, str, FaultSpec]] = []
        self.kill_times: dict[int, float] = {}
        self.ckpt_saves: dict[tuple[int, int], set[int]] = {}
        self.checkpoint: tuple[int, float] | None = None  # (committed steps it holds, when that step committed)
        self.t0 = time.time()
        self.t_train: float | None = None
        self.last_commit = 0.0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chameleon-precompute")
        self.precomputed: tuple[Plan, Future] | None = None

    # ----- lifecycle -------------------------------------------------------------------

    def run(self) -> Path:
        """Train to the last step through faults; write the outputs; return ``summary.json``'s path."""
        # Workers fork from a server that has already imported torch and Chameleon:
        # starting one costs milliseconds instead of seconds of imports.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "chameleon.runtime.worker"])
        self.procs, self.conns = {}, {}
        for device in range(self.world):
            recv_end, send_end = ctx.Pipe(duplex=False)
            spec = WorkerSpec(device, self.launcher["master_addr"], self.store.port, self.config, str(self.run_dir))
            proc = ctx.Process(target=worker_main, args=(spec, send_end), name=f"chameleon-worker-{device}", daemon=True)
            proc.start()
            send_end.close()
            self.procs[device], self.conns[recv_end] = proc, device
        self.alive = set(range(self.world))
        self.metrics = JsonLines(self.run_dir / "metrics.jsonl")
        self.events = JsonLines(self.run_dir / "events.jsonl")
        self.bar = tqdm(total=self.train["steps"], desc="train", unit="step", disable=not self.config["output"]["progress"], leave=False)
        self.events.write({"event": "start", "workers": {d: p.pid for d, p in self.procs.items()}, "plan": self.spec.plan.describe()})
        self._publish(self.spec)
        try:
            self._loop()
        except BaseException:
            self._reap(grace_s=0.0)  # survivors wait for a generation that will never come
            raise
        finally:
            self.pool.shutdown(cancel_futures=True)
            self.bar.close()
            self.metrics.close()
            self.events.close()
        self._reap(grace_s=JOIN_TIMEOUT_S)
        if self.config["output"]["save_params"]:
            self._merge_params()
        return self._write_summary()

    def _loop(self) -> None:
        sentinels = {p.sentinel: d for d, p in self.procs.items()}
        while self.alive - self.done:
            for item in wait([*self.conns, *sentinels], timeout=TICK_S):
                if item in sentinels:
                    self._on_exit(sentinels.pop(item))
                    continue
                try:
                    msg = item.recv()
                except EOFError:
                    self.conns.pop(item)
                    continue
                self._on_message(msg)
            self._check_heartbeats()
            self._fire_timers()

    # ----- messages ---------------------------------------------------------------------

    def _on_message(self, msg: tuple) -> None:
        kind, device = msg[0], msg[1]
        self.last_seen[device] = time.time()
        if kind == "error":
            raise TrainingError(f"worker {device} failed:\n{msg[2]}")
        if kind == "dying":
            self.kill_times[device] = msg[2]
        elif kind == "done":
            self.done.add(device)
        elif kind == "ckpt_saved" and msg[2] == self.generation:
            self._on_checkpoint_saved(device, msg[3])
        elif kind == "ready" and msg[2] == self.generation:
            self.ready.add(device)
            if self.ready >= set(self.spec.devices) & self.alive:
                self._start_generation()
        elif kind == "synced" and msg[2] == self.generation:
            _, _, _, step, loss, ids, dt, grad_norm = msg
            book = self.books.setdefault(step, StepBook())
            book.grad_norm = grad_norm
            book.loss += loss
            book.sample_ids.extend(ids)
            book.step_time_s = max(book.step_time_s, dt)
            book.reported.add(device)
            if book.reported >= set(self.spec.plan.devices):
                self._commit(step, self.books.pop(step))

    def _on_checkpoint_saved(self, device: int, step: int) -> None:
        """Commit checkpoint ``step`` once every writer of the current layout saved its part."""
        saved = self.ckpt_saves.setdefault((self.generation, step), set())
        saved.add(device)
        expected = set(writers(layout_of(self.spec.plan, self.shapes, self.stage_names)))
        if saved >= expected:
            root = checkpoint_root(self.config["ckpt"], self.run_dir)
            commit_checkpoint(root, step, expected_devices=sorted(expected), shapes=self.shapes,
                              config=self.config, keep=self.config["ckpt"]["keep"])
            self.checkpoint = (step, self.commit_times[step - 1])
            self.events.write({"event": "checkpoint", "step": step, "path": str(root), "generation": self.generation})

    def _start_generation(self) -> None:
        self.store.set(start_key(self.generation), "1")
        self.started = True
        self.resident = self.spec.plan
        if self.policy.precompute:  # the next single fault becomes a lookup (the planner runs meanwhile)
            self.precomputed = (self.resident, self.pool.submit(precompute_single_faults, self.resident, self.planner))
        now = time.time()
        self.last_commit = now
        if self.t_train is None:
            self.t_train = now
        if self.pending is not None:
            self.pending.t_started = now
        self._arm_step_faults(self.spec.resume_step)

    def _commit(self, step: int, book: StepBook) -> None:
        """Check the step trained each of its global samples once; let workers apply it; log it."""
        batch = self.train["global_batch"]
        expected = list(range(step * batch, (step + 1) * batch))
        if sorted(book.sample_ids) != expected:
            raise TrainingError(
                f"step {step} trained samples {sorted(book.sample_ids)} instead of [{expected[0]}, {expected[-1] + 1}): "
                "samples were lost or duplicated"
            )
        self.store.set(commit_key(self.generation, step), "1")
        now = time.time()
        dt = now - self.last_commit  # the whole step: compute, sync, commit, the previous optimizer step
        self.last_commit = now
        self.committed = step
        self.losses[step], self.step_times[step], self.step_ids[step] = book.loss, dt, expected
        self.commit_times[step] = now
        self.metrics.write({
            "step": step, "loss": book.loss, "samples_per_s": batch / dt, "tokens_per_s": batch * self.train["seq_len"] / dt,
            "step_time_s": dt, "compute_s": book.step_time_s, "generation": self.generation, "time": now,
            "lr": learning_rate(step, **schedule_of(self.train)), "grad_norm": book.grad_norm,
        })
        self.bar.n = step + 1
        self.bar.set_postfix(loss=f"{book.loss:.4f}", gen=self.generation)
        if self.pending is not None:
            self._close_recovery(now, book.step_time_s)
        self._arm_step_faults(step + 1)

    def _close_recovery(self, now: float, step_s: float) -> None:
        rec, self.pending = self.pending, None
        rec.t_first_commit, rec.first_step_s = now, step_s
        self.recoveries.append(rec)
        self.events.write({"event": "recovered", "generation": self.generation, **rec.record()})
        print(
            f"chameleon: recovered from the loss of {rec.failed} by {rec.decision.get('choice')} in "
            f"{rec.t_first_commit - rec.t_fault:.3f} s (detect {rec.t_detect - rec.t_fault:.3f}, decide "
            f"{rec.t_decided - rec.t_detect:.3f}, restore {rec.t_started - rec.t_decided:.3f}, redo "
            f"{rec.t_first_commit - rec.t_started:.3f}); step {step_s:.3f} s vs {rec.estimated_step_s:.3f} s estimated",
            file=sys.stderr, flush=True,
        )

    # ----- faults -----------------------------------------------------------------------

    def _on_exit(self, device: int) -> None:
        proc = self.procs[device]
        proc.join()
        if device in self.done and proc.exitcode == 0:
            return
        cause = f"exit code {proc.exitcode}" + (" (SIGKILL)" if proc.exitcode == -signal.SIGKILL else "")
        for conn, owner in list(self.conns.items()):  # its last words may say when it died
            while owner == device and conn.poll():
                try:
                    self._on_message(conn.recv())
                except EOFError:
                    break
        self._on_fault({device}, cause, t_fault=self.kill_times.get(device, time.time()))

    def _check_heartbeats(self) -> None:
        if self.t_train is None:
            return
        now = time.time()
        for device in sorted(self.alive - self.done):
            if now - self.last_seen.get(device, now) > self.ft["heartbeat_timeout_s"]:
                os.kill(self.procs[device].pid, signal.SIGKILL)  # fence: its peers must not wait on it
                self.procs[device].join()
                t_fault = self.kill_times.get(device, self.last_seen[device])
                self._on_fault({device}, "missed heartbeats (hung; fenced with SIGKILL)", t_fault=t_fault)

    def _on_fault(self, devices: set[int], cause: str, *, t_fault: float) -> None:
        """Flag the generation broken, decide, and publish the next generation."""
        t_detect = time.time()
        devices &= self.alive
        if not devices:
            return
        self.alive -= devices
        self.store.set(fault_key(self.generation), "1")
        if self.ft["on_fault"] == "exit":
            self.events.write({"event": "fault", "failed_ranks": sorted(devices), "cause": cause, "t_fault": t_fault,
                               "step": self.committed + 1, "action": "exit for a relaunch"})
            raise JobRestart(f"devices {sorted(devices)} lost at step {self.committed + 1} ({cause}); ft.on_fault=exit: "
                             "relaunch with ckpt.resume=" + str(checkpoint_root(self.config["ckpt"], self.run_dir)))
        self.books.clear()
        self.fault_times.append(t_fault - self.t0)
        failed = set(self.resident.devices) - self.alive
        rec = self.pending or Recovery(sorted(devices), cause, self.committed + 1, t_fault, t_detect)
        if self.pending is not None:
            rec.failed = sorted(set(rec.failed) | devices)
            rec.cause += f"; then {cause} during recovery"
        self.pending = rec
        age = t_detect - self.checkpoint[1] if self.checkpoint else None
        ahead = None
        if self.precomputed is not None and self.precomputed[0] is self.resident and len(failed) == 1:
            ahead = self.precomputed[1].result().get(next(iter(failed)))  # shares the planner: never concurrently
        decision = decide(
            self.profile, self.resident, failed, policy=self.policy, planner=self.planner, precomputed=ahead,
            fault_times=self.fault_times, elapsed_s=t_detect - self.t0, checkpoint_age_s=age, in_process=True,
        )
        chosen = decision.chosen
        if chosen is None:
            raise TrainingError(f"no recovery is possible after losing devices {sorted(failed)}: {decision.note}")
        resume, manifest, ckpt = self.committed + 1, None, None
        if chosen.name == "checkpoint":
            resume, ckpt = self.checkpoint[0], str(checkpoint_root(self.config["ckpt"], self.run_dir))
        else:
            old_layout = layout_of(self.resident, self.shapes, self.stage_names)
            new_layout = layout_of(chosen.plan, self.shapes, self.stage_names)
            manifest = relayout(old_layout, new_layout, survivors=sorted(self.alive))
            rec.manifest_bytes, rec.manifest_rounds = manifest.wire_bytes, len(manifest.rounds)
        rec.t_decided = time.time()
        rec.decision = decision.to_dict()
        rec.estimated_step_s = estimate_step(self.profile, chosen.plan, reroute_slots=self.policy.reroute_slots).t_step
        self.events.write({
            "event": "fault", "generation": self.generation, "failed_ranks": sorted(devices), "cause": cause,
            "step": self.committed + 1, "t_fault": t_fault, "detect_s": t_detect - t_fault, "decide_s": rec.t_decided - t_detect,
            "decision": rec.decision, "manifest_bytes": rec.manifest_bytes, "manifest_rounds": rec.manifest_rounds,
        })
        reload = f"reloading the checkpoint of step {resume} ({age:.1f} s of progress lost)\n" if ckpt else ""
        print(f"\nchameleon: devices {sorted(devices)} lost at step {self.committed + 1} ({cause})\n"
              f"{decision.table()}\n{reload}new plan:\n{chosen.plan.describe()}", file=sys.stderr, flush=True)
        self.committed = resume - 1
        self.generation += 1
        self.started, self.ready = False, set()
        spec = GenerationSpec(self.generation, chosen.plan, tuple(sorted(self.alive)), resume, manifest, ckpt)
        self._publish(spec)

    def _publish(self, spec: GenerationSpec) -> None:
        self.spec = spec
        self.store.set(spec_key(spec.generation), pickle.dumps(spec))
        self.store.set(LATEST_KEY, str(spec.generation))

    # ----- controller-side injection ----------------------------------------------------

    def _arm_step_faults(self, step: int) -> None:
        """Arm the faults pinned to ``step`` that the controller fires from outside."""
        now = time.time()
        typical = sorted(self.step_times.values())[len(self.step_times) // 2] if self.step_times else 0.05
        for f in self.faults:
            if f.step == step and f.rank in self.alive and f.phase not in WORKER_PHASES:
                delay = 0.0 if f.kind == "hang" else self.rng.uniform(0.0, typical)
                self.timers.append((now + delay, f.kind, f))
        self.faults = [f for f in self.faults if not (f.step == step and f.phase not in WORKER_PHASES)]
        if self.t_train is not None:
            for f in [f for f in self.faults if f.at_s is not None]:
                self.timers.append((self.t_train + f.at_s, f.kind, f))
                self.faults.remove(f)

    def _fire_timers(self) -> None:
        now = time.time()
        for entry in [t for t in self.timers if t[0] <= now]:
            self.timers.remove(entry)
            _, kind, fault = entry
            if fault.rank not in self.alive:
                continue
            self.kill_times[fault.rank] = time.time()
            os.kill(self.procs[fault.rank].pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)

    # ----- shutdown and outputs ---------------------------------------------------------

    def _reap(self, *, grace_s: float) -> None:
        """Join every worker; kill the ones that do not exit within ``grace_s``. No process is left behind."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            if proc.is_alive():
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join()

    def _merge_params(self) -> None:
        """Assemble the parameter shards the workers saved into full tensors in ``final_params.pt``."""
        parts = sorted((self.run_dir / ".params").glob("device*.pt"))
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for name, (region, shard) in torch.load(part, weights_only=True).items():
                full = merged.setdefault(name, torch.empty(self.shapes[name]))
                full[tuple(slice(a, b) for a, b in region)] = shard
            part.unlink()
        if parts:
            (self.run_dir / ".params").rmdir()
            torch.save({n: merged[n] for n in self.shapes if n in merged}, self.run_dir / "final_params.pt")

    def _write_summary(self) -> Path:
        batch, steps = self.train["global_batch"], sorted(self.losses)
        if steps != list(range(self.first_step, self.train["steps"])):
            raise TrainingError(f"only {len(steps)} of train.steps={self.train['steps']} steps were committed")
        first_fault = self.recoveries[0].step if self.recoveries else steps[-1] + 1
        last_fault = self.recoveries[-1].step if self.recoveries else 0
        before = [self.step_times[s] for s in steps[1:] if s < first_fault]
        after = [self.step_times[s] for s in steps if s > last_fault] if self.recoveries else []
        steady = [self.step_times[s] for s in steps[1:]] or [self.step_times[steps[0]]]
        rate = lambda ts: batch * len(ts) / sum(ts) if ts else None  # noqa: E731
        return write_json(self.run_dir / "summary.json", {
            "first_step": self.first_step,
            "steps_completed": len(steps),
            "final_loss": self.losses[steps[-1]],
            "losses": [self.losses[s] for s in steps],
            "samples_per_s": rate(steady),
            "tokens_per_s": rate(steady) * self.train["seq_len"],
            "mean_step_time_s": sum(steady) / len(steady),
            "samples_per_s_before_fault": rate(before),
            "samples_per_s_after_recovery": rate(after),
            "world_size": self.world,
            "plan": self.resident.describe(),
            "generations": self.generation + 1,
            "recoveries": [r.record() for r in self.recoveries],
            "sample_ids_digest": sample_ids_digest([self.step_ids[s] for s in steps]),
            "wall_s": time.time() - self.t0,
            "startup_s": (self.t_train - self.t0) if self.t_train else None,
        })


def run_training(config: dict, *, plan: Plan, run_dir: Path) -> Path:
    """Train as ``config`` says through any injected faults; return ``summary.json``'s path."""
    return Controller(config, plan=plan, run_dir=run_dir).run()
