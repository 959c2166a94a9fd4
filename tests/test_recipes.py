"""The recipes: those of real models train (no fault injected), the default run keeps its demonstration; Llama-3.1-8B
composes to its real shapes, plans on an analytic cluster and is refused here with the memory it needs."""

from __future__ import annotations

import re

import pytest
import torch

from chameleon import cli, plan, train
from chameleon.config import RECIPES_DIR, ConfigError, build_plan, model_config, world_size
from chameleon.model.llama import LLAMA

REAL = ("llama7b", "llama13b", "llama70b", "llama3_8b")


def compose(*overrides: str):
    return cli.compose_command_line(list(overrides))


def test_every_recipe_says_whether_it_trains_or_demonstrates():
    assert {p.stem for p in RECIPES_DIR.glob("*.yaml")} == {*REAL, "tiny"}


@pytest.mark.parametrize("recipe", REAL)
def test_real_recipes_inject_no_fault(recipe):
    assert compose(f"+recipe={recipe}").failure.kind == "none"
    assert compose(f"+recipe={recipe}", "failure=kill").failure.kind == "kill"  # a demonstration, on request


@pytest.mark.parametrize("overrides", [(), ("+recipe=tiny",)], ids=["bare", "tiny"])
def test_the_default_run_keeps_its_demonstration(overrides):
    failure = compose(*overrides).failure
    assert (failure.kind, failure.rank, failure.step) == ("kill", 1, 50)


def test_llama3_8b_composes_plans_and_is_refused_here_with_the_memory_it_needs():
    cfg = compose("+recipe=llama3_8b")
    model = model_config(cfg)
    assert (model.ffn_hidden_dim, model.head_dim, model.rope_scaling_params) == (14336, 128, (8.0, 1.0, 4.0, 8192))
    assert LLAMA.param_count(model) == 8_030_261_248
    params = LLAMA.init_params(model, 0, device="meta", dtype=torch.bfloat16)
    assert params["tok_embeddings"].shape == params["output"].shape == (128_256, 4096)
    assert params["layers.31.attention.wk"].shape == (1024, 4096)
    assert len(build_plan(cfg).devices) == world_size(cfg.launcher) == 32
    costs = LLAMA.memory_costs(model, micro_batch=1, seq_len=8192, dtype="bf16")
    assert costs.acts.last == 8192 * (2 * (4096 + 128_256) + 4 * 128_256)  # the head's logits dominate

    report = plan.report(compose("+recipe=llama3_8b", "cluster=a100_32", "plan.failed=[5]"))
    peak = float(re.search(r"peak ([\d.]+) GB", report).group(1))
    assert peak < 80 and "choice: " in report  # fits an 80 GB A100 by the analytic profile

    with pytest.raises(ConfigError) as err:
        train._prepare(cfg)
    line = cli.one_line(err.value)
    assert line.startswith("model 'llama3_8b' needs ") and "GiB on its busiest device" in line and "\n" not in line
