"""The controller's decisions at scale, off the cluster: what a fault costs the controller's event loop.

The job of ``bench_control_plane.py`` (Llama-2-7B, one 8-stage pipeline per node of 8 devices, the analytic
H100 profile), decided by the real :class:`~chameleon.decision.coordinator.Coordinator` as the core calls it (the cyclic
collector paused, as in the planning process), with the budget of ``policy.decide_budget_s``. Per size: the precompute the planner's thread runs after a
generation starts (one device's, and one to four whole nodes' losses); a node lost with that precompute and
without it; four nodes lost at once, precomputed; and a second node lost on the uneven plan the first
recovery chose, searched (a fault outside the precomputed set). Each decision includes its plan's placement,
layouts and transfer manifest, and what the core publishes with it (checkpoint writers, replica groups), as in a
live run; the smallest job is decided once first, untimed. Run: ``python benchmarks/bench_decision.py [--devices N ...]``.
"""

from __future__ import annotations

import argparse
import resource
import time

from _common import header
from bench_control_plane import PER_NODE, config_for

from chameleon.decision.coordinator import Coordinator
from chameleon.decision.planner import Planner
from chameleon.decision.profiler import load_profile
from chameleon.decision.selector import precompute_replans
from chameleon.layout.geometry import geometry_of
from chameleon.runtime.control.planning import collector_paused

SIZES = (1024, 2048, 4096, 8192)
DOMAIN_NODES = 4  # ft.fault_domain_nodes in the benchmark's job


def publish(coord: Coordinator, plan) -> None:
    """What the core's ``_publish`` asks the coordinator for a new generation: its checkpoint writers and replica
    groups."""
    coord.writers(plan)
    coord.replica_groups(plan)


def run_size(devices: int) -> dict:
    config, plan = config_for(devices, steps=40, port=29500)
    profile = load_profile(config.model, config.cluster, micro_batch=1, seq_len=config.train.seq_len, tp=1,
                           recompute=config.train.recompute)
    nodes = devices // PER_NODE
    domains = tuple(tuple(range(PER_NODE * n, PER_NODE * (n + 1))) for n in range(nodes))

    def coordinator() -> Coordinator:
        """A fresh planner (nothing searched by an earlier case) that knows the resident plan's layout, as the
        core's does once it published that plan."""
        fresh = Coordinator(model=config.model, profile=profile, planner=Planner(profile), policy=config.policy,
                            domains=domains)
        publish(fresh, plan)
        return fresh

    def lose(resident, alive, lost_nodes, *, coord, ahead=None):
        alive = alive - {d for n in lost_nodes for d in domains[n]}
        start = time.perf_counter()
        with collector_paused():  # as the planning process runs a decision
            placed = ahead.plan_for(geometry_of(resident).units(alive), resident, profile) if ahead else None
            transition = coord.recover(resident, alive=alive, next_step=10, saved=None, now=0.0, fault_times=[],
                                       elapsed_s=600.0, precomputed=placed)
        publish(coord, transition.plan)
        return time.perf_counter() - start, transition, alive

    everyone = set(range(devices))
    coord = coordinator()
    start = time.perf_counter()
    with collector_paused():
        ahead = precompute_replans(plan, coord.planner, {1} | {n * PER_NODE for n in range(1, DOMAIN_NODES + 1)})
    precompute_s = time.perf_counter() - start
    node_pre, _, _ = lose(plan, everyone, [nodes - 1], coord=coord, ahead=ahead)
    four_pre, _, _ = lose(plan, everyone, range(nodes - DOMAIN_NODES, nodes), coord=coord, ahead=ahead)
    coord = coordinator()
    node_searched, first, alive = lose(plan, everyone, [nodes - 1], coord=coord)
    second_s, second, _ = lose(first.plan, alive, [nodes // 4], coord=coord)
    return {
        "devices": devices, "precompute_s": precompute_s, "node_precomputed_s": node_pre,
        "four_nodes_precomputed_s": four_pre, "node_searched_s": node_searched, "second_node_searched_s": second_s,
        "second_plan_pipelines": len(first.plan.pipelines), "second_choice": second.decision.choice,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=list(SIZES),
                        help=f"the sizes (multiples of {PER_NODE}, at least {(DOMAIN_NODES + 2) * PER_NODE})")
    args = parser.parse_args()
    if any(n % PER_NODE or n < (DOMAIN_NODES + 2) * PER_NODE for n in args.devices):
        parser.error(f"--devices {' '.join(map(str, args.devices))}: every size must be a multiple of {PER_NODE}, "
                     f"at least {(DOMAIN_NODES + 2) * PER_NODE}")
    header("the real coordinator, selector and planner in one process, no cluster")
    run_size((DOMAIN_NODES + 2) * PER_NODE)  # untimed: the process's first decision pays lazy imports and first uses
    print("| devices | precompute (s) | node lost, precomputed (s) | four nodes lost, precomputed (s) | "
          "node lost, searched (s) | second node lost on the re-plan, searched (s) | re-plan's pipelines | "
          "peak RSS (GB) |")
    print("|---|---|---|---|---|---|---|---|")
    for devices in args.devices:
        r = run_size(devices)
        print(f"| {r['devices']} | {r['precompute_s']:.2f} | {r['node_precomputed_s']:.2f} | "
              f"{r['four_nodes_precomputed_s']:.2f} | {r['node_searched_s']:.2f} | {r['second_node_searched_s']:.2f} | "
              f"{r['second_plan_pipelines']} | {r['peak_rss_gb']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
