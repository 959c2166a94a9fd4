"""Hugging Face Llama checkpoints in and out: ``config.json``, safetensors, and the q/k row permutation.

This model follows Meta's rotary convention: dimensions ``2j`` and ``2j+1`` of a head
rotate together. Hugging Face's ``LlamaForCausalLM`` rotates dimension ``j`` with
``j + head_dim/2`` instead, and its checkpoints hold ``wq`` and ``wk`` with the rows
of every head permuted to match (the permutation its Meta→HF conversion applies).
:func:`load_hf` undoes it and :func:`export_hf` applies it, so both directions give
the same logits. Only ``model.arch=llama`` maps: another architecture is refused with
a one-line error. Llama 3's rotary scaling (``rope_type: llama3``) maps to
``model.rope_scaling=llama3`` and its four ``model.rope_*`` numbers; another rope type is
refused. Everything else maps name for name:

===========================  ==========================================
here                         Hugging Face
===========================  ==========================================
``tok_embeddings``           ``model.embed_tokens.weight``
``layers.i.attention.wq``    ``model.layers.i.self_attn.q_proj.weight``
``layers.i.attention.wk/wv`` ``…self_attn.k_proj`` / ``v_proj``
``layers.i.attention.wo``    ``…self_attn.o_proj``
``layers.i.feed_forward.w1`` ``…mlp.gate_proj`` (``w2``: ``down_proj``, ``w3``: ``up_proj``)
``layers.i.attention_norm``  ``…input_layernorm`` (``ffn_norm``: ``post_attention_layernorm``)
``norm`` / ``output``        ``model.norm.weight`` / ``lm_head.weight``
===========================  ==========================================
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from chameleon.model.config import ModelConfig
from chameleon.model.spec import spec_of

HF_PREFIX = "hf:"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"tok_embeddings": "model.embed_tokens.weight", "norm": "model.norm.weight", "output": "lm_head.weight"}


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint that cannot be loaded into this model; the message says what to change."""


def require_llama(cfg: ModelConfig, key: str) -> None:
    """Refuse an architecture other than Llama for ``key`` (the setting that asks for a Hugging Face checkpoint).

    Raises:
        HFCheckpointError: ``cfg.arch`` is not ``llama``.
    """
    if cfg.arch != "llama":
        raise HFCheckpointError(f"{key} reads and writes Hugging Face Llama checkpoints only, but "
                                f"model.arch={cfg.arch}: use model.arch=llama, or model.init=random and "
                                "output.export_hf=false")


def hf_checkpoint(init: str) -> Path | None:
    """The checkpoint directory ``model.init`` names (``hf:PATH``), or ``None`` for ``random``.

    Raises:
        HFCheckpointError: any other value.
    """
    if init == "random":
        return None
    if init.startswith(HF_PREFIX) and init[len(HF_PREFIX):]:
        return Path(init[len(HF_PREFIX):]).expanduser()
    raise HFCheckpointError(f"model.init={init!r}: use random or hf:PATH (a Hugging Face Llama checkpoint directory)")


def hf_name(name: str) -> str:
    """The Hugging Face key of parameter ``name``."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[rest]}.weight"


def to_hf_rows(weight: Tensor, n_heads: int) -> Tensor:
    """Permute a ``wq``/``wk`` weight's rows from adjacent-pair rotary order to Hugging Face's half-split order."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def from_hf_rows(weight: Tensor, n_heads: int) -> Tensor:
    """The inverse of :func:`to_hf_rows`."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _row_heads(cfg: ModelConfig, name: str) -> int | None:
    """Heads whose rows the rotary permutation reorders in ``name`` (None: not permuted)."""
    if name.endswith("attention.wq"):
        return cfg.n_heads
    if name.endswith("attention.wk"):
        return cfg.n_kv_heads
    return None


_ROPE_KEYS = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor", "rope_high_freq_factor": "high_freq_factor",
              "rope_original_max_seq_len": "original_max_position_embeddings"}


def _rope_parameters(cfg: ModelConfig) -> dict:
    """Hugging Face's ``rope_parameters`` (``rope_scaling`` plus ``rope_theta``) of this model."""
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = {hf: getattr(cfg, key) for key, hf in _ROPE_KEYS.items()}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **scaling}


def hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``LlamaForCausalLM`` for this model (fp32, untied embeddings).

    Llama 3 scaling is written both ways ``transformers`` reads it: ``rope_scaling`` (with a
    top-level ``rope_theta``, as Meta's checkpoints have it) and ``rope_parameters``.
    """
    rope = _rope_parameters(cfg)
    scaling = {"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}} if cfg.rope_scaling else {}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, **scaling, "rope_parameters": rope,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def _rope_overrides(config: Mapping) -> dict[str, object]:
    """The ``model.rope_*`` values of a ``config.json``'s ``rope_scaling`` / ``rope_parameters``.

    Raises:
        HFCheckpointError: a rope type other than default and llama3.
    """
    rope = {**(config.get("rope_parameters") or {}), **(config.get("rope_scaling") or {})}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    if kind != "llama3":
        raise HFCheckpointError(f"model.init: the checkpoint's rope_type={kind} cannot be expressed by this Llama "
                                "model (only default and llama3 can)")
    rope.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    absent = [hf for hf in _ROPE_KEYS.values() if rope.get(hf) is None]
    if absent:
        raise HFCheckpointError(f"model.init: the checkpoint's llama3 rope scaling lacks {', '.join(absent)}: "
                                "add it to rope_scaling in its config.json")
    numbers = {k: float(rope[hf]) for k, hf in _ROPE_KEYS.items()}
    numbers["rope_original_max_seq_len"] = int(rope["original_max_position_embeddings"])
    return {"rope_theta": theta, "rope_scaling": "llama3", **numbers}


def model_overrides(config: Mapping) -> dict[str, object]:
    """The ``model.*`` values a Hugging Face ``config.json`` implies.

    The feed-forward width is reached through ``model.multiple_of`` (or
    ``model.ffn_dim_multiplier`` when it is narrower than Llama's ``8·dim/3``).

    Raises:
        HFCheckpointError: an architecture this model cannot express (biases, a rope type other than llama3, …).
    """
    rope = _rope_overrides(config)
    unsupported = {
        "model_type": config.get("model_type", "llama") != "llama",
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(config.get("attention_bias")),
        "mlp_bias": bool(config.get("mlp_bias")),
        "head_dim": config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
        != config["hidden_size"] // config["num_attention_heads"],
    }
    bad = [key for key, is_bad in unsupported.items() if is_bad]
    if bad:
        raise HFCheckpointError(f"model.init: the checkpoint's {', '.join(bad)} cannot be expressed by this Llama model")
    dim, ffn = config["hidden_size"], config["intermediate_size"]
    base = int(2 * 4 * dim / 3)
    width: dict[str, object] = {"multiple_of": ffn, "ffn_dim_multiplier": None}
    if ffn < base:
        width = {"multiple_of": 1, "ffn_dim_multiplier": ffn / base}
        if ModelConfig(dim=dim, **width).ffn_hidden_dim != ffn:
            raise HFCheckpointError(f"model.init: intermediate_size={ffn} cannot be expressed for hidden_size={dim}")
    return {
        "dim": dim, "n_layers": config["num_hidden_layers"], "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
        "vocab_size": config["vocab_size"], "norm_eps": config["rms_norm_eps"],
        **rope, **width,
    }


def check_hf(path: Path, cfg: ModelConfig) -> None:
    """Check that the checkpoint at ``path`` fits ``cfg``.

    Raises:
        HFCheckpointError: naming the mismatched ``model.*`` keys and the overrides that fix them.
    """
    require_llama(cfg, "model.init")
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise HFCheckpointError(f"model.init=hf:{path}: no config.json there (a Hugging Face checkpoint directory)")
    if not (Path(path) / WEIGHTS).is_file() and not (Path(path) / INDEX).is_file():
        raise HFCheckpointError(f"model.init=hf:{path}: neither {WEIGHTS} nor {INDEX} is there")
    wanted = model_overrides(json.loads(config_file.read_text()))
    shape = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")
    differ = [k for k in shape if getattr(cfg, k) != wanted[k]]
    if cfg.ffn_hidden_dim != ModelConfig(**{k: wanted[k] for k in ("dim", "multiple_of", "ffn_dim_multiplier")}).ffn_hidden_dim:
        differ += ["multiple_of", "ffn_dim_multiplier"]
    differ += [k for k in ("norm_eps", "rope_theta", "rope_scaling") if getattr(cfg, k) != wanted[k]]
    if wanted["rope_scaling"] is not None:
        differ += [k for k in _ROPE_KEYS if getattr(cfg, k) != wanted[k]]
    if differ:
        fix = " ".join(f"model.{k}={'null' if wanted[k] is None else wanted[k]}" for k in differ)
        raise HFCheckpointError(f"model.init=hf:{path} does not match the model: set {fix}")


def load_hf(path: Path, cfg: ModelConfig, *, names: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Parameters ``names`` (all when None) from the Hugging Face checkpoint at ``path``, fp32, on the CPU.

    Reads ``model.safetensors`` or the shards a ``model.safetensors.index.json`` lists,
    opening only the files that hold a wanted tensor. Tied embeddings (no
    ``lm_head.weight``) give ``output`` a copy of ``tok_embeddings``.

    Raises:
        HFCheckpointError: the checkpoint does not fit ``cfg`` (see :func:`check_hf`) or lacks a tensor.
    """
    path = Path(path)
    check_hf(path, cfg)
    shapes = spec_of(cfg).param_shapes(cfg)
    wanted = list(shapes if names is None else names)
    if (path / INDEX).is_file():
        files = json.loads((path / INDEX).read_text())["weight_map"]
    else:
        with safe_open(path / WEIGHTS, framework="pt") as f:
            files = dict.fromkeys(f.keys(), WEIGHTS)
    keys = {n: hf_name(n) for n in wanted}
    if "output" in keys and keys["output"] not in files:
        keys["output"] = hf_name("tok_embeddings")  # tied embeddings
    missing = [k for k in keys.values() if k not in files]
    if missing:
        raise HFCheckpointError(f"model.init=hf:{path} lacks {missing[0]} (and {len(missing) - 1} more)")
    by_file: dict[str, list[str]] = {}
    for name, key in keys.items():
        by_file.setdefault(files[key], []).append(name)
    out: dict[str, Tensor] = {}
    for file, file_names in by_file.items():
        with safe_open(path / file, framework="pt") as f:
            for name in file_names:
                tensor = f.get_tensor(keys[name]).to(torch.float32)
                if tuple(tensor.shape) != shapes[name]:
                    raise HFCheckpointError(f"model.init=hf:{path}: {keys[name]} has shape {tuple(tensor.shape)}, "
                                            f"the model's {name} needs {shapes[name]}")
                heads = _row_heads(cfg, name)
                out[name] = from_hf_rows(tensor, heads) if heads else tensor
    return {n: out[n] for n in wanted}


def export_hf(params: Mapping[str, Tensor], cfg: ModelConfig, path: Path) -> Path:
    """Write ``params`` (every parameter of ``cfg``) as a Hugging Face checkpoint in directory ``path``.

    Returns:
        ``path``, holding ``config.json`` and ``model.safetensors`` (fp32), loadable with
        ``LlamaForCausalLM.from_pretrained(path)``.
    """
    require_llama(cfg, "output.export_hf")
    shapes = spec_of(cfg).param_shapes(cfg)
    if set(params) != set(shapes):
        raise ValueError(f"export_hf needs every parameter of the model; missing {sorted(set(shapes) - set(params))}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name in shapes:
        weight = params[name].detach().to("cpu", torch.float32)
        heads = _row_heads(cfg, name)
        tensors[hf_name(name)] = (to_hf_rows(weight, heads) if heads else weight).contiguous()
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    return path
