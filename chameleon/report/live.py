"""Live scalars of a training run — TensorBoard (``report.tensorboard=true``) and Weights & Biases
(``report.wandb=true``) — mirrored from its run dir.

The controller writes ``metrics.jsonl`` and ``events.jsonl`` as the run goes; a
thread of the launching process tails both and writes to each sink:
``train/loss``, ``train/samples_per_s``, ``train/tokens_per_s``, ``train/step_time_s``,
``train/lr`` and ``train/grad_norm`` per committed step, ``val/loss`` per validation
(at the step it was taken before; ``train.steps`` for the one after the last), and
per recovery ``recovery/total_s``, ``recovery/detect_s``, ``recovery/restore_s``,
``recovery/redo_s`` and ``recovery/count`` at the step it hit, with the policy
chosen as text. TensorBoard writes under ``<run dir>/tensorboard``; W&B under
``<run dir>/wandb``, offline unless ``WANDB_API_KEY`` is set (``wandb sync`` uploads it later).
"""

from __future__ import annotations

import json
import os
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Protocol

STEP_SCALARS = ("loss", "samples_per_s", "tokens_per_s", "step_time_s", "lr", "grad_norm")
RECOVERY_SCALARS = ("total_s", "detect_s", "restore_s", "redo_s")
POLL_S = 0.5


class Sink(Protocol):
    """Where scalars go: TensorBoard's ``SummaryWriter`` has exactly this shape."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int, walltime: float | None = None) -> None: ...

    def add_text(self, tag: str, text_string: str, global_step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class _Tail:
    """New whole lines of a growing file, from where the last read stopped."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [json.loads(line) for line in complete.decode().splitlines() if line.strip()]


class Mirror:
    """Writes the run dir's new metrics, validations and recoveries to ``sink`` on each :meth:`sync`."""

    def __init__(self, run_dir: Path, sink: Sink):
        self.sink = sink
        self.metrics = _Tail(Path(run_dir) / "metrics.jsonl")
        self.events = _Tail(Path(run_dir) / "events.jsonl")
        self.summary = Path(run_dir) / "summary.json"
        self.recoveries = 0

    def sync(self) -> None:
        """Write every record added since the previous call."""
        for m in self.metrics.records():
            for key in STEP_SCALARS:
                if m.get(key) is not None:
                    self.sink.add_scalar(f"train/{key}", m[key], global_step=m["step"], walltime=m["time"])
        for e in self.events.records():
            if e["event"] == "validated":
                self.sink.add_scalar("val/loss", e["val_loss"], global_step=e["step"], walltime=e["time"])
            elif e["event"] == "recovered":
                self.recoveries += 1
                for key in RECOVERY_SCALARS:
                    self.sink.add_scalar(f"recovery/{key}", e[key], global_step=e["step"])
                self.sink.add_scalar("recovery/count", self.recoveries, global_step=e["step"])
                self.sink.add_text("recovery/policy", f"ranks {e['failed_ranks']} lost ({e['cause']}): "
                                   f"{e['chosen']} in {e['total_s']:.3f} s", global_step=e["step"])
        self.sink.flush()

    def close(self) -> None:
        """The last records, and the run's effective-training-time ratio once ``summary.json`` is written."""
        self.sync()
        if self.summary.exists():
            summary = json.loads(self.summary.read_text())
            self.sink.add_scalar("run/ettr", summary["ettr"], global_step=summary["first_step"] + summary["steps_completed"])
        self.sink.close()


def tensorboard_sink(run_dir: Path) -> Sink:
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

    return SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))


class WandbSink:
    """A W&B run as a :class:`Sink`: every scalar against the training step (``train/step``), never W&B's own."""

    def __init__(self, run_dir: Path, config: dict):
        import wandb  # needs the wandb package

        self.wandb = wandb
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "chameleon"), dir=str(run_dir), mode=mode,
                              config=config, name=Path(run_dir).name, reinit="create_new")
        self.run.define_metric("train/step")
        self.run.define_metric("*", step_metric="train/step")

    def add_scalar(self, tag: str, scalar_value: float, global_step: int, walltime: float | None = None) -> None:
        self.run.log({tag: scalar_value, "train/step": global_step})

    def add_text(self, tag: str, text_string: str, global_step: int) -> None:
        self.run.log({tag: self.wandb.Html(text_string), "train/step": global_step})

    def flush(self) -> None:
        """W&B writes as it logs."""

    def close(self) -> None:
        self.run.finish()


@contextmanager
def live_mirrors(run_dir: Path, *, tensorboard: bool, wandb: bool, config: dict):
    """While the block runs, mirror the run dir to each sink asked for every ``POLL_S``; a last sync at the end."""
    sinks = ([tensorboard_sink(run_dir)] if tensorboard else []) + ([WandbSink(run_dir, config)] if wandb else [])
    if not sinks:
        yield
        return
    mirrors, stop = [Mirror(run_dir, sink) for sink in sinks], threading.Event()

    def loop() -> None:
        while not stop.wait(POLL_S):
            for mirror in mirrors:
                mirror.sync()

    thread = threading.Thread(target=loop, name="chameleon-live-scalars", daemon=True)
    thread.start()
    with ExitStack() as closing:
        for mirror in mirrors:
            closing.callback(mirror.close)
        try:
            yield
        finally:
            stop.set()
            thread.join()
