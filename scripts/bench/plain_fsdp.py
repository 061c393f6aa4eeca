"""Baseline for the inner-loop benchmark: the smallest honest FSDP2 training loop of the same model and batch.

Run under torchrun; prints one JSON line with the median, 10th and 90th percentile tokens/s of the timed steps
(rank 0)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from open_diloco.data import FakeSequences  # noqa: E402
from open_diloco.materialize import materialize  # noqa: E402
from open_diloco.model import build_meta_model  # noqa: E402
from open_diloco.world import leave_process_group  # noqa: E402

DTYPES = {"bf16-mixed": torch.bfloat16, "32-true": torch.float32, "fp16-mixed": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path-model", required=True)
    parser.add_argument("--per-device-train-batch-size", type=int, required=True)
    parser.add_argument("--total-batch-size", type=int, required=True)
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--torch-compile", action="store_true")
    parser.add_argument(
        "--like-trainer",
        action="store_true",
        help="the trainer's model (built on meta, materialised, no KV cache) and its fake-data tokens",
    )
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    accum = args.total_batch_size // (args.per_device_train_batch_size * world)

    torch.manual_seed(0)
    if args.like_trainer:
        model = build_meta_model(args.path_model)
    else:
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(args.path_model), dtype=torch.float32
        )
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[args.precision], reduce_dtype=torch.float32)
    for i, block in enumerate(model.model.layers):
        if args.torch_compile:
            block = torch.compile(block)
        fully_shard(block, mp_policy=policy, reshard_after_forward=i < len(model.model.layers) - 1)
        model.model.layers[i] = block
    fully_shard(model, mp_policy=policy)
    if args.like_trainer:
        materialize(model, args.path_model, 0, device)
    else:
        model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    vocab = model.config.vocab_size
    batch = torch.randint(0, vocab, (args.per_device_train_batch_size, args.seq_length), device=device)
    if args.like_trainer:  # the trainer's token distribution (a Zipf alphabet of 512), still one batch
        sequences = FakeSequences(0, 0, vocab, args.seq_length)
        rows = [sequences[i]["input_ids"] for i in range(args.per_device_train_batch_size)]
        batch = torch.stack(rows).to(device)

    rates = []
    for step in range(args.max_steps):
        started = time.perf_counter()
        for micro in range(accum):
            model.set_requires_gradient_sync(micro == accum - 1)
            loss = model(input_ids=batch, labels=batch).loss / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        if step >= args.warmup:
            rates.append(args.total_batch_size * args.seq_length / (time.perf_counter() - started))
    if dist.get_rank() == 0:
        deciles = statistics.quantiles(rates, n=10)
        print(
            json.dumps(
                {"tokens_per_second": statistics.median(rates), "p10": deciles[0], "p90": deciles[-1]}
            ),
            file=sys.stdout,
            flush=True,
        )
    leave_process_group(synchronize=True)


if __name__ == "__main__":
    main()
