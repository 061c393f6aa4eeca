"""A cluster's DHT process must not grow with the rounds: hivemind's DHTNode keeps an entry for every key it
ever looked up, and each round's matchmaking key is new (docs/results/memory-soak.md)."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest

from open_diloco.galaxy.dht import (
    _forget_finished_searches,
    forget_finished_searches,
    shutdown_dht,
    start_dht,
)
from open_diloco.galaxy.round_wait import round_key_bits


async def _searched_keys(_dht, node) -> int:
    return len(node.pending_get_requests)


def test_forgetting_keeps_the_searches_still_running():
    node = type("Node", (), {})()
    node.pending_get_requests = defaultdict(set, {"done": set(), "running": {"a search"}, "also done": set()})
    assert asyncio.run(_forget_finished_searches(None, node)) == 2
    assert dict(node.pending_get_requests) == {"running": {"a search"}}


@pytest.mark.timeout(120)
def test_a_dht_forgets_the_keys_of_past_rounds():
    dht = start_dht([], ["/ip4/127.0.0.1/tcp/0"], [], join_timeout=30)
    try:
        for round_id in range(50):  # what 50 rounds' matchmaking leaves, one lookup each
            dht.get(f"run/shard0.0b{round_key_bits(round_id, 0)}", latest=True)
        assert dht.run_coroutine(_searched_keys) == 50  # hivemind's own bookkeeping: the leak, if left alone
        forget_finished_searches(dht)
        assert dht.run_coroutine(_searched_keys) == 0  # (the pipe runs requests in order)
    finally:
        shutdown_dht(dht)
