"""The model spec: the GPT architecture against an independent ``torch.nn`` reference, split, sharded and trained."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from chameleon import cli, train
from chameleon.config import ConfigError
from chameleon.layout.plan import even_plan
from chameleon.layout.spec import device_holdings
from chameleon.model.config import ModelConfig
from chameleon.model.gpt import GPT
from chameleon.model.llama import LLAMA
from chameleon.model.spec import spec_of
from conftest import SMALL_RUN, assert_nothing_lost, run_entry, run_ranks

CFG = ModelConfig(arch="gpt", dim=32, n_layers=3, n_heads=4, n_kv_heads=4, vocab_size=64, max_seq_len=24)
BATCH, SEQ = 2, 16
RTOL, ATOL = 1e-5, 1e-6


class RefAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq, self.wv, self.wo = (nn.Linear(cfg.dim, cfg.dim) for _ in range(3))
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.n_heads)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        return self.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d))


class RefMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.gelu(self.w1(x), approximate="tanh"))


class RefBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = RefAttention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = RefMLP(cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class RefGPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(RefBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def ours(ref_name: str) -> str:
    """The spec's name of a reference parameter (embeddings and head drop ``.weight``)."""
    bare = ref_name.removesuffix(".weight")
    return bare if bare in ("tok_embeddings", "pos_embeddings", "output") else ref_name


