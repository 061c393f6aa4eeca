"""Training data: what each rank of each cluster reads, in which order, resumably.

Every source is a map-style dataset of fixed-length samples addressed by an integer id. A
:class:`ClusterSampler` walks a cluster's sample ids in order and hands rank r of W the r-th
``per_device_batch``-sized slice of every ``per_device_batch × W`` block, so a cluster of W ranks with
gradient accumulation sees exactly the samples a single process would for the same total batch.
Clusters of a galaxy read disjoint id ranges (see :func:`cluster_stream`).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

# torchdata 0.11 calls a deprecated torch API at every loader start; the warning is not actionable for users.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def _seed_of(*parts: int | str) -> int:
    """A 63-bit seed from any parts, stable across processes and Python versions (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class FakeSequences(Dataset):
    """Learnable synthetic text: a Zipf-distributed alphabet where each token is usually followed by a fixed
    successor. A model first learns the unigram (loss falls from ln V within tens of steps), then the bigram
    table, so "loss falls" is a meaningful smoke test. Sample ``i`` depends only on (seed, stream, i)."""

    ALPHABET = 512
    P_SUCCESSOR = 0.75
    MAX_RUN = 64

    def __init__(self, seed: int, stream: int, vocab_size: int, seq_length: int):
        self.seed, self.stream, self.seq_length = seed, stream, seq_length
        alphabet = min(self.ALPHABET, vocab_size)
        table_gen = torch.Generator().manual_seed(_seed_of(seed, "fake-data-table"))
        self.tokens = torch.randperm(vocab_size, generator=table_gen)[:alphabet]
        self.successor = torch.randint(0, alphabet, (alphabet,), generator=table_gen)
        self.zipf = 1.0 / torch.arange(1, alphabet + 1, dtype=torch.float64)
        # successor_pow[k, s]: the successor applied k times to symbol s (lets a sample be built without a loop)
        powers = [torch.arange(alphabet)]
        for _ in range(self.MAX_RUN):
            powers.append(self.successor[powers[-1]])
        self.successor_pow = torch.stack(powers)

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, index: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(_seed_of(self.seed, self.stream, index))
        draws = torch.multinomial(self.zipf, self.seq_length, replacement=True, generator=gen)
        positions = torch.arange(self.seq_length)
        fresh = (torch.rand(self.seq_length, generator=gen) >= self.P_SUCCESSOR) | (
            positions % self.MAX_RUN == 0
        )
        run_start = torch.cummax(torch.where(fresh, positions, 0), dim=0).values
        symbols = self.successor_pow[positions - run_start, draws[run_start]]
        return {"input_ids": self.tokens[symbols], "sample_id": index}


class ClusterSampler(Sampler[int]):
    """Infinite, resumable walk over a cluster's sample ids, sliced for one rank (see module doc)."""

    def __init__(self, per_device_batch: int, rank: int, world_size: int, num_samples: int | None = None):
        self.per_device_batch, self.rank, self.world_size = per_device_batch, rank, world_size
        self.num_samples = num_samples  # None: ids are unbounded (fake data); else wrap around (epochs)
        self.next_block = 0

    def __iter__(self) -> Iterator[int]:
        block_size = self.per_device_batch * self.world_size
        while True:
            start = self.next_block * block_size + self.rank * self.per_device_batch
            self.next_block += 1
            for offset in range(self.per_device_batch):
                index = start + offset
                yield index if self.num_samples is None else index % self.num_samples

    def state_dict(self) -> dict[str, int]:
        return {"next_block": self.next_block}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_block = state["next_block"]


def cluster_stream(galaxy_rank: int) -> int:
    """The fake-data stream of a cluster: clusters of a galaxy draw different samples."""
    return galaxy_rank


def build_train_loader(
    *,
    fake_data: bool,
    seed: int,
    galaxy_rank: int,
    vocab_size: int,
    seq_length: int,
    per_device_batch: int,
    rank: int,
    world_size: int,
    num_workers: int,
) -> StatefulDataLoader:
    """A stateful loader of ``{"input_ids": [B, T], "sample_id": [B]}`` micro-batches for this rank."""
    if not fake_data:
        raise NotImplementedError("real datasets arrive with the data issue")
    dataset = FakeSequences(seed, cluster_stream(galaxy_rank), vocab_size, seq_length)
    sampler = ClusterSampler(per_device_batch, rank, world_size)
    return StatefulDataLoader(
        dataset,
        batch_size=per_device_batch,
        sampler=sampler,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
        # No pinning: a token batch is a few hundred KB, and a pin-memory thread would contend for the GIL
        # with the thread that launches kernels.
        pin_memory=False,
    )
