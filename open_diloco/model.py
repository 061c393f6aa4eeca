"""Build the causal LM a cluster trains, from local files only (nothing is ever downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from open_diloco.errors import ConfigError
from open_diloco.materialize import materialize


def load_model_config(path_model: Path) -> PretrainedConfig:
    """Read ``config.json`` from a local model directory, with a one-line error when it is not one."""
    path = Path(path_model)
    if not path.is_dir():
        raise ConfigError(
            f"--path-model {path} is not a directory: point it at a local model dir with a config.json"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"--path-model {path} has no config.json: point it at a transformers model directory"
        )
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"--path-model {path}/config.json is not a valid model config ({first_line}): fix or replace it"
        ) from None


SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
"""The fields of a (Llama-style) ``config.json`` that decide the parameters' names and shapes."""


def shape_fields(model_config: dict[str, Any]) -> dict[str, Any]:
    """The :data:`SHAPE_FIELDS` a model config sets: what two clusters' models must share to average, so that
    a mismatch can name the field that differs rather than a hash."""
    return {key: model_config[key] for key in SHAPE_FIELDS if key in model_config}


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's parameter names and (global) shapes: clusters with different ones cannot
    average together."""
    import xxhash

    layout = ";".join(f"{name}:{tuple(param.shape)}" for name, param in model.named_parameters())
    return xxhash.xxh3_64(layout.encode()).hexdigest()


def build_meta_model(path_model: Path) -> PreTrainedModel:
    """The model's structure on the ``meta`` device: fp32 parameters with shapes but no storage (nothing is
    allocated, nothing initialised). ``parallelize`` shards it, ``materialize`` gives each rank its shards."""
    model_config = load_model_config(path_model)
    model_config.use_cache = False
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)


def build_model(path_model: Path, seed: int) -> PreTrainedModel:
    """The whole model in fp32 on the CPU, unsharded: local weights when present, else fresh weights from
    ``seed`` — the same θ as the sharded build gives every rank count (``materialize.init_fresh``).

    For single-process benches and tests; the trainer never holds the whole model
    (``trainer.build_sharded_model``).
    """
    return materialize(build_meta_model(path_model), path_model, seed, torch.device("cpu"))


def transformer_blocks(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The repeated decoder blocks: the unit of FSDP sharding, compilation and activation checkpointing."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None) if inner is not None else None
    if layers is None:
        raise ConfigError(
            f"{type(model).__name__} has no `model.layers`: only Llama-style decoder models are supported"
        )
    return list(layers)
