"""Recovery's own peak in the memory model: old state, new shards and one round's packed buffers at once.

The model (:func:`chameleon.layout.memory.relayout_memory`) is held to what the manifest executor really allocates
on each device, and the coordinator never chooses a recovery whose re-layout would run out of memory.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from functools import partial

import pytest
import torch

from chameleon.decision.config import ClusterConfig, PolicyConfig
from chameleon.decision.coordinator import Coordinator
from chameleon.decision.planner import Planner
from chameleon.decision.profiler import analytic_profile
from chameleon.decision.selector import decide
from chameleon.layout import memory
from chameleon.layout.geometry import UnitParams
from chameleon.layout.memory import DeviceOverheads, MemoryCosts
from chameleon.layout.plan import even_plan
from chameleon.layout.spec import region_shape
from chameleon.runtime.worker.comm import _Waiter
from chameleon.runtime.worker.transfer import execute_manifest
from tests.test_layout import CFG  # a model of 8 small layers
from tests.test_transfer import KINDS, transitions

ELEMENT = 4  # fp32: every kind the executor moves
HEADER = ELEMENT  # the generation stamp at the head of each packed buffer


class Recording:
    """Links that only count: each exchange's packed bytes (its receives stamped, so the executor accepts them)."""

    def __init__(self, stamp: int):
        self.stamp, self.bytes = stamp, []

    def exchange(self, sends, receives) -> None:
        self.bytes.append(sum(t.numel() * t.element_size() for t in [*sends.values(), *receives.values()]))
        for buffer in receives.values():
            buffer.zero_()[0] = self.stamp


@pytest.mark.parametrize("step", range(4))
def test_the_model_counts_what_the_executor_allocates_on_each_device(step):
    """Every device of four real manifests (a merge, a growth onto an empty device, a TP change, a swap): the old
    state it passes, the new shards it gets back (none when kept) and its largest round's buffers, byte for byte
    up to the stamps, against the model with the kinds' bytes per element."""
    manifest = transitions()[step]
    plan = even_plan(dp=1, pp=1, tp=1, n_layers=4, global_batch=4, micro_batch=1)  # groups: none to count
    costs = MemoryCosts(UnitParams(0, 0, 0), UnitParams(0, 0, 0), len(KINDS) * ELEMENT)
    model = memory.relayout_memory(costs, manifest, plan, plan, moved_bytes=len(KINDS) * ELEMENT)
    assert set(model) == manifest.before.keys() | manifest.after.keys()
    for me in model:
        state = {kind: {name: torch.zeros(region_shape(r)) for name, r in manifest.before.get(me, {}).items()}
                 for kind in KINDS}
        links = Recording(stamp=7)
        new = execute_manifest(manifest, me=me, state=state, links=links, stamp=7)
        held = sum(t.numel() * ELEMENT for kinds in state.values() for t in kinds.values())
        fresh = 0 if me in manifest.kept else sum(t.numel() * ELEMENT for kinds in new.values() for t in kinds.values())
        packed = max(links.bytes, default=0)
        assert model[me] <= held + fresh + packed <= model[me] + 2 * HEADER, me


def test_a_device_holds_its_overheads_and_both_generations_groups_while_state_moves():
    over = DeviceOverheads(context=1e6, per_communicator=2e5, reserve=0.1)
    costs = MemoryCosts(UnitParams(0, 0, 0), UnitParams(0, 0, 0), 16, overheads=over)
    bare = MemoryCosts(UnitParams(0, 0, 0), UnitParams(0, 0, 0), 16)
    old = even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=4, micro_batch=1)  # each device: DP group, a neighbour
    new = even_plan(dp=1, pp=2, tp=2, n_layers=4, global_batch=4, micro_batch=1)  # each device: TP group, a neighbour
    manifest = transitions()[2]
    with_overheads = memory.relayout_memory(costs, manifest, old, new)
    for d, need in memory.relayout_memory(bare, manifest, old, new).items():
        assert with_overheads[d] == pytest.approx(need * 1.1 + 1e6 + 4 * 2e5)


