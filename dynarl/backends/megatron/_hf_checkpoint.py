"""Hugging Face checkpoint directories in and out of the Megatron trainer.

A directory holds ``config.json`` and the weights: ``model.safetensors`` or
``pytorch_model.bin``, or shards listed by ``model.safetensors.index.json`` /
``pytorch_model.bin.index.json`` (torch files are read with ``weights_only=True``).
Names and layouts are mapped with the weight sync's map (:func:`.sync.to_hf` /
:func:`.sync.from_hf`), so a checkpoint, an SGLang engine and the trainer agree.

- :func:`model_config_from_hf` / :func:`hf_config` — ``config.json`` (Llama, Qwen2) ↔
  :class:`GPTModelConfig`; anything the model cannot express (rope scaling, sliding
  windows, other activations, MLP or output biases) is refused with a ValueError.
- :func:`load_hf_checkpoint` — every rank of the trainer layout reads only the tensors
  its shards come from (safetensors are read per tensor) and takes its shards; master
  copies are refreshed; optimizer moments are left as they are.
- :func:`export_hf_checkpoint` — the shards are gathered on one rank (collective), renamed
  and written there, in the dtype asked for.
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Collection, Mapping
from typing import Any

import torch

from dynarl.backends.megatron._megatron_trainer import MegatronTrainer
from dynarl.backends.megatron._sync import from_hf, hf_names, to_hf
from dynarl.backends.megatron._train_config import GPTModelConfig
from dynarl.errors import BackendError

__all__ = [
    "export_hf_checkpoint",
    "hf_config",
    "load_hf_checkpoint",
    "model_config_from_hf",
    "read_hf_tensors",
    "write_hf_tensors",
]

logger = logging.getLogger(__name__)

_SAFE, _BIN = "model.safetensors", "pytorch_model.bin"
_INDEX = ".index.json"


def model_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GPTModelConfig:
    """A :class:`GPTModelConfig` from an HF ``config.json`` dict (``overrides`` win, e.g.
    ``params_dtype``). Raises ValueError for a model type or feature it cannot express."""
    kind = config.get("model_type")
    if kind not in ("llama", "qwen2"):
        raise ValueError(f"model_type {kind!r} is not supported (llama, qwen2)")
    unsupported = {
        "rope_scaling": config.get("rope_scaling") is not None,
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(config.get("attention_bias", False)),
        "mlp_bias": bool(config.get("mlp_bias", False)),
        "sliding_window": bool(config.get("use_sliding_window", False)),
    }
    for key, used in unsupported.items():
        if used:
            raise ValueError(f"HF config field {key}={config.get(key)!r} is not supported")
    heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
    head_dim = config.get("head_dim")
    fields: dict[str, Any] = {
        "num_layers": int(config["num_hidden_layers"]),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": int(config.get("num_key_value_heads", heads)),
        "ffn_hidden_size": int(config["intermediate_size"]),
        "vocab_size": int(config["vocab_size"]),
        "head_dim": None if head_dim in (None, hidden // heads) else int(head_dim),
        "max_sequence_length": int(config.get("max_position_embeddings", 2048)),
        "norm_epsilon": float(config.get("rms_norm_eps", 1e-6)),
        "rotary_base": float(config.get("rope_theta", 10000.0)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "add_qkv_bias": kind == "qwen2",
        "init_method_std": float(config.get("initializer_range", 0.02)),
    }
    fields.update(overrides)
    return GPTModelConfig(**fields)


def _architecture(model: GPTModelConfig) -> tuple[Any, ...]:
    """The fields that decide tensor names, shapes and meaning (not dtype or init)."""
    return (
        model.num_layers,
        model.hidden_size,
        model.num_attention_heads,
        model.query_groups,
        model.kv_channels,
        model.ffn_hidden_size,
        model.vocab_size,
        model.normalization,
        model.norm_epsilon,
        model.gated_mlp,
        model.add_bias_linear,
        model.add_qkv_bias,
        model.tie_embeddings,
        model.rotary_base,
        model.position_embedding,
        model.num_experts,
        model.moe_router_topk if model.is_moe else None,
        model.moe_ffn_hidden_size if model.is_moe else None,
    )


def hf_config(model: GPTModelConfig, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` for ``model``: ``base`` (the loaded checkpoint's config) with the
    model's fields written over it; a Llama config when ``base`` is None. Raises ValueError
    for a model with no HF Llama/Qwen2 equivalent, MoE models included (their tensors map
    to Qwen-MoE names, :func:`.sync.to_hf`, but no Qwen-MoE config is written)."""
    if model.is_moe:
        raise ValueError("num_experts: no HF config.json is written for MoE models")
    mismatches = model.hf_mismatches()
    if mismatches:
        raise ValueError(f"the model has no HF Llama/Qwen2 config: {', '.join(mismatches)}")
    kind = (base or {}).get("model_type", "qwen2" if model.add_qkv_bias else "llama")
    out: dict[str, Any] = dict(base or {})
    out.update(
        architectures=["Qwen2ForCausalLM" if kind == "qwen2" else "LlamaForCausalLM"],
        model_type=kind,
        hidden_size=model.hidden_size,
        intermediate_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.query_groups,
        num_hidden_layers=model.num_layers,
        head_dim=model.kv_channels,
        vocab_size=model.vocab_size,
        max_position_embeddings=model.max_sequence_length,
        rms_norm_eps=model.norm_epsilon,
        rope_theta=model.rotary_base,
        tie_word_embeddings=model.tie_embeddings,
        hidden_act="silu",
    )
    out.setdefault("torch_dtype", model.params_dtype)
    return out


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """``{tensor name or "*": file}`` of a checkpoint directory; ValueError if it has none."""
    for single in (_SAFE, _BIN):
        index = path / (single + _INDEX)
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: path / file for name, file in weight_map.items()}
        if (path / single).exists():
            return {"*": path / single}
    raise ValueError(f"{path}: no {_SAFE}, {_BIN} or index of shards")


