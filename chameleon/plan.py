"""``python -m chameleon.plan``: what the planner and selector would do, without training.

Example::

    python -m chameleon.plan +recipe=llama7b cluster=a100_32 'plan.failed=[5]'

prints the failure-free plan, every recovery candidate (plan, estimated step time,
transition, peak memory, Eq. 8 score) and the choice; ``plan.json=true`` prints
the decision as JSON instead.
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig

from chameleon import cli
from chameleon.config import CONF_DIR, ConfigError, build_plan, check_batch, model_config, register_configs, typed
from chameleon.decision.config import ClusterConfig, PlanQueryConfig, PolicyConfig
from chameleon.decision.estimator import estimate_step, memory_per_device
from chameleon.decision.planner import Planner
from chameleon.decision.profiler import device_overheads, load_profile
from chameleon.decision.selector import decide

USAGE = """
usage: python -m chameleon.plan [+recipe=NAME] [cluster=NAME] ['plan.failed=[D, ...]'] [plan.json=true] [KEY=VALUE ...]

What Chameleon would do if devices of the failure-free plan failed, without training: the plan, every
recovery candidate (reroute, dynamic, redundant, checkpoint) with its estimated step time, transition,
peak memory, exposure to the next fault and score, and the choice. plan.checkpoint_age_s=S says a checkpoint
exists (S s old), plan.checkpoint_interval_s=I that one is written every I s; plan.fault_times_s and
plan.elapsed_s feed the estimate of the time to the next fault.

  python -m chameleon.plan                                         the tiny model, device 1 lost
  python -m chameleon.plan +recipe=llama7b cluster=a100_32 'plan.failed=[5]'
"""

register_configs()


def check(cfg: DictConfig) -> None:
    """Refuse a query that names no device, devices outside the plan, or every device.

    Raises:
        ConfigError: naming the key and the fix.
    """
    query = typed(cfg, "plan", PlanQueryConfig)
    policy = typed(cfg, "policy", PolicyConfig)
    device_overheads(typed(cfg, "cluster", ClusterConfig))  # raises ValueError naming a key out of range
    check_batch(cfg.train)
    devices = build_plan(cfg).devices
    failed = list(query.failed)
    if not failed:
        raise ConfigError("plan.failed is empty: name the failed devices, e.g. 'plan.failed=[5]'")
    strangers = sorted(set(failed) - set(devices))
    if strangers:
        raise ConfigError(f"plan.failed names {strangers}, which are not devices of the plan (0..{len(devices) - 1}): "
                          "name devices of the plan")
    if len(set(failed)) != len(failed):
        raise ConfigError(f"plan.failed={failed} names a device twice: name each once")
    if set(failed) >= set(devices):
        raise ConfigError("plan.failed names every device of the plan: nothing is left to recover onto")
    for key in ("checkpoint_age_s", "elapsed_s"):
        value = getattr(query, key)
        if value is not None and value < 0:
            raise ConfigError(f"plan.{key}={value}: must be ≥ 0")
    if query.checkpoint_interval_s is not None and query.checkpoint_interval_s <= 0:
        raise ConfigError(f"plan.checkpoint_interval_s={query.checkpoint_interval_s}: must be > 0 (null: none scheduled)")
    if policy.name not in ("chameleon", "reroute", "dynamic", "redundant", "checkpoint"):
        raise ConfigError(f"policy.name={policy.name!r}: use chameleon, reroute, dynamic, redundant or checkpoint")


def report(cfg: DictConfig) -> str:
    """The CLI's output for a composed config: a table, or JSON with ``plan.json=true``."""
    cluster = typed(cfg, "cluster", ClusterConfig)
    policy = typed(cfg, "policy", PolicyConfig)
    query = typed(cfg, "plan", PlanQueryConfig)
    model = model_config(cfg)
    plan = build_plan(cfg)
    profile = load_profile(model, cluster, micro_batch=cfg.train.micro_batch, seq_len=cfg.train.seq_len, tp=cfg.parallel.tp,
                           recompute=cfg.train.recompute)
    planner = Planner(profile, dp_degrees=tuple(policy.dp_degrees), pp_lengths=tuple(policy.pp_lengths))
    decision = decide(
        profile, plan, set(query.failed), policy=policy, planner=planner, fault_times=query.fault_times_s,
        elapsed_s=query.elapsed_s, checkpoint_age_s=query.checkpoint_age_s, checkpoint_interval_s=query.checkpoint_interval_s,
    )
    base = estimate_step(profile, plan)
    if query.json:
        out = {
            "profile": profile.to_dict(),
            "failure_free": {"summary": plan.describe(), "t_step": base.t_step, "estimate": base.__dict__},
            "decision": decision.to_dict(),
        }
        return json.dumps(out, indent=1, default=str)
    lines = [f"profile: {profile.source}  [{profile.key}]"]
    lines.append(f"failure-free plan: est. step {base.t_step:.3f} s (compute {base.compute:.3f}, sync {base.sync:.3f} in "
          f"{base.sync_rounds} rounds, optimizer {base.optimizer:.3f}), peak "
          f"{max(memory_per_device(profile, plan).values()) / 1e9:.1f} GB")
    lines.append(plan.describe())
    lines.append(f"\nfailed devices {list(decision.failed)}; D = {decision.d_s:.0f} s ({decision.d_source}); policy {decision.policy}")
    lines.append(decision.table())
    for c in decision.candidates:
        if c.plan is not None:
            parts = ", ".join(f"{k} {v:.3f}" for k, v in c.transition_parts.items())
            lines.append(f"\n{c.name}: transition = {parts}\n{c.plan.describe()}")
    lines.append(f"\nchoice: {decision.choice}" + (f"  ({decision.note})" if decision.note else ""))
    return "\n".join(lines)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def _job(cfg: DictConfig) -> None:
    try:
        check(cfg)
    except ConfigError as err:
        cli.fail(err)
    print(report(cfg))


def main() -> None:
    cli.run("plan", USAGE, _job, check)


if __name__ == "__main__":
    main()
