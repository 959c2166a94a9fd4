"""The run recorder: the one writer of a run's events, metrics, lines for the user and summary.

The controller's protocol core (:mod:`chameleon.runtime.control.core`) says what happened
as effects; the recorder turns them into ``events.jsonl`` (one line per fault,
decision, recovery, growth, checkpoint, validation loss…), ``metrics.jsonl`` (one line per
committed step, with ``val_loss`` on the steps it was taken before), ``errors.log`` (a worker's traceback), the progress bar and the lines on
stderr, and at the end ``summary.json``.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from chameleon.config import Config
from chameleon.data.stream import sample_ids_digest
from chameleon.report.breakdown import Span, ettr, split_wall
from chameleon.report.outputs import JsonLines, write_json
from chameleon.report.progress import progress_bar
from chameleon.runtime.control.core import Committed, Record, Say, Validated
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
        """Record one of the core's effects (:class:`Record`, :class:`Committed` or :class:`Say`)."""
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
            case Say(text=text):
                self.say(text)
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
                store_ops: dict[int, int], peak_rss: dict[int, int], memory_estimate: dict[int, float]) -> Path:
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
            # the memory model's (Eq. 14) for each device of the final plan: state and activations, no runtime
            "memory_estimate_mb": {str(d): n / 2**20 for d, n in sorted(memory_estimate.items())},
        })

    def close(self) -> None:
        self.bar.close()
        self.metrics.close()
        self.events.close()
