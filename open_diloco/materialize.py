"""Give a model built on the ``meta`` device (and usually already sharded) its storage and its values, one
rank's shards at a time, so that no rank ever holds the whole model.

Fresh weights are a function of (``--seed``, parameter name, global row) only: each parameter is cut into
fixed row blocks, each block drawn on the CPU from a generator keyed by (seed, name, block), and a rank draws
only the blocks that cover its rows. Every rank count, every cluster and every device therefore starts from
the same θ (DiLoCo's outer step assumes all clusters share θ_outer at round 0), and the extra memory is one
block. Local weights (``--path-model`` with weights) are read the same way, slice by slice (safetensors'
``get_slice``; ``pytorch_model.bin`` through a memory map).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from open_diloco.errors import ConfigError

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

BLOCK_NUMEL = 2**22
"""Values per generated block (16 MiB of fp32). Part of the definition of fresh θ: changing it changes every
cluster's initial weights."""

# Wrappers that parallelize() inserts into parameter names; a parameter is known by its name without them.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def materialize(model: torch.nn.Module, path_model: Path, seed: int, device: torch.device) -> torch.nn.Module:
    """Allocate this rank's shards of ``model`` (built on ``meta``) on ``device`` and fill them: with the
    weights in ``path_model`` when it holds some, else fresh from ``seed``; non-persistent buffers (the
    rotary frequencies) are recomputed. Returns ``model``."""
    _to_empty_keeping_ties(model, device)
    with torch.no_grad():
        if has_weights(path_model):
            load_local_weights(model, Path(path_model))
        else:
            init_fresh(model, seed)
        recompute_buffers(model)
    return model


def has_weights(path_model: Path) -> bool:
    """Whether the directory holds trained weights (else the model is initialised fresh)."""
    return any((Path(path_model) / name).is_file() for name in _WEIGHT_FILES)


def _to_empty_keeping_ties(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)``, with each tied parameter (``tie_word_embeddings``) still one tensor:
    ``to_empty`` keeps FSDP2's DTensors tied but gives an unsharded model's owners a tensor each."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, attr))
    model.to_empty(device=device)
    for (first_module, first_attr), *others in owners.values():
        first = getattr(first_module, first_attr)
        for module, attr in others:
            if getattr(module, attr) is not first:
                setattr(module, attr, first)


def canonical_name(name: str) -> str:
    """``name`` without the wrappers that activation checkpointing and ``torch.compile`` add: the name in the
    model's own ``state_dict`` and in its weight files, the same whatever the flags."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def named_unique_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str]]:
    """(canonical name, owning module, attribute) of every parameter once, in the model's order; a tied
    parameter (``tie_word_embeddings``) under its first name."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield canonical_name(f"{module_name}.{attr}" if module_name else attr), module, attr


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's part of ``param`` (a view: writes reach the model) and the global row it starts at. FSDP2
    shards dim 0 as ``torch.chunk`` does; a plain tensor is all rows."""
    data = param.data
    if not hasattr(data, "to_local"):
        return data, 0
    from torch.distributed.tensor import Replicate, Shard

    local = data.to_local()
    if all(isinstance(p, Replicate) for p in data.placements):
        return local, 0
    if len(data.placements) != 1 or data.placements[0] != Shard(0):
        raise ConfigError(f"cannot initialise a parameter placed as {data.placements}: only dim-0 shards")
    mesh = data.device_mesh
    rows = data.shape[0]
    chunk = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * chunk, rows)
    if local.shape[0] != min(chunk, rows - start):
        raise ConfigError(f"unexpected shard of {tuple(data.shape)}: {tuple(local.shape)} from row {start}")
    return local, start


def init_rule(module: torch.nn.Module, attr: str) -> str:
    """How the model's own ``_init_weights`` (transformers' ``PreTrainedModel``'s, which Llama keeps)
    initialises ``module.<attr>``: ``normal`` (Linear and Embedding weights), ``ones`` (norm weights),
    ``zeros`` (biases)."""
    if attr == "bias":
        return "zeros"
    if attr == "weight" and isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        return "normal"
    kind = type(module).__name__
    if attr == "weight" and ("RMSNorm" in kind or "LayerNorm" in kind):
        return "ones"
    raise ConfigError(f"no fresh initialisation known for {kind}.{attr}: give --path-model with weights")


def init_fresh(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter's local rows with the fresh θ of ``seed`` (see the module's docstring)."""
    config = getattr(model, "config", None)
    std = getattr(config, "initializer_range", None) or 0.02
    for name, module, attr in named_unique_parameters(model):
        local, start = local_rows(getattr(module, attr))
        rule = init_rule(module, attr)
        if rule == "ones":
            local.fill_(1.0)
        elif rule == "zeros":
            local.zero_()
        else:
            global_shape = tuple(getattr(module, attr).shape)
            _fill_normal(local, start, global_shape, std, partial(_block_seed, seed, name))
            padding_idx = getattr(module, "padding_idx", None)
            if padding_idx is not None and start <= padding_idx < start + local.shape[0]:
                local[padding_idx - start].zero_()  # transformers zeroes the padding token's embedding


