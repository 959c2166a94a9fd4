"""Recomputation per stage, chosen to fit: a plan over memory recomputes on just the stages that overflow (selective,
then full), is priced with their rerun forwards, and a recovery that fits only so is chosen and trains the
failure-free run's losses. The oracle of memory is Eq. 14 written out here from the profile's figures; of the math,
the run without recomputation (or without the fault)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import assert_nothing_lost, run_entry

from chameleon.cli import compose_command_line
from chameleon.config import build_plan, model_config, typed
from chameleon.decision import estimator as est
from chameleon.decision.config import ClusterConfig, PolicyConfig
from chameleon.decision.planner import Planner
from chameleon.decision.profiler import Profile, analytic_profile, load_profile
from chameleon.decision.selector import decide, reform_plans, reroute_plan
from chameleon.layout.plan import PlanError, Recompute, even_plan, plan_from_spec, recomputing
from chameleon.model.config import ModelConfig
from chameleon.runtime.protocol import codec, messages  # noqa: F401 - messages registers the plan's encoding

CLUSTER = ClusterConfig(name="test", kind="analytic", n_devices=16, devices_per_node=8, peak_tflops=1.0, mfu=0.5,
                        memory_gb=1.0, hbm_gbps=100.0, intra_gbps=10.0, inter_gbps=1.0, latency_us=10.0)


def heavy_profile(n_layers: int, *, tp: int = 1) -> Profile:
    """An analytic profile of a small Llama whose activations (4 × 256 tokens a micro-batch) outweigh its state."""
    model = ModelConfig(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=256)
    return analytic_profile(model, CLUSTER, micro_batch=4, seq_len=256, tp=tp)


def stage_bytes(profile: Profile, n_layers: int, *, first: bool, last: bool, in_flight: int, mode: str) -> float:
    """Eq. 14 for one device of a TP-1 stage of a pipeline with no peers, from the profile's figures: its state,
    ``in_flight`` micro-batches of activations under ``mode``, what one layer's backward rebuilds and, on the last
    stage, the loss's working set (these activations outweigh the update's transient)."""
    layer = next(t for t in profile.recompute_terms if t.recompute == mode)
    params = n_layers * profile.layer_params + first * profile.first_params + last * profile.last_params
    acts = n_layers * layer.act_bytes + first * profile.first_act_bytes + last * profile.last_act_bytes
    work = layer.rebuilt_bytes + last * profile.head_work_bytes
    return params * profile.state.resident + in_flight * acts + work


def modes(plan) -> list[list[str]]:
    """Each stage's recomputation, pipeline by pipeline."""
    return [[st.recompute for st in p.stages] for p in plan.pipelines]


def test_a_plan_over_memory_recomputes_on_just_the_stages_that_overflow_and_pays_their_rerun():
    """Three stages of two layers, six micro-batches: 3, 2 and 1 in flight. A memory where the first fits only under
    full recomputation, the second under selective and the last as it is."""
    profile = heavy_profile(6)
    plan = even_plan(dp=1, pp=3, tp=1, n_layers=6, global_batch=24, micro_batch=4)
    need = [{mode: stage_bytes(profile, 2, first=s == 0, last=s == 2, in_flight=3 - s, mode=mode) for mode in Recompute}
            for s in range(3)]
    fits_all = max(need[0]["full"], need[1]["selective"], need[2]["none"])
    too_little = min(need[0]["selective"], need[1]["none"])
    assert fits_all < too_little, "the shape must separate the three stages"
    profile = replace(profile, memory_bytes=(fits_all + too_little) / 2)

    fitted = est.recomputed_to_fit(profile, plan)
    assert modes(fitted) == [["full", "selective", "none"]]
    assert not est.fits(profile, plan) and est.fits(profile, fitted)
    assert max(est.memory_per_device(profile, fitted).values()) == pytest.approx(fits_all)
    assert est.estimate_step(profile, fitted).t_step > est.estimate_step(profile, plan).t_step
    # full recomputation reruns each layer's forward in its backward; selective reruns no matmul (no FLOPs)
    plain = est.stage_cost(profile, 2, first=True, last=False)
    assert est.stage_cost(profile.under("full"), 2, first=True, last=False) == \
        pytest.approx((plain[0], plain[1] + 2 * profile.layer_fwd_s))
    assert est.stage_cost(profile.under("selective"), 2, first=True, last=False) == pytest.approx(plain)

    short = replace(profile, memory_bytes=need[0]["full"] * 0.99)
    refused = est.recomputed_to_fit(short, plan)
    assert modes(refused)[0][0] == "full" and not est.fits(short, refused), "even full recomputation is not enough"


