"""Live TensorBoard scalars of a training run (``report.tensorboard=true``), mirrored from its run dir.

The controller writes ``metrics.jsonl`` and ``events.jsonl`` as the run goes; a
thread of the launching process tails both and writes, under ``<run dir>/tensorboard``:
``train/loss``, ``train/samples_per_s``, ``train/tokens_per_s``, ``train/step_time_s``,
``train/lr`` and ``train/grad_norm`` per committed step, and per recovery
``recovery/total_s``, ``recovery/detect_s``, ``recovery/restore_s``,
``recovery/redo_s`` and ``recovery/count`` at the step it hit, with the policy chosen
as text. ``tensorboard --logdir <run dir>/tensorboard`` shows them while training runs.
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path

STEP_SCALARS = ("loss", "samples_per_s", "tokens_per_s", "step_time_s", "lr", "grad_norm")
RECOVERY_SCALARS = ("total_s", "detect_s", "restore_s", "redo_s")
POLL_S = 0.5


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


class TensorBoardMirror:
    """Writes the run dir's new metrics and recoveries as TensorBoard scalars on each :meth:`sync`."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        self.metrics = _Tail(Path(run_dir) / "metrics.jsonl")
        self.events = _Tail(Path(run_dir) / "events.jsonl")
        self.recoveries = 0

    def sync(self) -> None:
        """Write every record added since the previous call."""
        for m in self.metrics.records():
            for key in STEP_SCALARS:
                if m.get(key) is not None:
                    self.writer.add_scalar(f"train/{key}", m[key], global_step=m["step"], walltime=m["time"])
        for e in self.events.records():
            if e["event"] == "recovered":
                self.recoveries += 1
                for key in RECOVERY_SCALARS:
                    self.writer.add_scalar(f"recovery/{key}", e[key], global_step=e["step"])
                self.writer.add_scalar("recovery/count", self.recoveries, global_step=e["step"])
                self.writer.add_text("recovery/policy", f"ranks {e['failed_ranks']} lost ({e['cause']}): "
                                     f"{e['chosen']} in {e['total_s']:.3f} s", global_step=e["step"])
        self.writer.flush()

    def close(self) -> None:
        self.sync()
        self.writer.close()


@contextmanager
def tensorboard_mirror(run_dir: Path, *, enabled: bool):
    """While the block runs, mirror the run dir to TensorBoard every ``POLL_S``; a last sync at the end."""
    if not enabled:
        yield
        return
    mirror, stop = TensorBoardMirror(run_dir), threading.Event()

    def loop() -> None:
        while not stop.wait(POLL_S):
            mirror.sync()

    thread = threading.Thread(target=loop, name="chameleon-tensorboard", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        mirror.close()
