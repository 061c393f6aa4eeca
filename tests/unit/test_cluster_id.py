"""Who a cluster is in an elastic galaxy (``open_diloco/cluster_id.py``): an id kept in its checkpoint
directory, the rank it stands for, and which flags make a cluster elastic."""

from __future__ import annotations

import pytest

from open_diloco.cli import parse
from open_diloco.cluster_id import kept_cluster_id, rank_of, resolve_galaxy_rank
from open_diloco.config import HvConfig
from open_diloco.errors import ConfigError

PEER = "/ip4/127.0.0.1/tcp/30001/p2p/QmcdToxaoffewe9kfjfs9Fc3rqqJVtBCiSMnU3ZyYnQ3od"


def _config(*flags: str):
    _, bound = parse(["--fake-data", *flags])
    return bound.kwargs["config"]


def test_an_id_is_made_once_kept_and_read_back_by_every_rank(tmp_path):
    first = kept_cluster_id(tmp_path / "ckpt")
    assert len(first) == 12 and kept_cluster_id(tmp_path / "ckpt") == first
    assert (tmp_path / "ckpt" / "cluster_id").read_text().strip() == first
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["cluster_id"]  # no draft left behind
    assert kept_cluster_id(tmp_path / "other") != first


def test_the_rank_is_the_ids_the_same_everywhere_and_below_2_to_the_31():
    assert rank_of("dae509e326e4") == 849359237  # pinned: every machine and every version must agree
    ranks = {rank_of(f"{i:012x}") for i in range(2000)}
    assert len(ranks) == 2000 and max(ranks) < 2**31


def test_a_cluster_started_without_a_rank_in_a_galaxy_is_elastic_and_keeps_its_id(tmp_path):
    ckpt = ["--ckpt.path", str(tmp_path / "ckpt")]
    config = resolve_galaxy_rank(_config("--hv.galaxy-size", "2", *ckpt))
    hv = config.hv
    assert hv.elastic and hv.cluster_id == kept_cluster_id(tmp_path / "ckpt")
    assert hv.world_rank == rank_of(hv.cluster_id)
    again = resolve_galaxy_rank(_config("--hv.initial-peers", PEER, *ckpt)).hv  # a restart: the same cluster
    assert (again.cluster_id, again.world_rank) == (hv.cluster_id, hv.world_rank)
    given = resolve_galaxy_rank(_config("--hv.galaxy-size", "2", "--hv.cluster-id", "site-b")).hv
    assert given.elastic and given.world_rank == rank_of("site-b")


def test_a_ranked_cluster_and_a_galaxy_of_one_are_as_before(tmp_path):
    ranked = resolve_galaxy_rank(_config("--hv.galaxy-size", "2", "--hv.world-rank", "1"))
    assert not ranked.hv.elastic and ranked.hv.world_rank == 1 and ranked.hv.cluster_id is None
    alone = resolve_galaxy_rank(_config("--hv.local-steps", "5"))
    assert not alone.hv.elastic and alone.hv.alone and alone.hv.world_rank == 0
    assert not HvConfig(galaxy_size=3).elastic  # (code that builds the config itself names its rank)


def test_real_data_is_elastic_too_and_an_empty_id_file_is_one_line(tmp_path):  # (conflicts: test_config.py)
    real = _config("--hv.galaxy-size", "2", "--ckpt.path", str(tmp_path / "ckpt"))
    real = real.model_copy(update={"fake_data": False, "dataset_path": tmp_path})
    assert resolve_galaxy_rank(real).hv.elastic  # (the ledger deals its pages: tests/unit/test_data.py)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "cluster_id").write_text("\n")
    with pytest.raises(ConfigError, match="is empty: delete it"):
        kept_cluster_id(tmp_path / "bad")