def test_a_recovery_that_fits_only_recomputing_is_feasible_and_one_that_does_not_fit_even_so_is_refused():
    """dp2 × pp2, one micro-batch per pipeline; device 1 (pipe0's last stage) dies. Rerouting doubles what device 3
    keeps in flight: within what the running plan needs, it fits only recomputing fully, on that stage and the one
    it serves."""
    profile = heavy_profile(4)
    plan = even_plan(dp=2, pp=2, tp=1, n_layers=4, global_batch=8, micro_batch=4)
    running = max(stage_bytes(profile, 2, first=s == 0, last=s == 1, in_flight=1, mode="none") for s in (0, 1))
    host = {mode: stage_bytes(profile, 2, first=False, last=True, in_flight=2, mode=mode) for mode in Recompute}
    assert host["full"] <= running < host["selective"]
    policy = PolicyConfig(name="reroute", fixed_d_s=1e6)

    def reroute(memory: float):
        tight = replace(profile, memory_bytes=memory)
        return next(c for c in decide(tight, plan, {1}, policy=policy, planner=Planner(tight)).candidates
                    if c.name == "reroute")

    chosen = reroute(running)
    assert chosen.feasible, chosen.why
    assert modes(chosen.plan) == [["none", "full"], ["none", "full"]]
    assert chosen.t_step > est.estimate_step(profile, reroute_plan(plan, {1})).t_step
    refused = reroute(host["full"] * 0.99)
    assert not refused.feasible and refused.why.startswith("needs ")


def test_when_nothing_fits_as_the_job_runs_the_planner_plans_with_recomputation():
    """Two devices, six layers: one pipeline of two stages or two of one. A memory under every such plan's peak
    without recomputation and above some plan's with full recomputation."""
    profile = heavy_profile(6)

    def peak(mode: str) -> float:
        one_stage = stage_bytes(profile, 6, first=True, last=True, in_flight=1, mode=mode)
        two_stages = min(max(stage_bytes(profile, a, first=True, last=False, in_flight=2, mode=mode),
                             stage_bytes(profile, 6 - a, first=False, last=True, in_flight=1, mode=mode))
                         for a in range(1, 6))
        return min(one_stage, two_stages)

    assert peak("full") < peak("none")
    tight = replace(profile, memory_bytes=(peak("full") + peak("none")) / 2)
    result = Planner(tight).best([(0,), (1,)], n_micro=4, micro_batch_size=4)
    assert est.fits(tight, result.plan) and any(mode != "none" for row in modes(result.plan) for mode in row)
    assert result.estimate == est.estimate_step(tight, result.plan)
    with pytest.raises(PlanError, match="no plan for 2 stage units"):
        Planner(replace(profile, memory_bytes=peak("full") * 0.99)).best([(0,), (1,)], n_micro=4, micro_batch_size=4)


def test_a_re_formed_group_that_fits_only_recomputing_is_weighed():
    """dp2 × tp4 on one stage; device 5 dies and its three survivors re-form their pipeline at TP 2, each holding
    twice the state and activations: in a memory the other pipeline fits as it is, it fits only recomputing fully."""
    profile = heavy_profile(4, tp=4)
    plan = even_plan(dp=2, pp=1, tp=4, n_layers=4, global_batch=8, micro_batch=4)
    kept = max(est.memory_per_device(profile, plan).values())
    tp2 = plan_from_spec([{"layers": [4], "micro_batches": 1}] * 2, tp=2, n_layers=4, global_batch=8, micro_batch=4)
    survivors = {mode: est.memory_per_device(profile, recomputing(tp2, lambda j, s, mode=mode: mode))[0]
                 for mode in Recompute}
    memory = max(kept, survivors["full"])
    assert memory < survivors["selective"]
    (reformed,) = reform_plans(replace(profile, memory_bytes=memory), plan, {5}, tp_sizes=(2, 4))
    assert [st.tp for st in reformed.pipelines[1].stages] == [2] and modes(reformed) == [["none"], ["full"]]
    with pytest.raises(PlanError, match="within memory"):
        reform_plans(replace(profile, memory_bytes=survivors["full"] * 0.99), plan, {5}, tp_sizes=(2, 4))


