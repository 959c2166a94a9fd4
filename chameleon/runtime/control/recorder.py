"""The run recorder: the one writer of a run's events, metrics, lines for the user and summary.

The controller's protocol core (:mod:`chameleon.runtime.control.core`) says what happened
as effects, facts only; the recorder alone turns them into text: into ``events.jsonl`` (one line per fault,
decision, recovery, growth, checkpoint, validation loss…), ``metrics.jsonl`` (one line per
committed step, with ``val_loss`` on the steps it was taken before), ``errors.log`` (a worker's traceback), the progress bar and the lines on
stderr (the core's notices in words: :func:`text_of`), and at the end ``summary.json``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from chameleon.config import Config
from chameleon.data.stream import sample_ids_digest
from chameleon.layout.plan import Plan
from chameleon.report.breakdown import Span, ettr, split_wall
from chameleon.report.outputs import JsonLines, write_json
from chameleon.report.progress import progress_bar
from chameleon.runtime.control.events import Committed, Record, Validated
from chameleon.runtime.control.notices import (
    CheckpointDamaged,
    ConnectionRefused,
    Disagreed,
    Grew,
    GrowingBack,
    GrowthDeclined,
    NotFinite,
    NotFiniteAgain,
    Notice,
    Preempting,
    Recovered,
    RecoveryDecided,
    ReplayedFinite,
    Reshaping,
    SlowDevices,
    Tolerating,
)
from chameleon.runtime.control.timelines import Recovery
from chameleon.runtime.protocol.errors import TrainingError


class Recorder:
    """Writes one run's outputs into ``run_dir`` (see the module doc)."""

    def __init__(self, config: Config, run_dir: Path, *, first_step: int):
        self.config, self.run_dir, self.first_step = config, run_dir, first_step
        self.metrics = JsonLines(run_dir / "metrics.jsonl")
        self.events = JsonLines(run_dir / "events.jsonl")
        self.bar = progress_bar(total=config.train.steps, initial=first_step, desc="train", unit="step",
                                wanted=config.output.progress, leave=False)
        self.losses: dict[int, float] = {}
        self.step_times: dict[int, float] = {}
        self.samples: dict[int, tuple[int, int]] = {}
        self.val_losses: dict[int, float] = {}
        self.commits: list[Committed] = []  # every commit in order, a step committed again after a reload too
        self.generation = 0

    def write(self, effect: object) -> None:
        """Record one of the core's effects (:class:`Record`, :class:`Committed`, :class:`Validated`, a :class:`Notice`)."""
        match effect:
            case Record(event=event):
                if "traceback" in event:
                    event = dict(event)
                    with (self.run_dir / "errors.log").open("a", encoding="utf-8") as f:
                        f.write(f"worker {event['device']} in {event['where']['where']}:\n{event.pop('traceback')}\n")
                self.events.write(event)
            case Committed():
                self._committed(effect)
            case Validated(step=step, loss=loss):
                self.val_losses[step] = loss
                self.events.write({"event": "validated", "step": step, "val_loss": loss,
                                   "generation": effect.generation, "time": effect.time})
                self.generation = effect.generation
                self._postfix()
                if step == self.config.train.steps:
                    self.say(f"chameleon: validation loss after step {step}: {loss:.4f}")
            case Notice():
                self.say(text_of(effect))
            case _:
                raise TypeError(f"the recorder does not write {effect!r}")

    def say(self, text: str) -> None:
        tqdm.write(text, file=sys.stderr)

    def _committed(self, c: Committed) -> None:
        batch, seq_len = self.config.train.global_batch, self.config.train.seq_len
        self.losses[c.step], self.step_times[c.step], self.samples[c.step] = c.loss, c.step_time_s, c.samples
        self.commits.append(c)
        self.metrics.write({
            "step": c.step, "loss": c.loss, "samples_per_s": batch / c.step_time_s,
            "tokens_per_s": batch * seq_len / c.step_time_s, "step_time_s": c.step_time_s, "compute_s": c.compute_s,
            "commit_s": c.commit_s, "generation": c.generation, "time": c.time, "lr": c.lr, "grad_norm": c.grad_norm,
            **({"val_loss": c.val_loss} if c.val_loss is not None else {}),
        })
        self.bar.n, self.generation = c.step + 1, c.generation
        self._postfix()

    def _postfix(self) -> None:
        """The progress bar's figures: the last loss, the last validation loss, the generation."""
        shown = {"loss": f"{self.losses[max(self.losses)]:.4f}"} if self.losses else {}
        if self.val_losses:
            shown["val"] = f"{self.val_losses[max(self.val_losses)]:.4f}"
        self.bar.set_postfix(shown | {"gen": self.generation})

    def best_step_s(self) -> float:
        """The best full plan's step time: the median steady step of the first plan (its first two steps and
        those after a validation left out), else of any plan that ran that long, else of every step."""
        steady: dict[int, list[float]] = {}
        starts: dict[int, int] = {}
        for c in self.commits:
            first = starts.setdefault(c.generation, c.step)
            if c.step >= first + 2 and c.val_loss is None:
                steady.setdefault(c.generation, []).append(c.step_time_s)
        medians = [statistics.median(ts) for ts in steady.values() if len(ts) >= 3]
        first_plan = steady.get(self.commits[0].generation, [])
        if len(first_plan) >= 3:
            return statistics.median(first_plan)
        return min(medians) if medians else statistics.median(c.step_time_s for c in self.commits)

    def time_breakdown(self, *, t0: float, t_train: float | None, t_end: float, spans: list[Span]) -> dict[str, float]:
        """The run's wall time in :data:`~chameleon.report.breakdown.TIME_PARTS` (:func:`split_wall`)."""
        return split_wall(t0=t0, t_train=t_train, t_end=t_end, commits=[(c.step, c.time) for c in self.commits],
                          spans=spans, step_s=self.best_step_s())

    def summary(self, *, recoveries: list[dict], growths: list[dict], reshapes: list[dict], plan: str, generations: int,
                world_size: int, nnodes: int, wall_s: float, startup_s: float | None, time_breakdown: dict[str, float],
                store_ops: dict[int, int], peak_rss: dict[int, int], allocator_peaks: dict[int, tuple[int, int]],
                memory_estimate: dict[int, float]) -> Path:
        """Write ``summary.json`` (every step must have committed); return its path.

        Raises:
            TrainingError: some step never committed.
        """
        batch, steps = self.config.train.global_batch, sorted(self.losses)
        if steps != list(range(self.first_step, self.config.train.steps)):
            raise TrainingError(f"only {len(steps)} of train.steps={self.config.train.steps} steps were committed")
        first_fault = recoveries[0]["step"] if recoveries else steps[-1] + 1
        last_fault = recoveries[-1]["step"] if recoveries else 0
        before = [self.step_times[s] for s in steps[1:] if s < first_fault]
        after = [self.step_times[s] for s in steps if s > last_fault] if recoveries else []
        steady = [self.step_times[s] for s in steps[1:]] or [self.step_times[steps[0]]]
        rate = lambda ts: batch * len(ts) / sum(ts) if ts else None  # noqa: E731
        return write_json(self.run_dir / "summary.json", {
            "first_step": self.first_step,
            "steps_completed": len(steps),
            "final_loss": self.losses[steps[-1]],
            "losses": [self.losses[s] for s in steps],
            "val_losses": [[s, self.val_losses[s]] for s in sorted(self.val_losses)],
            "final_val_loss": self.val_losses.get(self.config.train.steps),
            "samples_per_s": rate(steady),
            "tokens_per_s": rate(steady) * self.config.train.seq_len,
            "mean_step_time_s": sum(steady) / len(steady),
            "samples_per_s_before_fault": rate(before),
            "samples_per_s_after_recovery": rate(after),
            "world_size": world_size,
            "nnodes": nnodes,
            "plan": plan,
            "generations": generations,
            "recoveries": recoveries,
            "growths": growths,
            "reshapes": reshapes,  # decisions on slow devices: tolerate, rebalance, replan or evict
            "sample_ids_digest": sample_ids_digest([list(range(*self.samples[s])) for s in steps]),
            "wall_s": wall_s,
            "startup_s": startup_s,
            "time_breakdown_s": time_breakdown,  # wall_s, every second in one part (chameleon.report.breakdown)
            "ettr": ettr(time_breakdown),  # effective training time: productive ÷ wall
            "store_ops": {str(d): n for d, n in sorted(store_ops.items())},  # each worker's, all process-group rendezvous
            "peak_rss_mb": {str(d): n / 2**20 for d, n in sorted(peak_rss.items())},  # each worker's resident peak
            # on accelerators, each allocator's peaks (max_memory_allocated, max_memory_reserved); none on CPUs
            "device_peak_mb": {str(d): {"allocated": a / 2**20, "reserved": r / 2**20}
                               for d, (a, r) in sorted(allocator_peaks.items())},
            # the memory model's (Eq. 14) for each device of the final plan: state and activations, no runtime
            "memory_estimate_mb": {str(d): n / 2**20 for d, n in sorted(memory_estimate.items())},
        })

    def close(self) -> None:
        self.bar.close()
        self.metrics.close()
        self.events.close()


