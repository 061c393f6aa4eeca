"""Real data without processes: sources, packing, tokenizers, the galaxy split, the sampler contract,
resume."""

from __future__ import annotations

import json
import os
import threading
import time
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from open_diloco.config import Config, HvConfig
from open_diloco.corpus import PackedCorpus, find_source, pack_corpus
from open_diloco.corpus_cache import _wait_for_lock, prepare_cached
from open_diloco.data import (
    ClusterSampler,
    DealtBatches,
    PackedSamples,
    build_eval_loader,
    build_train_loader,
    plan_data,
    split_samples,
)
from open_diloco.errors import ConfigError
from open_diloco.tokenizer import ByteTokenizer, load_tokenizer
from tests.data_corpus import (
    TINY_MODEL,
    jsonl_file,
    parquet_file,
    saved_dataset,
    stdlib_sources,
    text_dir,
    tokenizer_dir,
)

DOCS = 12


def _pack(tmp_path: Path, dataset_path: Path | str, tokenizer=None) -> PackedCorpus:
    source = find_source(str(dataset_path), "text")
    return pack_corpus(source, "text", tokenizer or ByteTokenizer(), tmp_path / "packed", progress=False)


def test_byte_tokenizer_matches_the_test_model() -> None:
    model = json.loads((TINY_MODEL / "config.json").read_text())
    tokenizer = ByteTokenizer()
    assert (tokenizer.BOS, tokenizer.EOS, tokenizer.PAD) == (
        model["bos_token_id"],
        model["eos_token_id"],
        model["pad_token_id"],
    )
    assert tokenizer.encode_batch(["hé"])[0].tolist() == list("hé".encode())


def test_text_dir_packs_every_file_in_name_order_with_eos(tmp_path: Path) -> None:
    corpus = _pack(tmp_path, text_dir(tmp_path, DOCS))
    expected = b"".join(p.read_bytes() for p in stdlib_sources(DOCS))
    tokens = np.asarray(corpus.tokens())
    assert (tokens == ByteTokenizer.EOS).sum() == DOCS
    assert bytes(tokens[tokens != ByteTokenizer.EOS].astype(np.uint8)) == expected
    assert corpus.dtype == "uint16" and corpus.num_tokens == len(expected) + DOCS


@pytest.mark.parametrize(
    "make", [jsonl_file, parquet_file, saved_dataset], ids=["jsonl", "parquet", "save_to_disk"]
)
def test_every_format_packs_to_the_same_tokens(tmp_path: Path, make) -> None:
    reference = np.asarray(_pack(tmp_path / "ref", text_dir(tmp_path, DOCS)).tokens())
    corpus = _pack(tmp_path, make(tmp_path, DOCS))
    np.testing.assert_array_equal(np.asarray(corpus.tokens()), reference)


def test_glob_selects_files(tmp_path: Path) -> None:
    directory = text_dir(tmp_path, DOCS)
    source = find_source(str(directory / "*s*.py"), "text")
    assert source.kind == "text"
    assert [f.name for f in source.files] == sorted(p.name for p in directory.glob("*s*.py"))
    assert 0 < len(source.files) < DOCS


def test_local_tokenizer_packs_and_records_its_fingerprint(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path, 300))
    corpus = _pack(tmp_path, jsonl_file(tmp_path, 3), tokenizer)
    tokens = np.asarray(corpus.tokens())
    assert corpus.tokenizer_fingerprint == tokenizer.fingerprint and corpus.vocab_size == 300
    assert (tokens == tokenizer.eos_id).sum() == 3 and tokens.max() < 300


def test_cache_is_reused_and_keyed_by_tokenizer(tmp_path: Path) -> None:
    source = find_source(str(text_dir(tmp_path, 4)), "text")
    first = prepare_cached(source, "text", ByteTokenizer(), tmp_path / "cache")
    stamp = (first.root / "tokens.bin").stat().st_mtime_ns
    again = prepare_cached(source, "text", ByteTokenizer(), tmp_path / "cache")
    assert again.root == first.root and (again.root / "tokens.bin").stat().st_mtime_ns == stamp
    other = prepare_cached(source, "text", load_tokenizer(tokenizer_dir(tmp_path, 300)), tmp_path / "cache")
    assert other.root != first.root
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [first.root.name, other.root.name]
    )


def test_waiting_rank_raises_the_preparers_error(tmp_path: Path) -> None:
    lock, error = tmp_path / "c.lock", tmp_path / "c.error"
    lock.touch()

    def preparer_fails() -> None:
        time.sleep(0.3)
        error.write_text("--dataset-path x: a record has no text field 'text'")
        lock.unlink()

    threading.Thread(target=preparer_fails).start()
    with pytest.raises(ConfigError, match="no text field"):
        _wait_for_lock(lock, error, stale_after_s=30)