def _read_file(file: pathlib.Path, names: Collection[str] | None) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            keys = [k for k in handle.keys() if names is None or k in names]
            return {key: handle.get_tensor(key) for key in keys}
    state = torch.load(file, map_location="cpu", weights_only=True)
    return {k: v for k, v in state.items() if names is None or k in names}


def read_hf_tensors(
    path: str | pathlib.Path, names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory (only ``names`` when given; safetensors and
    index shards are read selectively). Raises ValueError when a named tensor is absent."""
    files = _weight_files(pathlib.Path(path))
    wanted = set(names) if names is not None else None
    by_file: dict[pathlib.Path, set[str] | None] = {}
    for name, file in files.items():
        if name == "*":
            by_file[file] = wanted
        elif wanted is None or name in wanted:
            selected = by_file.setdefault(file, set())
            assert selected is not None
            selected.add(name)
    out: dict[str, torch.Tensor] = {}
    for file, selected in by_file.items():
        out.update(_read_file(file, selected))
    if wanted is not None and wanted - set(out):
        raise ValueError(f"{path}: checkpoint lacks {sorted(wanted - set(out))[:5]}")
    return out


def write_hf_tensors(
    path: str | pathlib.Path,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    *,
    safetensors: bool = True,
) -> None:
    """Write ``config.json`` and one weights file (``model.safetensors`` or
    ``pytorch_model.bin``) into directory ``path`` (created if needed)."""
    directory = pathlib.Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    plain = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    if safetensors:
        from safetensors.torch import save_file

        save_file(plain, str(directory / _SAFE), metadata={"format": "pt"})
    else:
        torch.save(plain, directory / _BIN)
    (directory / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True))


def load_hf_checkpoint(trainer: MegatronTrainer, path: str | pathlib.Path) -> None:
    """Load an HF checkpoint directory's weights into the trainer's current layout.

    Runs on every rank of the layout, each reading the tensors its shards need. Raises
    ValueError when the directory's config.json disagrees with the trainer's model or a
    tensor is missing or misshaped; BackendError on a rank outside the layout.
    """
    directory = pathlib.Path(path)
    theirs = model_config_from_hf(json.loads((directory / "config.json").read_text()))
    mine = trainer.model_config
    if _architecture(theirs) != _architecture(mine):
        raise ValueError(f"{directory}: config.json describes {theirs}, the trainer {mine}")
    layout = trainer.layout
    if layout is None:
        raise BackendError(f"rank {trainer.rank} holds no part of the trainer")
    params = {spec.name for spec in trainer.specs}
    held = sorted({p.shard.tensor for p in layout.placements_on(trainer.rank)} & params)
    names = hf_names(trainer, held)
    hf = read_hf_tensors(directory, {n for group in names.values() for n in group})
    trainer.load_full({n: t for n, t in from_hf(hf, mine).items() if n in held})
    logger.info("rank %d loaded %d HF tensors from %s", trainer.rank, len(hf), directory)


def export_hf_checkpoint(
    trainer: MegatronTrainer,
    path: str | pathlib.Path,
    *,
    root: int | None = None,
    dtype: torch.dtype | None = None,
    base_config: Mapping[str, Any] | None = None,
    safetensors: bool = True,
) -> None:
    """Write the trainer's weights as an HF checkpoint directory on ``root`` (default: the
    layout's first rank). Collective over the layout. ``dtype`` defaults to ``base_config``'s
    ``torch_dtype``, else the parameters' dtype."""
    layout = trainer.layout
    if layout is None:
        raise BackendError(f"rank {trainer.rank} holds no part of the trainer")
    root = layout.ranks[0] if root is None else root
    full = trainer.gather(root)
    if trainer.rank != root:
        return
    config = hf_config(trainer.model_config, base_config)
    target = dtype or getattr(torch, str(config["torch_dtype"]))
    tensors = {name: t.to(target) for name, t in to_hf(full, trainer.model_config).items()}
    write_hf_tensors(path, tensors, config, safetensors=safetensors)
    logger.info("rank %d exported %d HF tensors to %s", trainer.rank, len(tensors), path)
