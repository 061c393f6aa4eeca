"""Training data: what each rank of each cluster reads, in which order, resumably.

Every source is a map-style dataset addressed by an unbounded *position*. A :class:`ClusterSampler` walks
a cluster's positions in order and hands rank r of W the r-th ``per_device_batch``-sized slice of every
``per_device_batch × W`` block, so a cluster of W ranks with gradient accumulation sees exactly the samples a
single process would for the same total batch. Every batch carries ``sample_id``: for real data the global id
of the packed sample (its window in the packed corpus, the same in every cluster).

How real data is split (all of it a pure function of --seed, the corpus and --seq-length, computed the same
way in every process, with no communication):

* The packed corpus (see :mod:`open_diloco.corpus`) holds N = num_tokens // seq_length samples.
* Validation: the last ``max(1, N // 100)`` samples, always held out (whether or not eval runs, so turning
  eval on never changes training). Every evaluation reads the first ``--eval-samples`` of them, whatever the
  batch size and rank count, so val_loss compares across clusters, steps and runs; a pass wanting more
  samples than are held out reads some twice.
* Training: the other samples, shuffled by a permutation seeded by --seed; cluster c of a galaxy of G takes
  every G-th of them starting at c. The clusters' parts are disjoint and together cover the training set.
* Inside a cluster: position p reads the part's sample ``p mod n``; each pass over the part (an epoch) is
  reshuffled, seeded by (seed, cluster, epoch). The ranks split positions as described above.

When the galaxy size changes mid-run (a resume with another --hv.galaxy-size) the training set is dealt again
into G' parts: the clusters stay disjoint from each other, but each cluster resumes at its saved position in
its *new* part, so until the current epoch ends some samples are seen twice by the galaxy and others not at
all (the more so the further into the epoch). Later epochs are clean. To keep exact coverage, change the
galaxy size at an epoch boundary or start a fresh loader state.

An elastic galaxy (no --hv.world-rank) has no N: every cluster plans the whole training set in one order (real
data: the shuffled ids, each pass reshuffled by (seed, the galaxy stream, epoch); fake data: one galaxy-wide
stream), and the ledger deals it in pages of one inner step (``outer/deal.py``): a :class:`PageSampler` reads
the pages :class:`DealtBatches` gives it, step by step.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from open_diloco.config import Config
from open_diloco.corpus import PackedCorpus, find_source
from open_diloco.corpus_cache import prepare_cached
from open_diloco.errors import ConfigError
from open_diloco.tokenizer import check_fits_model, load_tokenizer

# torchdata 0.11 calls a deprecated torch API at every loader start; the warning is not actionable for users.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

VAL_FRACTION_DENOMINATOR = 100
"""One sample in this many (at least one) is held out for validation."""
FAKE_VAL_STREAM = -1
"""The fake-data stream validation reads (clusters use their galaxy rank, 0 … G − 1)."""
GALAXY_STREAM = -2
"""The fake-data stream of an elastic galaxy: one order for every cluster, which the ledger deals in pages."""


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
        # successor_pow[k, s]: the successor applied k times to symbol s (lets a sample be built without a
        # loop)
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


class PackedSamples(Dataset):
    """Samples of a packed corpus at the given ids: position p reads sample ``ids[p mod n]``, and each pass
    over ``ids`` after the first is reshuffled by ``(reshuffle_seed, epoch)`` unless ``reshuffle_seed`` is
    None.

    The token file is memory-mapped lazily in the process that reads (a loader worker), never pickled."""

    def __init__(self, corpus: PackedCorpus, seq_length: int, ids: np.ndarray, reshuffle_seed: int | None):
        self.corpus, self.seq_length, self.ids, self.reshuffle_seed = corpus, seq_length, ids, reshuffle_seed
        self._tokens: np.memmap | None = None
        self._orders: dict[int, np.ndarray] = {0: ids}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, position: int) -> dict[str, Any]:
        epoch, offset = divmod(position, len(self.ids))
        sample_id = int(self._order(epoch)[offset])
        if self._tokens is None:
            self._tokens = self.corpus.tokens()
        start = sample_id * self.seq_length
        window = np.array(self._tokens[start : start + self.seq_length], dtype=np.int64)
        return {"input_ids": torch.from_numpy(window), "sample_id": sample_id}

    def _order(self, epoch: int) -> np.ndarray:
        if self.reshuffle_seed is None:
            return self.ids
        if epoch not in self._orders:
            rng = np.random.default_rng(_seed_of(self.reshuffle_seed, "epoch", epoch))
            self._orders = {0: self.ids, epoch: self.ids[rng.permutation(len(self.ids))]}
        return self._orders[epoch]


class ClusterSampler(Sampler[int]):
    """Infinite, resumable walk over a cluster's sample positions, sliced for one rank (see module doc)."""

    def __init__(self, per_device_batch: int, rank: int, world_size: int):
        self.per_device_batch, self.rank, self.world_size = per_device_batch, rank, world_size
        self.next_block = 0

    def __iter__(self) -> Iterator[int]:
        while True:
            block, self.next_block = self.next_block, self.next_block + 1
            yield from rank_slice(block, self.per_device_batch, self.rank, self.world_size)

    def state_dict(self) -> dict[str, int]:
        return {"next_block": self.next_block}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_block = state["next_block"]