def test_a_failed_preparation_waits_for_the_other_ranks_to_say_it(tmp_path: Path, monkeypatch) -> None:
    # torchrun stops every rank once one exits: the preparer waits until the other local rank raised the error
    # too (a rank arriving late raises the fresh error without packing again)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')  # found while packing, not by the first look
    source, cache = find_source(str(bad), "text"), tmp_path / "cache"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    said: list[str] = []

    def late_rank() -> None:
        time.sleep(1.0)
        with pytest.raises(ConfigError, match="no text field") as late:
            prepare_cached(source, "text", ByteTokenizer(), cache)
        said.append(str(late.value))

    threading.Thread(target=late_rank).start()
    started = time.monotonic()
    with pytest.raises(ConfigError, match="no text field") as first:
        prepare_cached(source, "text", ByteTokenizer(), cache)
    assert said == [str(first.value)] and 1.0 < time.monotonic() - started < 5.0  # not the 10 s bound
    assert not [p for p in cache.iterdir() if p.is_dir()]  # nothing half-packed was published


def test_stale_lock_of_a_dead_preparer_is_broken(tmp_path: Path) -> None:
    lock = tmp_path / "c.lock"
    lock.touch()
    os.utime(lock, (time.time() - 600, time.time() - 600))
    _wait_for_lock(lock, tmp_path / "c.error", stale_after_s=120)
    assert not lock.exists()


def test_split_is_disjoint_covering_deterministic_and_seeded() -> None:
    num_samples, galaxy = 1000, 3
    parts = [split_samples(num_samples, 7, galaxy, rank) for rank in range(galaxy)]
    val = parts[0][1]
    assert all(np.array_equal(p[1], val) for p in parts)
    assert val.tolist() == list(range(990, 1000))
    train = np.concatenate([p[0] for p in parts])
    assert len(train) == len(set(train.tolist())) == 990 and set(train.tolist()).isdisjoint(val.tolist())
    assert np.array_equal(split_samples(num_samples, 7, galaxy, 1)[0], parts[1][0])
    assert not np.array_equal(split_samples(num_samples, 8, galaxy, 1)[0], parts[1][0])


def test_two_ranks_see_the_global_batch_of_one_process_with_accumulation() -> None:
    per_device, blocks = 3, 4
    single = list(islice(iter(ClusterSampler(per_device * 2, 0, 1)), per_device * 2 * blocks))
    ranks = [list(islice(iter(ClusterSampler(per_device, r, 2)), per_device * blocks)) for r in range(2)]
    for block in range(blocks):
        global_batch = single[block * per_device * 2 : (block + 1) * per_device * 2]
        from_ranks = sum((ranks[r][block * per_device : (block + 1) * per_device] for r in range(2)), [])
        assert from_ranks == global_batch


def test_every_epoch_is_a_reshuffled_pass_over_the_part(tmp_path: Path) -> None:
    corpus = _pack(tmp_path, text_dir(tmp_path, 3))
    ids = np.arange(5, dtype=np.uint32)
    samples = PackedSamples(corpus, 16, ids, reshuffle_seed=1)
    epochs = [[samples[e * 5 + i]["sample_id"] for i in range(5)] for e in range(3)]
    assert epochs[0] == list(range(5))
    assert all(sorted(e) == list(range(5)) for e in epochs) and epochs[1] != epochs[2]
    window = samples[2]["input_ids"]
    assert window.dtype == torch.int64 and window.tolist() == np.asarray(corpus.tokens()[32:48]).tolist()


def _config(tmp_path: Path, dataset_path: Path | str, **overrides) -> Config:
    base = dict(
        dataset_path=str(dataset_path),
        data_cache_dir=tmp_path / "cache",
        seq_length=64,
        per_device_train_batch_size=2,
        total_batch_size=4,
        seed=3,
    )
    return Config(**{**base, **overrides})


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_restored_from_state_dict_continues_with_the_next_batch(
    tmp_path: Path, num_workers: int
) -> None:
    plan = plan_data(
        _config(tmp_path, text_dir(tmp_path, DOCS)), 2048, world_size=2, galaxy_rank=0, galaxy_size=1
    )
    args = dict(per_device_batch=2, rank=1, world_size=2, num_workers=num_workers)
    loader = build_train_loader(plan, **args)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    expected = [next(batches)["sample_id"].tolist() for _ in range(3)]
    restored = build_train_loader(plan, **args)
    restored.load_state_dict(state)
    assert [b["sample_id"].tolist() for b in islice(iter(restored), 3)] == expected