def text_of(notice: Notice) -> str:
    """The lines the user reads for ``notice``."""
    match notice:
        case ConnectionRefused(why=why):
            return f"chameleon: refused a connection: {why}"
        case Disagreed(step=step, outvoted=outvoted):
            return (f"chameleon: replicas disagree before step {step}: devices {list(outvoted)} are outvoted by their "
                    "replicas' digests (with no majority, every holder is): not committed; they are lost devices")
        case NotFinite(step=step, samples=(lo, hi)):
            return (f"chameleon: step {step} is not finite ({_not_finite(notice)}): not committed; replaying it "
                    f"(samples [{lo}, {hi}))")
        case NotFiniteAgain(step=step, corrupt=corrupt):
            return (f"chameleon: step {step} is not finite again on its replay, on the same devices {list(corrupt)} "
                    f"alone ({_not_finite(notice)}): their state is corrupt; they are evicted")
        case ReplayedFinite(step=step, suspects=suspects, evicted=evicted):
            who = (f"devices {list(suspects)}, whose own gradients were not finite, "
                   + ("are evicted" if evicted else "stay (ft.on_corrupt=replay)") if suspects
                   else "no device's own gradients were not finite")
            return f"chameleon: step {step} replayed finite: the fault was transient; {who}"
        case Preempting(step=step):
            return f"chameleon: SIGTERM: saving a checkpoint after step {step}, then stopping"
        case CheckpointDamaged(device=device, why=why, fallback=fallback):
            older = (f"the checkpoint of step {fallback} is the newest whole one" if fallback is not None
                     else "no older checkpoint of this run is left")
            return f"chameleon: device {device} found the checkpoint it restores damaged: {why}; {older}"
        case RecoveryDecided():
            return _decided(notice)
        case Recovered(recovery=rec):
            return _recovered(rec)
        case GrowthDeclined(devices=devices, decision=decision):
            return f"chameleon: devices {list(devices)} are back; growing does not pay now\n{decision.table()}"
        case GrowingBack(devices=devices, decision=decision, plan=plan, was=was):
            return f"chameleon: devices {list(devices)} are back: growing\n{decision.table()}\n{_new_plan(plan, was)}"
        case Grew(growth=g):
            return (f"chameleon: grew onto devices {g.devices} in {g.t_first_commit - g.t_back:.3f} s after they came "
                    f"back (decide {g.t_decided - g.t_back:.3f}, wait for a step boundary {g.t_switch - g.t_decided:.3f}, "
                    f"restore {g.t_started - g.t_switch:.3f}, first step {g.t_first_commit - g.t_started:.3f})")
        case SlowDevices(step=step, slow=slow):
            return (f"chameleon: after step {step}, slow devices: "
                    + (", ".join(f"{d} (×{f:.2f} its peers' time)" for d, f in sorted(slow.items()))
                       or "none (all back to speed)"))
        case Tolerating(decision=decision):
            return f"chameleon: {decision.note}: tolerating them pays best\n{decision.table()}"
        case Reshaping(decision=decision, plan=plan, was=was):
            return f"chameleon: {decision.note}: {decision.choice}\n{decision.table()}\n{_new_plan(plan, was)}"
        case _:
            raise TypeError(f"no text for {notice!r}")


