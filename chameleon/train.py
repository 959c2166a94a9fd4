"""``python -m chameleon.train [+recipe=NAME] [key=value ...]``: train, with faults survived.

On node 0 (the default) the calling process is the controller: it composes the
config once, pins one run directory, runs node 0's workers and waits for the other
nodes' agents. On any other node (``launcher.node_rank ≥ 1``) it is that node's
agent, and writes nothing locally. The last line node 0 prints is the path of
``summary.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from chameleon import cli
from chameleon.config import CONF_DIR, ConfigError, model_config, register_configs, to_config, to_container
from chameleon.runtime.protocol.errors import ExitCode, JobRestart, LaunchError, Preempted, TrainingError, exit_code_of

USAGE = """
usage: python -m chameleon.train [+recipe=NAME] [GROUP=OPTION ...] [KEY=VALUE ...] [--multirun]

Trains a Llama on worker processes (one per device) and keeps training through faults: a lost
device is recovered in place by rerouting, re-planning, a neighbour's takeover or a checkpoint,
whichever Eq. 8 predicts trains the most samples before the next fault.

  python -m chameleon.train                                  the default: 4 workers, a SIGKILL in step 50
  python -m chameleon.train failure=none train.steps=300     no fault, longer
  python -m chameleon.train parallel=dp launcher.nproc_per_node=1 failure=none    one process
  python -m chameleon.train launcher.nnodes=2 launcher.node_rank=K launcher.master_addr=HOST \\
      launcher.master_port=29500 launcher.nproc_per_node=8      on each of two hosts (CHAMELEON_SECRET set)

Outputs go to the run directory (hydra.run.dir=...): metrics.jsonl, events.jsonl, summary.json,
final_params.pt, checkpoints/. Exit codes: 0 trained; 1 training failed (one line says why);
2 config or launch error (one line names the key and the fix); 3 stopped for a relaunch
(ft.on_fault=exit); 4 preempted by SIGTERM (a checkpoint was saved: continue with ckpt.resume=DIR);
130 interrupted (Ctrl-C).
"""

_RUN_FILES = ("summary.json", "events.jsonl", "metrics.jsonl")

register_configs()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def _job(cfg: DictConfig) -> None:
    """Validate, train, print the summary path; every way it can end is one line and an exit code."""
    from chameleon.runtime.node.preflight import check_job

    try:
        plan = check_job(cfg)  # checked once: a single run's config was checked before Hydra started
    except ConfigError as err:
        cli.fail(err)
    from chameleon.model.hf import export_hf
    from chameleon.report.live import live_mirrors
    from chameleon.report.run_plots import plot_run
    from chameleon.runtime.checkpoint import CheckpointError
    from chameleon.runtime.control.controller import run_training
    from chameleon.runtime.node.launch import job_secret

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        secret = job_secret(cfg.launcher.nnodes)
    except LaunchError as err:
        cli.fail(err)
    print(f"plan ({len(plan.devices)} workers):\n{plan.summary()}", flush=True)
    ending = None
    try:
        with live_mirrors(run_dir, tensorboard=cfg.report.tensorboard, wandb=cfg.report.wandb,
                          config=to_container(cfg)):
            summary = run_training(to_config(cfg), plan=plan, run_dir=run_dir, secret=secret)
    except (LaunchError, TrainingError, CheckpointError, OSError, KeyboardInterrupt) as err:
        ending = _ending(err), exit_code_of(err)
    finally:
        if cfg.report.plots:
            plot_run(run_dir)
    if ending is not None:
        _stop(*ending)
    if cfg.output.export_hf:
        import torch

        export_hf(torch.load(run_dir / "final_params.pt", weights_only=True), model_config(cfg), run_dir / "hf")
    print(summary, flush=True)
    result = json.loads(summary.read_text())
    print(f"chameleon: effective training time {result['ettr']:.1%} of {result['wall_s']:.1f} s ("
          + ", ".join(f"{k} {v:.2f} s" for k, v in result["time_breakdown_s"].items() if v > 0) + ")",
          file=sys.stderr, flush=True)


def _ending(err: BaseException) -> str:
    """The one line a run that ``err`` ended says last."""
    if isinstance(err, LaunchError):
        return cli.refusal(err)
    if isinstance(err, JobRestart):
        return f"chameleon: {err}"
    if isinstance(err, Preempted):
        return f"chameleon: preempted: {err}"
    if isinstance(err, KeyboardInterrupt):
        return "chameleon: interrupted (Ctrl-C); every worker is stopped"
    return f"chameleon: training failed: {err}"


def _stop(line: str, code: int) -> None:
    """End with ``line`` once every process the run started has exited."""
    from chameleon.runtime.node.processes import stop_forkserver

    stop_forkserver()
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)


def _prepare(cfg: DictConfig) -> None:
    """Refuse what cannot run before Hydra writes anything; on a node other than 0, serve as its agent."""
    from chameleon.runtime.node.launch import job_secret
    from chameleon.runtime.node.preflight import check_job, node_problem

    check_job(cfg)
    job_secret(cfg.launcher.nnodes)
    problem = node_problem(cfg.launcher)
    if problem:
        raise LaunchError(problem)
    if cfg.launcher.node_rank > 0:
        sys.exit(_serve_node(cfg))
    if "--multirun" not in sys.argv and "-m" not in sys.argv:
        _check_run_dir(Path(cfg.hydra.run.dir))


def _check_run_dir(run_dir: Path) -> None:
    """The run directory must be new (outputs are never overwritten) and writable."""
    held = [f for f in _RUN_FILES if (run_dir / f).exists()]
    if held:
        raise ConfigError(f"hydra.run.dir={run_dir} already holds a run ({held[0]}): pick a new directory")
    if (probe := cli.unwritable(run_dir)) is not None:
        raise ConfigError(f"hydra.run.dir={run_dir} cannot be created or written ({probe} is not a writable "
                          "directory): pick a directory you can write")


def _serve_node(cfg: DictConfig) -> int:
    """Run this node's agent (launcher.node_rank ≥ 1) until the job ends; its exit code."""
    from chameleon.runtime.node.agent import serve
    from chameleon.runtime.node.launch import job_secret
    from chameleon.runtime.node.processes import stop_forkserver
    from chameleon.runtime.node.wire import job_key

    launcher = cfg.launcher
    key = job_key(job_secret(launcher.nnodes))  # _prepare has checked that it is set
    config = to_config(cfg)
    print(f"chameleon agent {launcher.node_rank}: joining the controller at "
          f"{launcher.master_addr}:{launcher.control_port}", file=sys.stderr, flush=True)
    try:
        return serve(config, node=launcher.node_rank, master_addr=launcher.master_addr, control_port=launcher.control_port,
                     key=key, node_addr=launcher.node_addr, join_timeout_s=launcher.join_timeout_s)
    except KeyboardInterrupt:
        stop_forkserver()
        print(f"chameleon agent {launcher.node_rank}: interrupted; its workers are stopped", file=sys.stderr)
        return ExitCode.INTERRUPTED


def main() -> None:
    cli.run("train", USAGE, _job, _prepare)


if __name__ == "__main__":
    main()