CLUSTER = ClusterConfig(kind="analytic", memory_gb=1.0, peak_tflops=1.0, hbm_gbps=1.0, intra_gbps=1.0, inter_gbps=1.0)
DP2_PP2 = even_plan(dp=2, pp=2, tp=1, n_layers=8, global_batch=8, micro_batch=1)


def _recovery(memory_gb: float, policy: str):
    profile = analytic_profile(CFG, CLUSTER, micro_batch=1, seq_len=8, tp=1)
    profile = replace(profile, memory_bytes=memory_gb * 1e9) if memory_gb else profile
    coordinator = Coordinator(model=CFG, profile=profile, planner=Planner(profile), policy=PolicyConfig(name=policy))
    return profile, coordinator, coordinator.recover(DP2_PP2, alive={0, 1, 2}, next_step=1, saved=None, now=0.0,
                                                     fault_times=[], elapsed_s=60.0, precomputed=None)


def test_a_recovery_whose_relayout_would_not_fit_is_not_chosen():
    """Device 3 lost, ``dynamic`` forced: its plan fits in memory while training, but device 0 would hold its old
    four layers, the new eight and a round's buffers at once. With memory between the two, the coordinator chooses
    by Eq. 8 among what fits, and says why ``dynamic`` was passed over; with room for both it moves by ``dynamic``."""
    profile, coordinator, roomy = _recovery(0.0, "dynamic")
    assert roomy.decision.choice == "dynamic"
    steady = max(memory.plan_memory(profile.memory_costs, roomy.plan).values())
    peak = max(memory.relayout_memory(profile.memory_costs, roomy.manifest, DP2_PP2, roomy.plan).values())
    assert steady < peak
    _, _, tight = _recovery((steady + peak) / 2 / 1e9, "dynamic")
    dynamic = next(c for c in tight.decision.candidates if c.name == "dynamic")
    assert not dynamic.feasible and "re-layout needs" in dynamic.why
    assert tight.decision.choice not in (None, "dynamic") and "forced policy dynamic is infeasible" in tight.decision.note
    chosen = tight.decision.chosen
    fits = memory.relayout_memory(profile.memory_costs, tight.manifest, DP2_PP2, tight.plan)
    assert max(fits.values(), default=0.0) <= (steady + peak) / 2 and chosen.feasible


def test_the_selector_picks_again_while_the_chosen_relayout_does_not_fit():
    """Eq. 8's best moves state that would not fit: the next best is chosen, and only the chosen plans are
    checked (their manifests are the ones a run builds)."""
    profile = analytic_profile(CFG, CLUSTER, micro_batch=1, seq_len=8, tp=1)
    common = dict(policy=PolicyConfig(), fault_times=[], elapsed_s=60.0)
    free = decide(profile, DP2_PP2, {3}, planner=Planner(profile), **common)
    first = free.chosen
    asked = []

    def peak(plan):
        asked.append(plan)
        return 2 * profile.memory_bytes if plan == first.plan else 0.0

    checked = decide(profile, DP2_PP2, {3}, planner=Planner(profile), relayout_peak=peak, **common)
    assert checked.choice != first.name and checked.chosen.feasible
    ranked = sorted((c for c in free.candidates if c.feasible and c.name != first.name),
                    key=lambda c: (-c.score, c.transition, c.name))
    assert checked.choice == ranked[0].name
    assert asked == [first.plan, checked.chosen.plan]
    passed = next(c for c in checked.candidates if c.name == first.name)
    assert not passed.feasible and passed.why.startswith("its re-layout needs")


def test_a_finished_wait_lets_its_buffer_go_before_the_next_round():
    """The waiter thread (gloo's point-to-point waits) drops a call once it returns: a round's received buffer
    is freed with the round, not kept alive beside the next round's (what the model counts)."""
    waiter = _Waiter(name="test-waiter")
    buffer = torch.empty(1024)
    gone = weakref.ref(buffer)
    waiter.submit(partial(torch.Tensor.sum, buffer)).done.wait(5)
    del buffer
    assert gone() is None