def _not_finite(n: NotFinite | NotFiniteAgain) -> str:
    norm = n.grad_norm if n.grad_norm is None else f"{n.grad_norm:.6g}"
    return (f"loss {n.loss:.6g}, gradient norm {norm}; "
            + (f"devices {list(n.corrupt)} not finite before the sync" if n.corrupt
               else "every device finite before the sync"))


def _new_plan(plan: Plan, was: Plan) -> str:
    return f"new plan:\n{plan.summary(was)}"


def _decided(n: RecoveryDecided) -> str:
    victims = "; ".join(f"device {d}: {p['where']}" for d, p in n.where.items() if p)
    reload = (f"reloading the checkpoint of step {n.reload_step} ({n.lost_s:.1f} s of progress lost)\n"
              if n.reload_step is not None else "")
    what = f"devices {list(n.devices)} lost" if n.devices else "deciding again"
    return (f"\nchameleon: {what} at step {n.step} ({n.cause})" + (f"\n  where: {victims}" if victims else "")
            + f"\n{n.decision.table()}\n{reload}{_new_plan(n.plan, n.was)}")


def _recovered(rec: Recovery) -> str:
    if rec.steady_step_s is not None:
        pace = f"steady step {rec.steady_step_s:.3f} s vs {rec.estimated_step_s:.3f} s estimated"
    else:
        pace = ("the last validation redone" if rec.first_step_s is None
                else f"no steady step followed; estimated {rec.estimated_step_s:.3f} s")
    return (f"chameleon: recovered from the loss of {rec.failed} by {rec.decision.choice} in "
            f"{rec.t_first_commit - rec.t_fault:.3f} s (detect {rec.t_detect - rec.t_fault:.3f}, decide "
            f"{rec.t_decided - rec.t_detect:.3f}, restore {rec.t_started - rec.t_decided:.3f}, redo "
            f"{rec.t_first_commit - rec.t_started:.3f}); {pace}")
