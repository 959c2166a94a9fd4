"""Tests of the functional Llama (2, and 3's rotary scaling) against an independent ``torch.nn`` reference."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from chameleon.model.config import ModelConfig
from chameleon.model import llama
from chameleon.model.llama import LLAMA, param_shapes, stage_forward, stage_param_names
from chameleon.model.spec import MegatronTP
from conftest import run_ranks

GQA = ModelConfig(name="gqa", dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16)
MHA = ModelConfig(name="mha", dim=32, n_layers=3, n_heads=4, n_kv_heads=4, vocab_size=64, multiple_of=16)
# Llama 3.1's scaling with head_dim 8: wavelengths 2π·10⁴^(j/4) = 6.3 (kept), 63 (blended), 628 and 6283 (÷ 4).
LLAMA3 = ModelConfig(name="llama3", dim=32, n_layers=3, n_heads=4, n_kv_heads=1, vocab_size=64, multiple_of=16,
                     rope_scaling="llama3", rope_factor=4.0, rope_original_max_seq_len=64)
LLAMA2_7B = ModelConfig(
    name="llama2-7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, multiple_of=256
)
LLAMA2_70B = ModelConfig(
    name="llama2-70b",
    dim=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    vocab_size=32000,
    multiple_of=4096,
    ffn_dim_multiplier=1.3,
)
BATCH, SEQ = 2, 16
RTOL, ATOL = 1e-5, 1e-6


# ---------------------------------------------------------------- reference model


class RefRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps) * self.weight


def ref_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Meta's Llama 3.1 ``apply_scaling``, one frequency at a time (plain RoPE without ``rope_scaling``)."""
    d = cfg.head_dim
    freqs = [1.0 / cfg.rope_theta ** (i / d) for i in range(0, d, 2)]
    if cfg.rope_scaling is not None:
        old, low, high = cfg.rope_original_max_seq_len, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        low_wavelen, high_wavelen = old / low, old / high
        scaled = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                scaled.append(f)
            elif wavelen > low_wavelen:
                scaled.append(f / cfg.rope_factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                scaled.append((1 - smooth) * f / cfg.rope_factor + smooth * f)
        freqs = scaled
    return torch.tensor(freqs, dtype=torch.float64)


def ref_rotary(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Meta's convention: adjacent pairs as complex numbers times e^(i·pos·freq)."""
    _, s, _, d = x.shape
    freqs = ref_frequencies(cfg)
    rot = torch.polar(torch.ones(s, d // 2, dtype=torch.float64), torch.outer(torch.arange(s), freqs))
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2))
    return torch.view_as_real(xc * rot[None, :, None, :]).flatten(-2).to(x.dtype)


class RefAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, (b, s, _) = self.cfg, x.shape
        hd, group = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
        q = ref_rotary(self.wq(x).view(b, s, cfg.n_heads, hd), cfg)
        k = ref_rotary(self.wk(x).view(b, s, cfg.n_kv_heads, hd), cfg)
        v = self.wv(x).view(b, s, cfg.n_kv_heads, hd)
        # Query head h reads kv head h // group.
        k = k[:, :, [h // group for h in range(cfg.n_heads)]]
        v = v[:, :, [h // group for h in range(cfg.n_heads)]]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        mask = torch.full((s, s), float("-inf")).triu(1)
        probs = torch.softmax(scores + mask, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, cfg.n_heads * hd)
        return self.wo(out)


class RefFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.w1(x)
        return self.w2(a * torch.sigmoid(a) * self.w3(x))


class RefBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RefRMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = RefAttention(cfg)
        self.ffn_norm = RefRMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = RefFeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class RefLlama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(RefBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RefRMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# ---------------------------------------------------------------- helpers


def random_params(
    cfg: ModelConfig, seed: int, *, scale: float = 0.1, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Parameters far from the init (noise of std ``scale``) so every path matters."""
    params = LLAMA.init_params(cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (t + scale * torch.randn(t.shape, generator=gen)).to(dtype).requires_grad_()
        for n, t in params.items()
    }


def batch(cfg: ModelConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def grads(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.grad for n, t in params.items()}


def assert_close_dicts(actual: dict, expected: dict, **tol) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m, n=name: f"{n}: {m}", **tol)


# ---------------------------------------------------------------- shapes and names


def test_param_shapes_canonical_order() -> None:
    names = list(param_shapes(GQA))
    per_layer = ["attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "ffn_norm", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    layers = [f"layers.{i}.{p}" for i in range(3) for p in per_layer]
    expected = ["tok_embeddings", *layers, "norm", "output"]
    assert names == expected
    shapes = param_shapes(GQA)
    assert shapes["layers.2.attention.wk"] == (16, 32)
    assert shapes["layers.0.feed_forward.w2"] == (32, GQA.ffn_hidden_dim)
    assert shapes["output"] == (64, 32)


def test_param_counts_of_real_llama2_shapes() -> None:
    assert LLAMA2_7B.ffn_hidden_dim == 11008
    assert LLAMA.param_count(LLAMA2_7B) == 6_738_415_616
    assert LLAMA2_70B.ffn_hidden_dim == 28672
    assert LLAMA.param_count(LLAMA2_70B) == 68_976_648_192
    assert LLAMA.param_bytes(LLAMA2_70B, bytes_per_elem=2) == 2 * 68_976_648_192


def test_stage_param_names_partition_the_model() -> None:
    stages = [((0, 1), True, False), ((1, 2), False, False), ((2, 3), False, True)]
    parts = [stage_param_names(GQA, r, first=f, last=l) for r, f, l in stages]
    assert sum(parts, []) == list(param_shapes(GQA))
    assert parts[0][0] == "tok_embeddings" and parts[2][-2:] == ["norm", "output"]
    assert stage_param_names(GQA, (1, 1), first=False, last=False) == []
    assert sum(LLAMA.param_bytes(GQA, p) for p in parts) == LLAMA.param_bytes(GQA) == 4 * LLAMA.param_count(GQA)
    with pytest.raises(ValueError):
        stage_param_names(GQA, (2, 4), first=False, last=True)


# ---------------------------------------------------------------- init


def test_init_is_split_independent_and_seeded() -> None:
    full = LLAMA.init_params(GQA, 7)
    names = stage_param_names(GQA, (1, 3), first=False, last=True)
    part = LLAMA.init_params(GQA, 7, names=reversed(names))
    assert list(part) == names
    for n in names:
        assert torch.equal(part[n], full[n])
    other = LLAMA.init_params(GQA, 8, names=["layers.1.attention.wq"])
    assert not torch.equal(other["layers.1.attention.wq"], full["layers.1.attention.wq"])
    assert not torch.equal(full["layers.0.attention.wq"], full["layers.1.attention.wq"])
    half = LLAMA.init_params(GQA, 7, names=["output"], dtype=torch.bfloat16)
    assert torch.equal(half["output"], full["output"].bfloat16())
    with pytest.raises(ValueError):
        LLAMA.init_params(GQA, 7, names=["layers.3.attention.wq"])


def test_init_distribution() -> None:
    cfg = ModelConfig(dim=256, n_layers=8, n_heads=4, n_kv_heads=4, vocab_size=512, multiple_of=64)
    names = ["tok_embeddings", "layers.0.attention.wo", "layers.0.feed_forward.w2", "layers.0.ffn_norm", "norm"]
    p = LLAMA.init_params(cfg, 0, names=names)
    assert p["tok_embeddings"].std().item() == pytest.approx(0.02, rel=0.02)
    scaled = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert p["layers.0.attention.wo"].std().item() == pytest.approx(scaled, rel=0.03)
    assert p["layers.0.feed_forward.w2"].std().item() == pytest.approx(scaled, rel=0.03)
    assert torch.equal(p["layers.0.ffn_norm"], torch.ones(256)) and torch.equal(p["norm"], torch.ones(256))


def test_init_meta_llama2_70b_allocates_nothing() -> None:
    params = LLAMA.init_params(LLAMA2_70B, 0, device="meta", dtype=torch.bfloat16)
    assert all(t.is_meta and t.dtype == torch.bfloat16 for t in params.values())
    assert params["layers.79.feed_forward.w1"].shape == (28672, 8192)
    assert params["layers.0.attention.wk"].shape == (1024, 8192)
    total = sum(t.numel() for t in params.values())
    assert total == LLAMA.param_count(LLAMA2_70B) == pytest.approx(69e9, rel=0.01)


# ---------------------------------------------------------------- forward


# fp32 at the usual tolerances; fp64 with larger weights, where the two must agree exactly.
PRECISIONS = {"fp32": (torch.float32, 0.1, RTOL, ATOL), "fp64": (torch.float64, 0.3, 1e-12, 1e-12)}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("cfg", [GQA, MHA, LLAMA3], ids=["gqa", "mha", "llama3"])
def test_forward_matches_nn_reference(cfg: ModelConfig, precision: str) -> None:
    dtype, scale, rtol, atol = PRECISIONS[precision]
    params = random_params(cfg, 1, scale=scale, dtype=dtype)
    tokens, targets = batch(cfg)
    ref = RefLlama(cfg).to(dtype)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(params[name.removesuffix(".weight")])

    logits = stage_forward(params, cfg, tokens, layers=(0, 3), first=True, last=True)
    ref_logits = ref(tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=rtol, atol=atol)

    loss = LLAMA.full_forward_loss(params, cfg, tokens, targets)
    ref_loss = nn.functional.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()) * targets.numel()
    assert loss.dim() == 0
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)

    # As the runtime does: divide the summed loss once by the number of tokens.
    (loss / targets.numel()).backward()
    (ref_loss / targets.numel()).backward()
    ref_grads = {n.removesuffix(".weight"): p.grad for n, p in ref.named_parameters()}
    assert_close_dicts(grads(params), {n: ref_grads[n] for n in params}, rtol=rtol, atol=atol)


def test_llama3_frequencies_keep_blend_and_scale() -> None:
    plain = llama.rope_frequencies(LLAMA3.head_dim, LLAMA3.rope_theta)
    scaled = llama.rope_frequencies(LLAMA3.head_dim, LLAMA3.rope_theta, LLAMA3.rope_scaling_params)
    torch.testing.assert_close(scaled, ref_frequencies(LLAMA3), rtol=1e-14, atol=0)
    assert scaled[0] == plain[0] and plain[1] / 4 < scaled[1] < plain[1]
    torch.testing.assert_close(scaled[2:], plain[2:] / 4, rtol=1e-14, atol=0)
    for bad, key in (({"rope_scaling": "yarn"}, "model.rope_scaling='yarn': use null"),
                     ({"rope_scaling": "llama3", "rope_low_freq_factor": 4.0}, "model.rope_low_freq_factor=4.0")):
        with pytest.raises(ValueError, match=key):
            ModelConfig(**bad)


class SdpaCalls(torch.overrides.TorchFunctionMode):
    """Records the kv head count and ``enable_gqa`` of every SDPA call, and every ``repeat_interleave``."""

    def __init__(self) -> None:
        super().__init__()
        self.sdpa: list[tuple[int, bool]] = []
        self.repeats = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.scaled_dot_product_attention:
            self.sdpa.append((args[1].shape[1], kwargs.get("enable_gqa", False)))
        self.repeats += getattr(func, "__name__", "") == "repeat_interleave"
        return func(*args, **kwargs)


def test_grouped_query_attention_shares_kv_heads_or_repeats_them(monkeypatch) -> None:
    """On the CPU the kernel reads the shared kv heads in place; where it cannot (CUDA's fp32, say) they are
    repeated, with the same loss and gradients."""
    cfg = GQA
    tokens, targets = batch(cfg, seed=4)
    losses, grad_sets = [], []
    for shares in (True, False):
        monkeypatch.setattr(llama, "_reads_grouped_kv", lambda q, k, v, shares=shares: shares)
        params = random_params(cfg, 3)
        with SdpaCalls() as calls:
            loss = LLAMA.full_forward_loss(params, cfg, tokens, targets)
        (loss / targets.numel()).backward()
        expected = (cfg.n_kv_heads, True) if shares else (cfg.n_heads, False)
        assert calls.sdpa == [expected] * cfg.n_layers and calls.repeats == (0 if shares else 2 * cfg.n_layers)
        losses.append(loss.detach())
        grad_sets.append(grads(params))
    torch.testing.assert_close(losses[0], losses[1], rtol=RTOL, atol=ATOL)
    assert_close_dicts(grad_sets[0], grad_sets[1], rtol=RTOL, atol=ATOL)
    monkeypatch.undo()
    assert llama._reads_grouped_kv(*(torch.zeros(1, h, 2, 8) for h in (4, 2, 2)))


def test_stage_split_matches_full_forward() -> None:
    cfg = GQA
    tokens, targets = batch(cfg, seed=3)
    full = random_params(cfg, 2)
    full_loss = LLAMA.full_forward_loss(full, cfg, tokens, targets)
    (full_loss / targets.numel()).backward()

    split = {n: t.detach().clone().requires_grad_() for n, t in full.items()}
    s0 = {n: split[n] for n in stage_param_names(cfg, (0, 1), first=True, last=False)}
    s1 = {n: split[n] for n in stage_param_names(cfg, (1, 3), first=False, last=True)}
    # As in a pipeline: activations cross the stage boundary detached.
    sent = stage_forward(s0, cfg, tokens, layers=(0, 1), first=True, last=False)
    assert sent.shape == (BATCH, SEQ, cfg.dim)
    received = sent.detach().requires_grad_()
    loss = stage_forward(s1, cfg, received, layers=(1, 3), first=False, last=True, targets=targets)
    (loss / targets.numel()).backward()
    sent.backward(received.grad)

    torch.testing.assert_close(loss, full_loss, rtol=RTOL, atol=ATOL)
    assert_close_dicts(grads(split), grads(full), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError):
        stage_forward(s0, cfg, tokens, layers=(0, 1), first=True, last=False, targets=targets)


# ---------------------------------------------------------------- tensor parallel

COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")


def shard_dim(name: str) -> int | None:
    """Megatron layout: column-parallel on dim 0, row-parallel on dim 1, else replicated."""
    if name.endswith(COLUMN):
        return 0
    if name.endswith(ROW):
        return 1
    return None


def _tp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        cfg = GQA
        full = random_params(cfg, 5)
        local = {}
        for name, t in full.items():
            d = shard_dim(name)
            local[name] = (t if d is None else t.detach().chunk(world, d)[rank].clone()).requires_grad_()
        tokens, targets = batch(cfg, seed=6)
        loss = stage_forward(
            local, cfg, tokens, layers=(0, cfg.n_layers), first=True, last=True, targets=targets,
            tp=MegatronTP(dist.all_reduce),
        )
        (loss / targets.numel()).backward()
        gathered = {}
        for name, t in local.items():
            d = shard_dim(name)
            if d is None:
                gathered[name] = t.grad
            else:
                parts = [torch.empty_like(t.grad) for _ in range(world)]
                dist.all_gather(parts, t.grad.contiguous())
                gathered[name] = torch.cat(parts, d)
        torch.save({"loss": loss.detach(), "grads": gathered}, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_gloo_matches_single_process(tmp_path) -> None:
    world, out_path = 2, str(tmp_path / "tp")
    run_ranks(_tp_worker, world, out_path)

    cfg = GQA
    full = random_params(cfg, 5)
    tokens, targets = batch(cfg, seed=6)
    loss = LLAMA.full_forward_loss(full, cfg, tokens, targets)
    (loss / targets.numel()).backward()
    for r in range(world):
        result = torch.load(f"{out_path}.{r}")
        torch.testing.assert_close(result["loss"], loss.detach(), rtol=RTOL, atol=ATOL)
        assert_close_dicts(result["grads"], grads(full), rtol=RTOL, atol=ATOL)
