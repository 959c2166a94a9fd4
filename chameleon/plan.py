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
from omegaconf import DictConfig, OmegaConf

from chameleon.config import CONF_DIR, build_plan, model_config, register_configs
from chameleon.decision.config import ClusterConfig, PlanQueryConfig, PolicyConfig
from chameleon.decision.estimator import estimate_step, memory_per_device
from chameleon.decision.planner import Planner
from chameleon.decision.profiler import load_profile
from chameleon.decision.selector import decide

register_configs()


def _typed(cfg: DictConfig, key: str, schema: type):
    """``cfg[key]`` merged over the schema's defaults, as a dataclass."""
    node = cfg.get(key)
    merged = OmegaConf.merge(OmegaConf.structured(schema), node if node is not None else {})
    return OmegaConf.to_object(merged)


def report(cfg: DictConfig) -> str:
    """The CLI's output for a composed config: a table, or JSON with ``plan.json=true``."""
    cluster = _typed(cfg, "cluster", ClusterConfig)
    policy = _typed(cfg, "policy", PolicyConfig)
    query = _typed(cfg, "plan", PlanQueryConfig)
    model = model_config(cfg)
    plan = build_plan(cfg)
    profile = load_profile(model, cluster, micro_batch=cfg.train.micro_batch, seq_len=cfg.train.seq_len, tp=cfg.parallel.tp)
    planner = Planner(profile, dp_degrees=tuple(policy.dp_degrees), pp_lengths=tuple(policy.pp_lengths))
    decision = decide(
        profile, plan, set(query.failed), policy=policy, planner=planner, fault_times=query.fault_times_s,
        elapsed_s=query.elapsed_s, checkpoint_age_s=query.checkpoint_age_s,
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
def main(cfg: DictConfig) -> None:
    print(report(cfg))


if __name__ == "__main__":
    main()
