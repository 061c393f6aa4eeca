"""The one place that shards: FSDP2 (``fully_shard``) per transformer block, mixed precision, activation
checkpointing and ``torch.compile``, applied to a finished model."""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import PreTrainedModel

from open_diloco.errors import ConfigError
from open_diloco.model import transformer_blocks

_PARAM_DTYPE = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "32-true": torch.float32}


def resolve_precision(precision: str, device: torch.device) -> str:
    """Turn ``auto`` into a concrete policy and refuse what the device cannot run."""
    if precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16-mixed"
        return "32-true"
    if precision == "fp16-mixed" and device.type != "cuda":
        raise ConfigError(
            "--precision fp16-mixed needs a CUDA GPU (fp16 on CPU is emulated and needs loss scaling): "
            "use --precision 32-true or bf16-mixed"
        )
    if precision == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            "--precision bf16-mixed is not supported by this GPU: use --precision fp16-mixed or 32-true"
        )
    return precision


def parallelize(
    model: PreTrainedModel,
    device: torch.device,
    precision: str,
    activation_checkpointing: bool,
    compile_blocks: bool,
) -> torch.nn.Module:
    """Shard ``model`` over the default process group; parameters stay fp32 (the optimizer's master copy),
    compute runs in the policy's dtype, gradients are reduced in fp32. A model on the ``meta`` device stays
    there (``materialize`` allocates each rank's shards on ``device``); any other moves to ``device``."""
    mp_policy = MixedPrecisionPolicy(param_dtype=_PARAM_DTYPE[precision], reduce_dtype=torch.float32)
    blocks = transformer_blocks(model)
    layers = model.model.layers
    for index, block in enumerate(blocks):
        if activation_checkpointing:
            block = checkpoint_wrapper(block)
        if compile_blocks:
            block = torch.compile(block)
        # The last block is not resharded after forward: backward needs it right away.
        fully_shard(block, mp_policy=mp_policy, reshard_after_forward=index < len(blocks) - 1)
        layers[index] = block
    fully_shard(model, mp_policy=mp_policy)
    if not any(param.is_meta for param in model.parameters()):
        model.to(device)
    return model
