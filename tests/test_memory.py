"""The memory model (Eq. 14) beyond the kept tensors: the peak's three moments and a device's overheads.

Each expectation is written out from the parts, apart from :func:`stage_memory`'s arithmetic.
"""

from __future__ import annotations

import pytest
from conftest import run_entry

from chameleon.layout.geometry import UnitParams
from chameleon.layout.memory import DeviceOverheads, MemoryCosts, plan_memory, stage_memory
from chameleon.layout.plan import even_plan
from chameleon.optim import GROUP_ELEMS

STATE = 16  # bytes a device keeps per parameter: fp32 weight, gradient and two moments


def costs(*, layer: int = 1000, head: int = 500, acts: int = 100, head_acts: int = 50, head_work: int = 0,
          overheads: DeviceOverheads = DeviceOverheads()) -> MemoryCosts:
    return MemoryCosts(UnitParams(layer, 0, head), UnitParams(acts, 0, head_acts), STATE, head_work=head_work,
                       overheads=overheads)


def test_the_loss_working_set_is_on_the_last_stage_only():
    c = costs(acts=5000, head_acts=3000, head_work=7000)
    middle = stage_memory(c, 2, first=False, last=False, in_flight=3, synced=False)
    last = stage_memory(c, 2, first=False, last=True, in_flight=3, synced=False)
    assert middle == 2 * 1000 * STATE + 3 * 10_000
    assert last == (2 * 1000 + 500) * STATE + 3 * 13_000 + 7000


def test_synced_gradients_are_copied_into_buckets_beside_the_last_backward():
    """Few activations: the gradient copy of a synced stage, beside one micro-batch, is its largest moment."""
    c = costs(acts=10)
    alone = stage_memory(c, 4, first=True, last=False, in_flight=2, synced=False)
    synced = stage_memory(c, 4, first=True, last=False, in_flight=2, synced=True)
    params = 4 * 1000
    assert alone == params * STATE + max(2 * 40, 4 * params)  # the update's fp32 denominator
    assert synced == params * STATE + 40 + 4 * params


def test_the_update_holds_one_group_of_denominators_at_most():
    huge = costs(layer=GROUP_ELEMS, acts=0)
    params = 3 * GROUP_ELEMS
    assert stage_memory(huge, 3, first=False, last=False, in_flight=1, synced=False) == params * STATE + 4 * GROUP_ELEMS


def test_a_device_holds_its_context_its_communicators_and_the_allocator_reserve():
    over = DeviceOverheads(context=1e6, per_communicator=2e5, reserve=0.1)
    bare = stage_memory(costs(), 2, first=False, last=False, in_flight=2, synced=True, tp=2)
    held = stage_memory(costs(overheads=over), 2, first=False, last=False, in_flight=2, synced=True, tp=2)
    # a middle stage of a TP-2 pipeline with peers: its DP group, two pipeline neighbours, its TP group
    assert held == pytest.approx(bare * 1.1 + 1e6 + 4 * 2e5)
    first_alone = stage_memory(costs(overheads=over), 2, first=True, last=True, in_flight=1, synced=False)
    assert first_alone == pytest.approx(stage_memory(costs(), 2, first=True, last=True, in_flight=1, synced=False) * 1.1
                                        + 1e6)


def test_a_plan_syncs_its_stages_only_with_peer_pipelines():
    c = costs(acts=10)
    one = plan_memory(c, even_plan(dp=1, pp=2, tp=1, n_layers=4, global_batch=4, micro_batch=1))
    two = plan_memory(c, even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=4, micro_batch=1))
    first = stage_memory(c, 2, first=True, last=False, in_flight=2, synced=False)
    assert one[0] == first
    assert two[0] == stage_memory(c, 2, first=True, last=False, in_flight=2, synced=True) > first


@pytest.mark.parametrize("entry", ["train", "plan", "simulate"])
@pytest.mark.parametrize("override, key", [("cluster.allocator_reserve=1.5", "cluster.allocator_reserve"),
                                           ("cluster.context_gb=-1", "cluster.context_gb")])
def test_nonsense_overheads_are_refused_in_one_line_by_every_entry_point(tmp_path, entry, override, key):
    run = run_entry(entry, tmp_path / "run", override)
    assert run.returncode == 2
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"chameleon: config error: {key}=") and ("fraction" in line or "≥ 0 GB" in line)
