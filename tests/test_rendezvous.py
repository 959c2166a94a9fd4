"""NCCL's rules for point-to-point traffic (no tags, no buffered sends), checked on every device's exchanges."""

import itertools
import random

import pytest

from chameleon.decision.config import ClusterConfig
from chameleon.decision.planner import Planner
from chameleon.decision.profiler import analytic_profile
from chameleon.decision.selector import candidates, reroute_plan
from chameleon.layout.plan import Pipeline, Plan, Stage, even_plan, split_layers
from chameleon.layout.rendezvous import _deadlock, _Group, rendezvous_fault
from chameleon.layout.schedule import exchanges, message_tag, step_actions
from chameleon.model.config import ModelConfig

MODEL = ModelConfig(dim=16, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=20, multiple_of=8)


def profile():
    cluster = ClusterConfig(kind="analytic", memory_gb=1.0, peak_tflops=1.0, hbm_gbps=1.0, intra_gbps=1.0,
                            inter_gbps=1.0)
    return analytic_profile(MODEL, cluster, micro_batch=1, seq_len=8, tp=1)


def test_even_uneven_and_single_reroute_plans_are_safe_without_tags():
    for dp, pp, tp in itertools.product((1, 2, 3), (1, 2, 3, 4), (1, 2)):
        plan = even_plan(dp=dp, pp=pp, tp=tp, n_layers=8, global_batch=6 * dp, micro_batch=1)
        assert rendezvous_fault(plan) is None, plan.describe()
        if dp > 1 and pp > 1:
            for lost in plan.devices:
                assert rendezvous_fault(reroute_plan(plan, {lost})) is None, (plan.describe(), lost)
    rng = random.Random(0)
    for _ in range(200):
        pipelines, device = [], 0
        for _ in range(rng.randint(1, 4)):
            tp, stages = rng.choice((1, 2)), []
            for layers in split_layers(10, rng.randint(1, 5)):
                stages.append(Stage(tuple(range(device, device + tp)), layers))
                device += tp
            pipelines.append(Pipeline(tuple(stages), rng.randint(1, 7)))
        uneven = Plan(10, 1, tuple(pipelines))
        assert rendezvous_fault(uneven) is None, uneven.describe()


def test_two_stages_rerouted_over_one_pair_are_caught_and_named():
    """Pipeline 1 loses stages 1 and 2: both reroute onto pipeline 0, whose stage-1 → stage-2 pair then carries
    two pipelines' activations, posted in different orders by sender and receiver. Gloo's tags keep them apart;
    without tags the receiver would take another micro-batch's tensor."""
    plan = even_plan(dp=2, pp=4, tp=1, n_layers=8, global_batch=8, micro_batch=1)
    rerouted = reroute_plan(plan, {5, 6})
    sender, receiver = plan.pipelines[0].stages[1].devices[0], plan.pipelines[0].stages[2].devices[0]
    actions = step_actions(rerouted)
    sent = [e.send.tag for e in exchanges(rerouted, actions[sender], sender) if e.send and e.send.peer == receiver]
    received = [e.receive.tag for e in exchanges(rerouted, actions[receiver], receiver)
                if e.receive and e.receive.peer == sender]
    assert sorted(sent) == sorted(received) and {message_tag(0, 1, False), message_tag(1, 1, False)} <= set(sent)
    assert sent != received, "the case this test is about: same messages, another order"
    why = rendezvous_fault(rerouted)
    assert why is not None and f"device {sender} sends device {receiver}" in why


def test_unbatched_sends_both_ways_deadlock_and_one_group_call_does_not():
    def program(me, peer, *, batched):
        if batched:
            group = _Group(me, peer, sends=[7], receives=[7])
            return [("post", group), ("wait", group)]
        receive = _Group(me, peer, receives=[7])
        return [("post", _Group(me, peer, sends=[7])), ("post", receive), ("wait", receive)]

    assert "wait on each other" in _deadlock({0: program(0, 1, batched=False), 1: program(1, 0, batched=False)})
    assert _deadlock({0: program(0, 1, batched=True), 1: program(1, 0, batched=True)}) is None
    assert _deadlock({0: program(0, 1, batched=True), 1: program(1, 0, batched=False)}) is None


@pytest.mark.parametrize("tagless", [False, True])
def test_the_selector_never_chooses_a_plan_unsafe_on_the_backend(tagless):
    plan = even_plan(dp=2, pp=4, tp=1, n_layers=8, global_batch=8, micro_batch=1)
    planner = Planner(profile(), dp_degrees=(1, 2), pp_lengths=(1, 2, 4))
    (reroute,) = [c for c in candidates(profile(), plan, {5, 6}, planner=planner, d_s=1e6, tagless=tagless)
                  if c.name == "reroute"]
    assert reroute.feasible != tagless
    if tagless:
        assert "not on this backend" in reroute.why and "matched wrongly" in reroute.why


def test_every_candidate_of_a_pipelined_plan_is_checked_on_a_tagless_backend():
    plan = even_plan(dp=2, pp=4, tp=1, n_layers=8, global_batch=8, micro_batch=1)
    planner = Planner(profile(), dp_degrees=(1, 2), pp_lengths=(1, 2, 4))
    refused = 0
    for lost in itertools.combinations(plan.devices, 2):
        cands = candidates(profile(), plan, set(lost), planner=planner, d_s=1e6, tagless=True)
        over_gloo = candidates(profile(), plan, set(lost), planner=planner, d_s=1e6)
        for c, g in zip(cands, over_gloo, strict=True):
            assert c.feasible == (g.feasible and rendezvous_fault(g.plan) is None), (lost, c.name)
            refused += "not on this backend" in c.why
        if any(g.feasible for g in over_gloo):
            assert any(c.feasible for c in cands), f"losing {lost}, a safe plan (a re-plan) is left"
    assert refused, "some double loss reroutes unsafely, and is refused"