def rank_slice(block: int, per_device_batch: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s positions of block ``block`` (``per_device_batch`` × ``world_size`` positions each)."""
    start = (block * world_size + rank) * per_device_batch
    return range(start, start + per_device_batch)


class PageSampler(Sampler[int]):
    """The positions of the pages the ledger dealt this cluster (an elastic galaxy: ``outer/deal.py``), for
    one rank: page p is positions p·S … p·S + S − 1 of the galaxy's order, S = ``per_device_batch`` × W ×
    ``grad_accum`` (one inner step of the cluster), each of its micro-batch blocks sliced by rank as
    :class:`ClusterSampler` slices them. It walks :attr:`pages` and stops when they run out: the deal is known
    only so far ahead, and :class:`DealtBatches` starts it again with the pages dealt since."""

    def __init__(self, per_device_batch: int, rank: int, world_size: int, grad_accum: int):
        self.per_device_batch, self.rank, self.world_size = per_device_batch, rank, world_size
        self.grad_accum = grad_accum
        self.pages: list[int] = []

    def __iter__(self) -> Iterator[int]:
        for page in list(self.pages):  # page p: blocks p·grad_accum … (p + 1)·grad_accum − 1
            for block in range(page * self.grad_accum, (page + 1) * self.grad_accum):
                yield from rank_slice(block, self.per_device_batch, self.rank, self.world_size)


class DealtBatches:
    """The micro-batches of the page each inner step reads in an elastic galaxy. ``page_at(step)``: its page;
    ``pages_from(step)``: the pages of the steps from ``step`` on, as far as the deal is known. The loader
    prefetches along them; when the page a step wants is not the one next in its pipeline (the deal ran out
    there, or a taken chain dealt otherwise), it starts again from that step's pages."""

    def __init__(self, loader: Any, page_at: Any, pages_from: Any, grad_accum: int):
        self.loader, self.page_at, self.pages_from, self.grad_accum = loader, page_at, pages_from, grad_accum
        self._planned: list[int] = []
        self._taken = 0
        self._batches: Iterator[dict[str, Any]] = iter(())

    def at(self, step: int) -> Iterator[dict[str, Any]]:
        """The batches of inner step ``step`` (its ``grad_accum`` micro-batches come next)."""
        page = self.page_at(step)
        if page is None:
            raise RuntimeError(f"inner step {step} trains, but the ledger dealt this cluster no page for it")
        if self._taken >= len(self._planned) or self._planned[self._taken] != page:
            self.loader.sampler.pages = self._planned = list(self.pages_from(step))
            self._taken, self._batches = 0, iter(self.loader)
        self._taken += 1
        return self._batches


def cluster_stream(galaxy_rank: int) -> int:
    """The fake-data stream of a cluster: clusters of a galaxy draw different samples."""
    return galaxy_rank


def split_samples(
    num_samples: int, seed: int, galaxy_size: int, galaxy_rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """(this cluster's training sample ids in first-epoch order, the held-out validation ids); see module
    doc."""
    num_val = max(1, num_samples // VAL_FRACTION_DENOMINATOR)
    num_train = max(0, num_samples - num_val)
    dtype = np.uint32 if num_samples < 1 << 32 else np.int64  # 4 bytes per sample of this cluster's part
    order = np.random.default_rng(_seed_of(seed, "split")).permutation(num_train)
    return order[galaxy_rank::galaxy_size].astype(dtype), np.arange(num_train, num_samples, dtype=dtype)


@dataclass(frozen=True)
class DataPlan:
    """What this cluster's loaders read, settled (and checked) before the process group forms."""

    seed: int
    seq_length: int
    galaxy_rank: int
    vocab_size: int
    corpus: PackedCorpus | None = None
    """None: fake data."""
    train_ids: np.ndarray | None = None
    val_ids: np.ndarray | None = None
    dealt: bool = False
    """An elastic galaxy: the ledger deals pages of one galaxy-wide order (:class:`PageSampler`)."""

    def epoch_pages(self, page_samples: int) -> float | None:
        """Pages of ``page_samples`` in one pass over the training set when the ledger deals a corpus (its
        deal's cursor over it is the galaxy's epoch); ``None`` otherwise."""
        if not self.dealt or self.train_ids is None:
            return None
        return len(self.train_ids) / page_samples


def plan_data(
    config: Config, model_vocab_size: int, world_size: int, galaxy_rank: int, galaxy_size: int
) -> DataPlan:
    """Check the data flags, pack raw data into the cache if needed, and split it for this cluster.

    Every failure is a one-line ConfigError raised in every rank on its own (the ranks not packing wait for
    the one that does and re-raise its error), so no rank is left waiting in a rendezvous."""
    dealt = config.hv is not None and config.hv.elastic
    if dealt:  # one order for the galaxy, dealt by the ledger: every cluster reads from all of it
        galaxy_rank, galaxy_size = 0, 1
    plan = DataPlan(config.seed, config.seq_length, galaxy_rank, model_vocab_size, dealt=dealt)
    if config.dataset_path is None:
        return plan
    tokenizer = load_tokenizer(config.path_tokenizer)
    source = find_source(config.dataset_path, config.dataset_text_field)
    if source.kind != "packed":  # fail before spending the packing time
        check_fits_model(tokenizer.vocab_size, tokenizer.name, model_vocab_size)
    corpus = prepare_cached(source, config.dataset_text_field, tokenizer, config.data_cache_dir)
    if config.path_tokenizer is not None and corpus.tokenizer_fingerprint != tokenizer.fingerprint:
        raise ConfigError(
            f"--dataset-path {config.dataset_path} was packed with tokenizer {corpus.tokenizer}, not "
            f"--path-tokenizer {config.path_tokenizer}: repack it, or drop --path-tokenizer"
        )
    check_fits_model(corpus.vocab_size, corpus.tokenizer, model_vocab_size)
    num_samples = corpus.num_tokens // config.seq_length
    train_ids, val_ids = split_samples(num_samples, config.seed, galaxy_size, galaxy_rank)
    if num_samples < 2 or (num_samples - len(val_ids)) // galaxy_size < world_size:
        raise ConfigError(
            f"--dataset-path {config.dataset_path}: {corpus.num_tokens} tokens pack into {num_samples} "
            f"samples of --seq-length {config.seq_length} ({len(val_ids)} held out), fewer than one per rank "
            f"({galaxy_size} cluster(s) x {world_size} rank(s)): use more data or a shorter --seq-length"
        )
    return DataPlan(
        config.seed, config.seq_length, galaxy_rank, model_vocab_size, corpus, train_ids, val_ids, dealt
    )


def build_train_loader(
    plan: DataPlan,
    *,
    per_device_batch: int,
    rank: int,
    world_size: int,
    num_workers: int,
    grad_accum: int = 1,
) -> StatefulDataLoader:
    """A stateful loader of ``{"input_ids": [B, T], "sample_id": [B]}`` micro-batches for this rank.

    ``state_dict()`` / ``load_state_dict()`` resume exactly at the next batch (the sampler's position is the
    whole state; the datasets are pure functions of position). Dealt (an elastic galaxy): a
    :class:`PageSampler` over the galaxy's one order, read through :class:`DealtBatches`."""
    stream = GALAXY_STREAM if plan.dealt else cluster_stream(plan.galaxy_rank)
    if plan.corpus is None:
        dataset: Dataset = FakeSequences(plan.seed, stream, plan.vocab_size, plan.seq_length)
    else:
        dataset = PackedSamples(plan.corpus, plan.seq_length, plan.train_ids, _seed_of(plan.seed, stream))
    sampler: Sampler[int] = (
        PageSampler(per_device_batch, rank, world_size, grad_accum)
        if plan.dealt
        else ClusterSampler(per_device_batch, rank, world_size)
    )
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


def build_eval_loader(
    plan: DataPlan, *, per_device_batch: int, rank: int, world_size: int, samples: int
) -> DataLoader:
    """This rank's share of the validation set, in batches of at most ``per_device_batch``, the same every
    time (read in-process: a validation pass is short, and worker start-up would cost more than it saves).

    The validation set is the first ``samples`` held-out positions, rounded up to a multiple of
    ``world_size`` so that every rank runs as many forward passes (FSDP's all-gathers must pair up); rank r
    reads positions r, r + W, … . It depends on neither the batch size nor (beyond that rounding) the rank
    count: a cluster of batch 4 and one of batch 8, or a run resumed on other ranks, report val_loss on the
    same samples."""
    if plan.corpus is None:
        dataset: Dataset = FakeSequences(plan.seed, FAKE_VAL_STREAM, plan.vocab_size, plan.seq_length)
    else:
        dataset = PackedSamples(plan.corpus, plan.seq_length, plan.val_ids, reshuffle_seed=None)
    per_rank = -(-samples // world_size)
    positions = range(rank, per_rank * world_size, world_size)
    return DataLoader(dataset, batch_size=per_device_batch, sampler=positions, num_workers=0)