def _block_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit seed from (seed, name, block), stable across processes, hosts and Python versions."""
    digest = hashlib.blake2b(repr((seed, name, block)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _fill_normal(
    local: torch.Tensor,
    start: int,
    global_shape: tuple[int, ...],
    std: float,
    seed_of: Callable[[int], int],
) -> None:
    """normal(0, std) into ``local`` = rows [start, start + len) of a tensor of ``global_shape``, drawn block
    by block (blocks of whole rows, :data:`BLOCK_NUMEL` values or one row) on the CPU."""
    if local.numel() == 0:
        return
    row_numel = max(1, int(torch.Size(global_shape[1:]).numel()))
    rows_per_block = max(1, BLOCK_NUMEL // row_numel)
    end = start + local.shape[0]
    for block in range(start // rows_per_block, (end - 1) // rows_per_block + 1):
        first, last = block * rows_per_block, min((block + 1) * rows_per_block, global_shape[0])
        values = torch.empty((last - first, *global_shape[1:]), dtype=torch.float32)
        values.normal_(0.0, std, generator=torch.Generator().manual_seed(seed_of(block)))
        lo, hi = max(first, start), min(last, end)
        local[lo - start : hi - start].copy_(values[lo - first : hi - first])


def recompute_buffers(model: torch.nn.Module) -> None:
    """Recompute the buffers ``to_empty`` left uninitialised. Llama has only the rotary embedding's
    (non-persistent) frequencies: a fresh rotary module of the same config, built on the CPU, gives them."""
    for name, module in model.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        if "RotaryEmbedding" not in type(module).__name__:
            raise ConfigError(
                f"no way known to recompute the buffers of {canonical_name(name)}: {sorted(own)}"
            )
        with torch.device("cpu"):
            fresh = type(module)(config=module.config)
        for key, buffer in own.items():
            buffer.copy_(getattr(fresh, key))


def load_local_weights(model: torch.nn.Module, path_model: Path) -> None:
    """Copy this rank's rows of every parameter from the weight files in ``path_model``, reading only those
    rows; a parameter missing from the files, or of another shape, is an error (a tied one is read once,
    under its first name)."""
    files = WeightFiles(path_model)
    for name, module, attr in named_unique_parameters(model):
        param = getattr(module, attr)
        local, start = local_rows(param)
        rows = files.rows(name, tuple(param.shape), slice(start, start + local.shape[0]))
        local.copy_(rows)


class WeightFiles:
    """The tensors of a ``save_pretrained`` directory by name, read a row range at a time: safetensors through
    ``get_slice``, ``pytorch_model.bin`` through a memory map (pages of other rows are never read)."""

    def __init__(self, path_model: Path):
        self.path = Path(path_model)
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        for index_name, single in (
            ("model.safetensors.index.json", "model.safetensors"),
            ("pytorch_model.bin.index.json", "pytorch_model.bin"),
        ):
            index, one = self.path / index_name, self.path / single
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                self._where = {key: self.path / file for key, file in weight_map.items()}
                return
            if one.is_file():
                self._where = dict.fromkeys(self._handle(one).keys(), one)
                return

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                self._handles[file] = safe_open(file, framework="pt", device="cpu")
            else:
                self._handles[file] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        return self._handles[file]

    def rows(self, name: str, shape: tuple[int, ...], rows: slice) -> torch.Tensor:
        """Rows ``rows`` of tensor ``name``, which must have ``shape``, as fp32."""
        file = self._where.get(name)
        if file is None:
            raise ConfigError(
                f"--path-model {self.path}: the weight files have no {name!r}: not this model's"
            )
        if file.suffix == ".safetensors":
            tensor = self._handle(file).get_slice(name)
            found = tuple(tensor.get_shape())
        else:
            tensor = self._handle(file)[name]
            found = tuple(tensor.shape)
        if found != shape:
            raise ConfigError(
                f"--path-model {self.path}: {name!r} has shape {found} in the weight files, {shape} in "
                "config.json: they are not the same model"
            )
        return tensor[rows].to(torch.float32)