@pytest.mark.parametrize("num_workers", [0, 1])
def test_an_elastic_galaxy_reads_the_pages_the_ledger_dealt_of_one_order(tmp_path: Path, num_workers) -> None:
    """Dealt (no --hv.world-rank): every cluster plans the whole training set in one order, page p is
    positions p·S … p·S + S − 1 of it (S: one inner step of the cluster, every rank and micro-batch), and the
    batches follow the pages the deal names, starting again where the deal ran out or changed."""
    config = _config(tmp_path, text_dir(tmp_path, DOCS))
    elastic = config.model_copy(update={"hv": HvConfig(galaxy_size=2, cluster_id="site-a")})
    plan = plan_data(elastic, 2048, world_size=2, galaxy_rank=0, galaxy_size=1)
    whole = plan_data(config, 2048, world_size=2, galaxy_rank=0, galaxy_size=1)
    assert plan.dealt and (plan.train_ids == whole.train_ids).all()  # the whole set, in the galaxy's order
    assert plan.epoch_pages(4) == len(plan.train_ids) / 4 and whole.epoch_pages(4) is None
    order = [
        build_train_loader(plan, per_device_batch=2, rank=r, world_size=2, num_workers=0) for r in (0, 1)
    ]
    for loader in order:
        loader.sampler.pages = list(range(6))
    straight = [[b["sample_id"].tolist() for b in loader] for loader in order]  # pages 0..5, grad accum 1
    # step -> the pages from it on, as the deal knows them: at step 2 a taken chain deals otherwise (page 2
    # was prefetched for it: dropped), at step 3 the deal known at step 2 ran out
    deal = {1: [4, 2, 3], 2: [5], 3: [0, 1]}
    ranks = [
        build_train_loader(plan, per_device_batch=2, rank=r, world_size=2, num_workers=num_workers)
        for r in (0, 1)
    ]
    for rank, loader in enumerate(ranks):
        feed = DealtBatches(loader, lambda step: deal[step][0], deal.get, grad_accum=1)
        read = [next(feed.at(step))["sample_id"].tolist() for step in (1, 2, 3)]
        assert read == [straight[rank][4], straight[rank][5], straight[rank][0]], rank
    with pytest.raises(RuntimeError, match="dealt this cluster no page"):
        DealtBatches(ranks[0], {}.get, {}.get, grad_accum=1).at(1)


def test_eval_batches_are_held_out_and_repeat(tmp_path: Path) -> None:
    plan = plan_data(
        _config(tmp_path, text_dir(tmp_path, DOCS)), 2048, world_size=1, galaxy_rank=0, galaxy_size=1
    )
    loader = build_eval_loader(plan, per_device_batch=2, rank=0, world_size=1, samples=4)
    first = [b["sample_id"].tolist() for b in loader]
    assert first == [b["sample_id"].tolist() for b in loader] and len(first) == 2
    assert set(sum(first, [])) <= set(plan.val_ids.tolist())
    assert set(plan.val_ids.tolist()).isdisjoint(plan.train_ids.tolist())


@pytest.mark.parametrize("fake", [False, True])
def test_the_validation_set_depends_on_neither_batch_size_nor_rank_count(tmp_path: Path, fake: bool) -> None:
    """val_loss of runs with other batches or rank counts (DDP against a galaxy's clusters of half the batch,
    a resume on more ranks) is measured on the same samples: the first ``samples`` positions, every rank
    running as many batches (FSDP pairs their all-gathers), the last one short where the batch does not
    divide the rank's share."""
    config = (
        Config(fake_data=True, seq_length=64, per_device_train_batch_size=2, total_batch_size=4, seed=3)
        if fake
        else _config(tmp_path, text_dir(tmp_path, DOCS))
    )
    plan = plan_data(config, 2048, world_size=1, galaxy_rank=0, galaxy_size=1)

    def read(batch: int, ranks: int) -> list[list[torch.Tensor]]:
        loaders = [
            build_eval_loader(plan, per_device_batch=batch, rank=r, world_size=ranks, samples=12)
            for r in range(ranks)
        ]
        return [[b["input_ids"] for b in loader] for loader in loaders]

    def samples(ranks_batches: list[list[torch.Tensor]]) -> list[list[int]]:
        return sorted(row.tolist() for batches in ranks_batches for batch in batches for row in batch)

    one = read(batch=12, ranks=1)
    for batch, ranks in ((4, 1), (5, 1), (3, 2), (8, 2), (2, 3), (4, 4)):
        seen = read(batch, ranks)
        assert samples(seen) == samples(one), (batch, ranks)
        assert len({len(batches) for batches in seen}) == 1, "every rank runs as many forward passes"
    assert [len(b) for b in read(batch=5, ranks=1)[0]] == [5, 5, 2]


def test_packed_dir_is_used_directly_and_checks_the_tokenizer(tmp_path: Path) -> None:
    corpus = _pack(tmp_path, text_dir(tmp_path, DOCS))
    plan = plan_data(_config(tmp_path, corpus.root), 2048, world_size=1, galaxy_rank=0, galaxy_size=1)
    assert plan.corpus is not None and plan.corpus.root == corpus.root
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ConfigError, match="was packed with tokenizer byte"):
        plan_data(_config(tmp_path, corpus.root, path_tokenizer=tokenizer_dir(tmp_path, 300)), 2048, 1, 0, 1)