def test_a_plan_with_mixed_recomputation_travels_and_reads():
    """Through the control plane's encoding (every generation's plan), rerouted stages included, and in its summary."""
    plan = plan_from_spec([{"layers": [2, 2], "micro_batches": 2, "recompute": ["full", "none"]},
                           {"layers": [2, 2], "micro_batches": 2},
                           {"layers": [1, 2, 1], "micro_batches": 2, "recompute": ["none", "none", "full"]}],
                          tp=1, n_layers=4, global_batch=6, micro_batch=1, recompute=Recompute.selective)
    assert modes(plan) == [["full", "none"], ["selective", "selective"], ["none", "none", "full"]]
    assert plan.describe().splitlines() == ["pipe0 [0:2 rc=full|2:4] tp1 ×2mb on 0,1",
                                            "pipe1 [0:2 rc=selective|2:4 rc=selective] tp1 ×2mb on 2,3",
                                            "pipe2 [0:1|1:3|3:4 rc=full] tp1 ×2mb on 4,5,6"]
    for sent in (plan, reroute_plan(plan, {1})):
        got = codec.decode(codec.encode(sent))
        assert got == sent and all(type(st.recompute) is Recompute for p in got.pipelines for st in p.stages)
    with pytest.raises(PlanError, match=r"parallel.pipelines\[0\].recompute=\['full'\]: give one of none, selective"):
        plan_from_spec([{"layers": [2, 2], "micro_batches": 4, "recompute": ["full"]}], tp=1, n_layers=4,
                       global_batch=4, micro_batch=1)


# SMALL_RUN's model on one micro-batch per pipeline (4 × 32 tokens each): a short run of the tiny model.
JOB = ("train.steps=6", "model.dim=64", "model.n_layers=4", "train.global_batch=8", "train.micro_batch=4",
       "train.seq_len=32", "parallel=dp", "train.clip_norm=0.5", "train.lr_schedule=cosine", "train.warmup_steps=2",
       "ckpt=none", "ft.heartbeat_timeout_s=1.0")
DP2_PP2 = ("launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2")  # pipe0 = 0,1; pipe1 = 2,3


@pytest.mark.full
def test_a_pipeline_recomputing_on_one_stage_trains_like_one_that_does_not(tmp_path):
    runs = {name: run_entry("train", tmp_path / name, *JOB, "failure=none", "launcher.nproc_per_node=2",
                            f"parallel.pipelines=[{{layers:[2,2],micro_batches:2,recompute:[{first},none]}}]")
            for name, first in (("mixed", "full"), ("none", "none"))}
    for run in runs.values():
        assert run.returncode == 0, run.stderr
    got, base = runs["mixed"].summary, runs["none"].summary
    assert "pipe0 [0:2 rc=full|2:4]" in got["plan"]
    assert got["sample_ids_digest"] == base["sample_ids_digest"]
    for a, b in zip(got["losses"], base["losses"], strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (got["losses"], base["losses"])


@pytest.mark.full
def test_a_recovery_that_fits_only_recomputing_is_chosen_run_and_trains_the_failure_free_losses(tmp_path):
    """dp2 × pp2; device 1 dies in step 3. Within the memory given (``cluster.memory_gb``: what the running plan
    needs, less than what rerouting needs without recomputation) and re-plans held to pipelines of one or two stages
    (a device holding every layer does not fit), every feasible recovery recomputes; rerouting, chosen, does so on
    the host stage and the stage it serves."""
    reference = run_entry("train", tmp_path / "reference", *JOB, "failure=none", "launcher.nproc_per_node=1")
    assert reference.returncode == 0, reference.stderr
    cfg = compose_command_line([*JOB, *DP2_PP2])
    plan = build_plan(cfg)
    profile = load_profile(model_config(cfg), typed(cfg, "cluster", ClusterConfig), micro_batch=4, seq_len=32)
    rerouted = reroute_plan(plan, {1})
    host = {mode: est.memory_per_device(profile, recomputing(rerouted, lambda j, s, mode=mode: mode))[3]
            for mode in Recompute}
    running = max(est.memory_per_device(profile, plan).values())
    fits = max(running, min(host.values()))
    assert fits < host["none"], "rerouting must not fit without recomputation"
    memory = fits + (host["none"] - fits) / 10  # a device's fixed overheads (cluster.context_gb) dwarf the margin
    least = next(mode for mode in ("selective", "full") if host[mode] <= memory)

    run = run_entry("train", tmp_path / "run", *JOB, *DP2_PP2, f"cluster.memory_gb={memory / 1e9}",
                    "policy.pp_lengths=[1,2]", "failure=kill", "failure.rank=1", "failure.step=3",
                    "failure.phase=forward")
    got = assert_nothing_lost(run, reference)  # the failure-free run's losses, samples and parameters
    (recovery,) = got["recoveries"]
    assert recovery["failed_ranks"] == [1] and recovery["chosen"] == "reroute"
    events = [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text().splitlines()]
    decision = next(e for e in events if e["event"] == "fault")["decision"]
    feasible = {c["name"]: [[st["recompute"] for st in p["stages"]] for p in c["plan"]["pipelines"]]
                for c in decision["candidates"] if c["feasible"]}
    assert all(any(mode != "none" for row in stages for mode in row) for stages in feasible.values()), feasible
    assert feasible["reroute"] == [["none", least], ["none", least]]
