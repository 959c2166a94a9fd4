"""Hugging Face Llama weights in and out, against ``transformers``' own LlamaForCausalLM."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from chameleon.config import DataConfig
from chameleon.data.stream import open_streams
from chameleon.model.config import ModelConfig
from chameleon.model.hf import HFCheckpointError, check_hf, export_hf, load_hf, model_overrides
from chameleon.model.llama import LLAMA, rope_frequencies, stage_forward
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


# Llama 3: grouped-query attention (4 query heads per kv head) and Llama 3.1's rotary scaling. head_dim 16 at
# theta 500 gives wavelengths 6.3 (kept: below 32/4), 13 and 28 (blended) and 59…1167 (÷ 4); the logits are
# compared at 48 tokens, past the 32 the scaling calls the pre-training context.
LLAMA3 = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=1, vocab_size=256, multiple_of=16, rope_theta=500.0,
                     rope_scaling="llama3", rope_factor=4.0, rope_original_max_seq_len=32, max_seq_len=64)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
LONG_TOKENS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(6))


def hf_llama3(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=LLAMA3.dim, intermediate_size=LLAMA3.ffn_hidden_dim, num_hidden_layers=LLAMA3.n_layers,
        num_attention_heads=LLAMA3.n_heads, num_key_value_heads=LLAMA3.n_kv_heads, vocab_size=LLAMA3.vocab_size,
        rms_norm_eps=LLAMA3.norm_eps, rope_theta=LLAMA3.rope_theta, rope_scaling=dict(LLAMA3_ROPE),
        max_position_embeddings=LLAMA3.max_seq_len, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def llama3_logits(params, cfg=LLAMA3):
    return stage_forward(params, cfg, LONG_TOKENS, layers=(0, cfg.n_layers), first=True, last=True)


@pytest.mark.parametrize("shape", [
    {"head_dim": 128, "theta": 500000.0, "rope": {"factor": 8.0, "original_max_position_embeddings": 8192}},
    {"head_dim": 16, "theta": 500.0, "rope": {"factor": 4.0, "original_max_position_embeddings": 32}},
], ids=["llama3.1-8b", "tiny"])
def test_llama3_frequencies_are_transformers(shape):
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    rope = {"rope_type": "llama3", "rope_theta": shape["theta"], "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            **shape["rope"]}
    config = transformers.LlamaConfig(hidden_size=shape["head_dim"], num_attention_heads=1, rope_parameters=rope)
    expected, attention_factor = _compute_llama3_parameters(config, "cpu")
    scaling = (rope["factor"], 1.0, 4.0, rope["original_max_position_embeddings"])
    got = rope_frequencies(shape["head_dim"], shape["theta"], scaling)
    assert attention_factor == 1.0
    torch.testing.assert_close(got, expected.double(), rtol=1e-6, atol=0)  # transformers computes in fp32


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    hf_llama3().save_pretrained(path)
    return path


def test_llama3_round_trip_gives_transformers_logits(llama3_dir, tmp_path):
    overrides = model_overrides(json.loads((llama3_dir / "config.json").read_text()))
    assert {k: overrides[k] for k in ("n_kv_heads", "rope_theta", "rope_scaling", "rope_factor",
                                      "rope_original_max_seq_len")} == {
        "n_kv_heads": 1, "rope_theta": 500.0, "rope_scaling": "llama3", "rope_factor": 4.0,
        "rope_original_max_seq_len": 32}
    params = load_hf(llama3_dir, LLAMA3)
    with torch.no_grad():
        expected = hf_llama3()(LONG_TOKENS).logits
    assert relative(llama3_logits(params), expected) <= TOLERANCE
    unscaled = dataclasses.replace(LLAMA3, rope_scaling=None)
    assert relative(llama3_logits(params, unscaled), expected) > 100 * TOLERANCE, "the scaling matters at 48 tokens"

    exported = export_hf(params, LLAMA3, tmp_path / "out")
    config = json.loads((exported / "config.json").read_text())
    assert config["rope_scaling"] == LLAMA3_ROPE and config["rope_theta"] == 500.0
    model = transformers.LlamaForCausalLM.from_pretrained(exported).eval()
    assert model.config.rope_parameters == {**LLAMA3_ROPE, "rope_theta": 500.0}
    with torch.no_grad():
        assert relative(model(LONG_TOKENS).logits, llama3_logits(params)) <= TOLERANCE
    again = load_hf(exported, LLAMA3)
    assert all(torch.equal(again[n], params[n]) for n in params)


def test_llama3_checkpoint_names_its_rope_overrides_and_other_ropes_are_refused(llama3_dir):
    plain = dataclasses.replace(LLAMA3, rope_scaling=None, rope_original_max_seq_len=8192)
    with pytest.raises(HFCheckpointError) as err:
        check_hf(llama3_dir, plain)
    assert "model.rope_scaling=llama3" in str(err.value) and "model.rope_original_max_seq_len=32" in str(err.value)
    config = json.loads((llama3_dir / "config.json").read_text())
    config.pop("rope_parameters", None)
    for rope in ({"rope_type": "yarn", "factor": 4.0}, {"type": "linear", "factor": 2.0}):
        with pytest.raises(HFCheckpointError, match=f"rope_type={rope.get('rope_type', rope.get('type'))} cannot be "
                                                    "expressed") as err:
            model_overrides({**config, "rope_scaling": rope})
        assert "\n" not in str(err.value)


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
    stream = open_streams(DataConfig(), seq_len=16, seed=0).train
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
