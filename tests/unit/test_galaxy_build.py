"""galaxy/build.py: the galaxy is built from the configuration objects, and nothing below them keeps a default
of its own (one that drifted once: ``sparse_rule`` was ``random`` below config.py, ``magnitude`` in it)."""

from __future__ import annotations

import inspect
import typing

import pytest

from open_diloco.config import HvConfig

pytest.importorskip("hivemind")

from hivemind.compression import CompressionBase  # noqa: E402

from open_diloco.galaxy.averager import HivemindAverager  # noqa: E402
from open_diloco.galaxy.build import ClusterShard, start_shard_averager, wire_compression  # noqa: E402
from open_diloco.outer.codecs import score_values, wire_codecs  # noqa: E402


@pytest.mark.parametrize("compression", typing.get_args(HvConfig.model_fields["compression"].annotation))
def test_every_compression_flag_has_a_wire_compression(compression):
    assert isinstance(wire_compression(HvConfig(compression=compression)), CompressionBase)


BELOW_CONFIG = [start_shard_averager, HivemindAverager.__init__, wire_codecs, score_values]


@pytest.mark.parametrize("function", BELOW_CONFIG)
def test_nothing_below_config_has_a_default_of_its_own(function):
    defaults = [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    ]
    assert not defaults, f"{function.__qualname__} defaults {defaults}: take them from HvConfig instead"


def test_the_schema_is_what_every_cluster_must_share():
    shard = ClusterShard(index=1, ranks=2, numel=10, model_fingerprint="abc", model_config={"hidden_size": 8})
    hv = HvConfig(compression="sparse", sparse_density=0.05)
    assert shard.schema(hv) == {
        "model_fingerprint": "abc",
        "ranks": 2,
        "codec": "sparse magnitude 0.05",
        "fragments": 1,
        "round_steps": "equal",
        "membership": "fixed",
        "model_config": {"hidden_size": 8},
    }
    elastic = HvConfig(galaxy_size=2, cluster_id="site-b")  # (no rank: a cluster of an elastic galaxy)
    # an elastic galaxy deals pages: every cluster's stride holds as many, of as many tokens
    assert shard.schema(elastic)["membership"] == "elastic, 500 pages a stride of 0 samples of 0 tokens"
    # ... and as many samples: the same tokens a step, cut otherwise, would deal pages that overlap
    pages = [
        ClusterShard(0, 1, 10, "abc", tokens_per_step=1024, samples_per_step=samples).schema(elastic)[
            "membership"
        ]
        for samples in (8, 4)
    ]
    assert pages == [
        "elastic, 500 pages a stride of 8 samples of 128 tokens",
        "elastic, 500 pages a stride of 4 samples of 256 tokens",
    ]
    # with steps by speed, a Δ's weight counts steps: every cluster's step must hold as many tokens
    by_speed = ClusterShard(index=0, ranks=1, numel=10, model_fingerprint="abc", tokens_per_step=4096)
    schema = by_speed.schema(HvConfig(round_steps="by-speed"))
    assert schema["round_steps"] == "by-speed, 4096 tokens per inner step"
    assert ClusterShard.flat(7).schema(HvConfig())["model_fingerprint"] == "numel 7"