def random_params(seed: int) -> dict[str, torch.Tensor]:
    """GPT parameters far from the init (noise of std 0.1, biases included) so every path matters."""
    gen = torch.Generator().manual_seed(seed)
    init = GPT.init_params(CFG, seed)
    return {n: (t + 0.1 * torch.randn(t.shape, generator=gen)).requires_grad_() for n, t in init.items()}


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(CFG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return seq[:, :-1], seq[:, 1:]


def mean_loss_grads(params: dict[str, torch.Tensor], loss: torch.Tensor, targets: torch.Tensor) -> dict:
    """Backward of the mean loss, as the runtime takes it; the gradients by name."""
    (loss / targets.numel()).backward()
    return {n: t.grad for n, t in params.items()}


def assert_close_dicts(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_registry_names_each_architecture_and_refuses_others() -> None:
    assert spec_of(ModelConfig()) is LLAMA and spec_of(CFG) is GPT
    with pytest.raises(ValueError, match=r"model\.arch='bert': use one of gpt, llama"):
        spec_of(ModelConfig(arch="bert"))
    for overrides, expected in ((["model.arch=bert"], "model.arch='bert': use one of gpt, llama"),
                                (["model=gpt_tiny", "output.export_hf=true"], "output.export_hf reads and writes")):
        with pytest.raises(ConfigError) as err:
            train._prepare(cli.compose_command_line(overrides))
        assert expected in cli.one_line(err.value) and "\n" not in cli.one_line(err.value)


def test_gpt_tree_and_init() -> None:
    shapes = GPT.param_shapes(CFG)
    assert list(shapes)[:2] == ["tok_embeddings", "pos_embeddings"]
    assert list(shapes)[-3:] == ["norm.weight", "norm.bias", "output"]
    layer, first, last = GPT.unit_params(CFG)
    assert layer == 12 * 32 * 32 + 12 * 32 and first == (64 + 24) * 32 and last == 2 * 32 + 64 * 32
    assert GPT.param_count(CFG) == 3 * layer + first + last
    init = GPT.init_params(CFG, 0)
    assert torch.equal(init["layers.1.attention.wq.bias"], torch.zeros(32))
    assert torch.equal(init["norm.weight"], torch.ones(32))
    assert torch.equal(GPT.init_params(CFG, 0, names=["output"])["output"], init["output"])


def test_gpt_forward_matches_nn_reference() -> None:
    params = random_params(1)
    tokens, targets = batch()
    ref = RefGPT(CFG)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(params[ours(name)])
    logits = GPT.stage_forward(params, CFG, tokens, layers=(0, CFG.n_layers), first=True, last=True)
    ref_logits = ref(tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)

    loss = GPT.full_forward_loss(params, CFG, tokens, targets)
    ref_loss = nn.functional.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()) * targets.numel()
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    ref_grads = {ours(n): g for n, g in mean_loss_grads(dict(ref.named_parameters()), ref_loss, targets).items()}
    assert_close_dicts(mean_loss_grads(params, loss, targets), {n: ref_grads[n] for n in params})


def test_gpt_pipeline_split_matches_full_forward() -> None:
    tokens, targets = batch(seed=3)
    full = random_params(2)
    full_loss = GPT.full_forward_loss(full, CFG, tokens, targets)
    full_grads = mean_loss_grads(full, full_loss, targets)

    split = {n: t.detach().clone().requires_grad_() for n, t in full.items()}
    s0 = {n: split[n] for n in GPT.stage_param_names(CFG, (0, 1), first=True, last=False)}
    s1 = {n: split[n] for n in GPT.stage_param_names(CFG, (1, 3), first=False, last=True)}
    assert list(s0) + list(s1) == list(split)
    sent = GPT.stage_forward(s0, CFG, tokens, layers=(0, 1), first=True, last=False)
    received = sent.detach().requires_grad_()  # activations cross the stage boundary detached
    loss = GPT.stage_forward(s1, CFG, received, layers=(1, 3), first=False, last=True, targets=targets)
    (loss / targets.numel()).backward()
    sent.backward(received.grad)

    torch.testing.assert_close(loss, full_loss, rtol=RTOL, atol=ATOL)
    assert_close_dicts({n: t.grad for n, t in split.items()}, full_grads)
    with pytest.raises(ValueError):
        GPT.stage_forward(s0, CFG, tokens, layers=(0, 1), first=True, last=False, targets=targets)


TP = 2


def tp_regions() -> dict[int, dict]:
    """Each TP rank's region of every tensor, from the spec's rules through the layout code."""
    plan = even_plan(dp=1, pp=1, tp=TP, n_layers=CFG.n_layers, global_batch=BATCH, micro_batch=BATCH)
    return device_holdings(GPT.layout(CFG, plan))


def local(tensor: torch.Tensor, region) -> torch.Tensor:
    return tensor[tuple(slice(a, b) for a, b in region)]


def _tp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        regions = tp_regions()[rank]
        shards = {n: local(t, regions[n]).detach().clone().requires_grad_() for n, t in random_params(5).items()}
        tokens, targets = batch(seed=6)
        loss = GPT.stage_forward(shards, CFG, tokens, layers=(0, CFG.n_layers), first=True, last=True, targets=targets,
                                 tp=GPT.tp_ops(dist.all_reduce))
        torch.save({"loss": loss.detach(), "grads": mean_loss_grads(shards, loss, targets)}, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.full  # over 5 s: the full suite
def test_gpt_tensor_parallel_gloo_matches_single_process(tmp_path) -> None:
    """Two gloo ranks holding the shards the spec's rules give them compute the unsharded loss and gradients."""
    out_path = str(tmp_path / "tp")
    run_ranks(_tp_worker, TP, out_path)

    full = random_params(5)
    tokens, targets = batch(seed=6)
    loss = GPT.full_forward_loss(full, CFG, tokens, targets)
    grads = mean_loss_grads(full, loss, targets)
    regions = tp_regions()
    assert regions[0]["layers.0.attention.wq.weight"] == ((0, 16), (0, 32))
    assert regions[1]["layers.0.feed_forward.w2.weight"] == ((0, 32), (64, 128))
    assert regions[1]["layers.0.feed_forward.w2.bias"] == ((0, 32),)
    for rank in range(TP):
        result = torch.load(f"{out_path}.{rank}")
        torch.testing.assert_close(result["loss"], loss.detach(), rtol=RTOL, atol=ATOL)
        assert_close_dicts(result["grads"], {n: local(g, regions[rank][n]) for n, g in grads.items()})


GPT_RUN = ("model=gpt_tiny", *SMALL_RUN)  # the tiny GPT trained as the layout tests train Llama


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory):
    run = run_entry("train", tmp_path_factory.mktemp("gpt_ref") / "run", *GPT_RUN, "launcher.nproc_per_node=1")
    assert run.returncode == 0, run.stderr
    return run


@pytest.mark.full
@pytest.mark.parametrize("faults", [(), ("failure=kill", "failure.rank=3", "failure.step=2", "failure.phase=forward")],
                         ids=["clean", "kill"])
def test_gpt_trains_on_dp2xpp2_as_in_one_process(tmp_path, gpt_reference, faults):
    run = run_entry("train", tmp_path / "run", *GPT_RUN, "launcher.nproc_per_node=4", "parallel.dp=2", "parallel.pp=2",
                    *faults)
    got = assert_nothing_lost(run, gpt_reference)  # the same samples, losses and parameters (within 1e-5)
    assert got["steps_completed"] == 6 and len(got["recoveries"]) == (1 if faults else 0)
    assert list(run.params) == list(GPT.param_shapes(ModelConfig(arch="gpt", dim=64, n_kv_heads=4, max_seq_len=256)))
