"""The push control plane on real workers: the store serves process-group rendezvous only.

Every worker counts its operations on the controller's store (``summary.json``'s
``store_ops``). A worker learns of commits and faults from its node agent, never by
polling the store, so the count is the rendezvous of its generation's groups alone:
the same for a job twice as long whose steps take several times longer (its
workers wait longer in every step, and poll nothing more).
"""

from __future__ import annotations

from conftest import run_entry

JOB = ("failure=none", "launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2", "model.n_layers=4",
       "train.global_batch=8", "train.micro_batch=2", "train.seq_len=32", "report.plots=false")


def test_store_operations_do_not_grow_with_steps_or_step_time(tmp_path):
    short = run_entry("train", tmp_path / "short", *JOB, "train.steps=4", "model.dim=32")
    long = run_entry("train", tmp_path / "long", *JOB, "train.steps=12", "model.dim=256")
    for run in (short, long):
        assert run.returncode == 0, run.stderr
    a, b = short.summary, long.summary
    assert b["mean_step_time_s"] > 2 * a["mean_step_time_s"], "the long job's workers must wait longer per step"
    assert set(a["store_ops"]) == {"0", "1", "2", "3"} and all(n > 0 for n in a["store_ops"].values())
    assert a["store_ops"] == b["store_ops"], "a worker's store operations are its groups' rendezvous, nothing per step"
