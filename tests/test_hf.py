"""Hugging Face Llama weights in and out, against ``transformers``' own LlamaForCausalLM."""

from __future__ import annotations

import json

import pytest
import torch

from chameleon.data.stream import SampleStream
from chameleon.model.config import ModelConfig
from chameleon.model.hf import HFCheckpointError, check_hf, export_hf, load_hf, model_overrides
from chameleon.model.llama import LLAMA, stage_forward
from conftest import run_entry

transformers = pytest.importorskip("transformers", reason="the round trip needs transformers (pip install '.[test]')")

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16, rope_theta=500.0)
TOLERANCE = 1e-5  # relative, fp32: the two implementations round differently (rotary tables, attention)


def hf_model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=CFG.dim, intermediate_size=CFG.ffn_hidden_dim, num_hidden_layers=CFG.n_layers,
        num_attention_heads=CFG.n_heads, num_key_value_heads=CFG.n_kv_heads, vocab_size=CFG.vocab_size,
        rms_norm_eps=CFG.norm_eps, rope_theta=CFG.rope_theta, max_position_embeddings=64, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to ones: make them count
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def logits(params, tokens):
    return stage_forward(params, CFG, tokens, layers=(0, CFG.n_layers), first=True, last=True)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


TOKENS = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf_model().save_pretrained(path)
    return path


def test_loaded_weights_give_transformers_logits(hf_dir):
    with torch.no_grad():
        expected = hf_model()(TOKENS).logits
    assert relative(logits(load_hf(hf_dir, CFG), TOKENS), expected) <= TOLERANCE


def test_exported_weights_give_our_logits_in_transformers(tmp_path):
    params = LLAMA.init_params(CFG, 7)
    model = transformers.LlamaForCausalLM.from_pretrained(export_hf(params, CFG, tmp_path / "out")).eval()
    with torch.no_grad():
        got = model(TOKENS).logits
    assert relative(got, logits(params, TOKENS)) <= TOLERANCE
    again = load_hf(tmp_path / "out", CFG)
    assert all(torch.equal(again[n], params[n]) for n in params), "load(export(params)) is bit-exact"


def test_mismatched_model_names_every_override(hf_dir):
    wrong = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256)
    with pytest.raises(HFCheckpointError) as err:
        check_hf(hf_dir, wrong)
    message = str(err.value)
    assert "model.dim=32" in message and "model.multiple_of=96" in message and "model.rope_theta=500.0" in message
    assert ModelConfig(**model_overrides(json.loads((hf_dir / "config.json").read_text()))).ffn_hidden_dim == CFG.ffn_hidden_dim


@pytest.mark.full
def test_training_starts_from_and_exports_hugging_face_weights(tmp_path, hf_dir):
    """A tp2 run initialised from the checkpoint (each rank slices its heads out of the un-permuted rows):
    its first loss is transformers' on the same batch, and its exported weights reproduce, in
    transformers, the logits of its final parameters."""
    model_keys = [f"model.{k}={v}" for k, v in (("dim", 32), ("n_layers", 2), ("n_heads", 4), ("n_kv_heads", 2),
                                                ("multiple_of", 16), ("rope_theta", 500.0))]
    run = run_entry(
        "train", tmp_path / "run", *model_keys, f"model.init=hf:{hf_dir}", "train.steps=2", "train.global_batch=4",
        "train.micro_batch=2", "train.seq_len=16", "failure=none", "launcher.nproc_per_node=2", "parallel.dp=1",
        "parallel.pp=1", "parallel.tp=2", "output.export_hf=true",
    )
    assert run.returncode == 0, run.stderr
    stream = SampleStream.from_config(path=None, seq_len=16, seed=0)
    tokens, targets = stream.batch(range(4))
    with torch.no_grad():
        out = hf_model()(tokens).logits
    expected = torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten()).item()
    assert run.summary["losses"][0] == pytest.approx(expected, rel=TOLERANCE)
    final = run.params
    exported = transformers.LlamaForCausalLM.from_pretrained(run.run_dir / "hf").eval()
    with torch.no_grad():
        assert relative(exported(TOKENS).logits, logits(final, TOKENS)) <= TOLERANCE
    assert LLAMA.full_forward_loss(final, CFG, tokens, targets).item() / targets.numel() < expected  # it trained


def test_bad_init_is_a_one_line_config_error(tmp_path):
    run = run_entry("train", tmp_path / "run", "model.init=hf:/nonexistent/ckpt", timeout=60)
    assert run.returncode == 2 and "model.init" in run.stderr and len(run.stderr.strip().splitlines()) == 1
