"""``python -m chameleon.train [+recipe=NAME] [key=value ...]``: train, with faults survived.

The calling process is the controller; it composes the config once, pins one run
directory, and starts ``launcher.nproc_per_node`` worker processes per node. The last line printed is
the path of ``summary.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from chameleon.config import CONF_DIR, ConfigError, model_config, register_configs, to_container, validate
from chameleon.model.hf import export_hf

register_configs()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    """Validate, train, print the summary path; a bad config exits 2 with one line."""
    try:
        plan = validate(cfg)
    except ConfigError as err:
        print(f"chameleon: config error: {err}", file=sys.stderr)
        sys.exit(2)
    from chameleon.report.run_plots import plot_run
    from chameleon.report.tensorboard import tensorboard_mirror
    from chameleon.runtime.controller import JobRestart, TrainingError, run_training

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    print(f"plan ({len(plan.devices)} workers):\n{plan.describe()}", flush=True)
    try:
        with tensorboard_mirror(run_dir, enabled=cfg.report.tensorboard):
            summary = run_training(to_container(cfg), plan=plan, run_dir=run_dir)
    except JobRestart as err:
        print(f"chameleon: {err}", file=sys.stderr)
        sys.exit(3)
    except TrainingError as err:
        print(f"chameleon: training failed: {err}", file=sys.stderr)
        sys.exit(1)
    finally:
        if cfg.report.plots:
            plot_run(run_dir)
    if cfg.output.export_hf:
        export_hf(torch.load(run_dir / "final_params.pt", weights_only=True), model_config(cfg), run_dir / "hf")
    print(summary, flush=True)


if __name__ == "__main__":
    main()
