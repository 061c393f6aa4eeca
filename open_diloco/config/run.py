"""The flags of one cluster's training run (:class:`Config`, its ``--ckpt.*`` group :class:`CkptConfig`), and
the checks that need the launched world (:func:`check_against_world`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from cyclopts import Parameter
from pydantic import BaseModel, Field, model_validator

from open_diloco.config.fields import STRICT, show_ranges_in_help
from open_diloco.config.galaxy import HvConfig
from open_diloco.errors import ConfigError


class CkptConfig(BaseModel):
    """Checkpoints: sharded (torch.distributed.checkpoint), atomic, at outer-step boundaries."""

    model_config = STRICT

    path: Path = Path("outputs/ckpt")
    """Directory holding `step_<N>` checkpoints."""

    interval: Annotated[int, Field(ge=1)] | None = None
    """Save every N inner steps (in a galaxy a multiple of --hv.local-steps). Unset: never save."""

    keep: Annotated[int, Field(ge=1)] = 3
    """How many of the newest checkpoints to keep."""

    resume: str | None = None
    """Resume from a checkpoint directory; `latest`: the newest one under --ckpt.path (an error when there is
    none); `auto`: the newest one if there is any, else start fresh and join the galaxy from its peers: the
    value to pass always, e.g. under `torchrun --max-restarts` (docs/operations.md, When a rank dies)."""


Precision = Literal["auto", "bf16-mixed", "fp16-mixed", "32-true"]
Beta = Annotated[float, Field(ge=0, lt=1)]


@Parameter(name="*")
class Config(BaseModel):
    """One cluster's training run."""

    model_config = STRICT

    # model
    path_model: Path = Path("tests/models/llama-2m-fresh")
    """A local model directory: a transformers `config.json` (weights initialised fresh from --seed) or a
    `save_pretrained` directory with weights."""

    seq_length: Annotated[int, Field(ge=2)] = 1024
    """Tokens per sample."""

    # batch and optimizer
    per_device_train_batch_size: Annotated[int, Field(ge=1)] = 8
    """Micro-batch size of one rank."""

    total_batch_size: Annotated[int, Field(ge=1)] = 64
    """Samples per inner step over the whole cluster; gradient accumulation makes up the difference."""

    lr: Annotated[float, Field(gt=0)] = 4e-4
    """Peak learning rate of the inner AdamW."""

    warmup_steps: Annotated[int, Field(ge=0)] = 10
    """Linear warm-up steps of the inner learning rate."""

    total_steps: Annotated[int, Field(ge=1)] | None = None
    """Length of the cosine schedule; unset: --max-steps."""

    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    """Floor of the cosine schedule as a fraction of --lr."""

    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    """AdamW weight decay."""

    adam_betas: tuple[Beta, Beta] = (0.9, 0.95)
    """AdamW betas."""

    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0
    """Clip the global gradient norm to this."""

    max_steps: Annotated[int, Field(ge=1)] = 1000
    """Inner steps to train."""

    seed: Annotated[int, Field(ge=0, lt=2**32)] = 42
    """Seed of weight init, fake data and data order."""

    # data
    fake_data: bool = False
    """Train on generated, learnable sequences instead of a dataset (no files needed)."""

    dataset_path: str | None = None
    """Local data: a directory or glob of text files, a .jsonl/.parquet file, or a `save_to_disk` dataset."""

    dataset_text_field: str = "text"
    """Field holding the text in JSONL, parquet and `datasets` data."""

    path_tokenizer: Path | None = None
    """A local tokenizer directory (transformers AutoTokenizer). Unset: the built-in byte-level tokenizer."""

    data_cache_dir: Path = Path("outputs/data_cache")
    """Where raw data given to --dataset-path is tokenized and packed once, reused by later runs with the same
    files and tokenizer. Share it between a node's ranks (the first prepares, the others wait)."""

    num_workers: Annotated[int, Field(ge=0, le=64)] = 1
    """Background data-loading processes per rank."""

    eval_interval: Annotated[int, Field(ge=1)] | None = None
    """Compute validation loss every N inner steps (on held-out samples never trained on). Unset: never."""

    eval_samples: Annotated[int, Field(ge=1)] = 256
    """Held-out samples per validation: the first N of the held-out part, the same ones whatever the batch
    size and rank count (rounded up to a multiple of the ranks), so val_loss compares across runs, resumes
    and clusters."""

    # performance
    precision: Precision = "auto"
    """Numerics: `bf16-mixed` (bf16 compute, fp32 reduce), `fp16-mixed`, `32-true`; `auto` picks
    bf16-mixed on GPUs that support it, else 32-true."""

    torch_compile: bool = True
    """Compile each transformer block with torch.compile."""

    activation_checkpointing: bool = False
    """Recompute each block's activations in backward to save memory."""

    gc_interval: Annotated[int, Field(ge=0)] = 50
    """Run Python's garbage collector every N inner steps, and not automatically in between (an automatic
    collection in the middle of a step stalls the GPU); 0: Python's automatic collection."""

    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to train; `auto`: CUDA when available."""

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend; `auto`: nccl on CUDA, gloo on CPU."""

    dry_run: bool = False
    """Build, shard and materialise the model, take one inner step on random tokens, print peak memory and the
    seconds to that step, and exit: no galaxy, no data (run it before a long job, with the same flags)."""

    # logging
    metric_logger_type: Literal["dummy", "jsonl", "wandb"] = "dummy"
    """Where metrics go (rank 0 of each cluster only). wandb respects WANDB_MODE and never asks to log in."""

    metrics_path: Path = Path("metrics.jsonl")
    """File the `jsonl` logger appends to."""

    project: str = "open_diloco"
    """wandb project."""

    run_name: str | None = None
    """Run name in logs and wandb; unset: `cluster<galaxy rank>` in wandb, where the clusters of a galaxy
    share its --hv.run-id as their group (a cluster resumed from a checkpoint continues its own run), and with
    the start time added in the logs."""

    log_interval: Annotated[int, Field(ge=1)] = 1
    """Print a step line every N inner steps."""

    sample_log: Path | None = None
    """Debug: each rank appends the ids of the samples it trained, per inner step, to
    `DIR/<run name>.rank<rank>.jsonl` (what the loaders read, to check the galaxy's data against the plan)."""

    hv: HvConfig | None = None
    """Galaxy settings; any `--hv.*` flag turns DiLoCo on."""

    ckpt: CkptConfig = CkptConfig()
    """Checkpoint settings."""

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        if self.total_batch_size % self.per_device_train_batch_size:
            raise ConfigError(
                f"--total-batch-size {self.total_batch_size} is not a multiple of "
                f"--per-device-train-batch-size {self.per_device_train_batch_size}: make it one"
            )
        if self.fake_data and self.dataset_path:
            raise ConfigError("--fake-data and --dataset-path both given: choose one")
        if not self.fake_data and not self.dataset_path and not self.dry_run:
            raise ConfigError("no data: pass --fake-data or --dataset-path PATH")
        if (
            self.hv is not None
            and self.ckpt.interval is not None
            and self.ckpt.interval % self.hv.local_steps
        ):
            raise ConfigError(
                f"--ckpt.interval {self.ckpt.interval} is not a multiple of --hv.local-steps "
                f"{self.hv.local_steps}: checkpoints must land on outer-step boundaries"
            )
        return self

    @property
    def schedule_steps(self) -> int:
        """Length of the cosine schedule."""
        return self.total_steps or self.max_steps


def check_against_world(config: Config, world_size: int) -> int:
    """Validate what depends on the number of ranks; return the gradient-accumulation steps."""
    per_step = config.per_device_train_batch_size * world_size
    if config.total_batch_size % per_step:
        raise ConfigError(
            f"--total-batch-size {config.total_batch_size} is not divisible by --per-device-train-batch-size "
            f"{config.per_device_train_batch_size} x {world_size} ranks: use a total that is a multiple of "
            f"{per_step}, or fewer ranks"
        )
    return config.total_batch_size // per_step


for _model in (CkptConfig, Config):
    show_ranges_in_help(_model)
