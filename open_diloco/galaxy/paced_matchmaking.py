"""What our averager process changes in hivemind's matchmaking, beside the round's key and sizes that
``CanonicalAverager.set_round`` sets: how often a looking shard reads the DHT, and when a group below the
round's floor may close after all."""

from __future__ import annotations

import asyncio
import time

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking

GROUP_POLL_SECONDS = 0.2  # a shard looking for a group reads its group key from the DHT at most this often


class PacedGroupKeyManager(GroupKeyManager):
    """hivemind's group key manager, reading who is looking for a group at most every
    :data:`GROUP_POLL_SECONDS`.

    hivemind's matchmaking asks for a new read as soon as the last one found no leader to join, so a shard
    that waits for a group (for a slower cluster, or alone until its deadline) reads the DHT back to back:
    ~40 reads a second on loopback, each a round trip through the DHT's process, its daemon and the DHT
    peers: up to a core per waiting rank (alone: 6.0 CPU-s in 6 s). Paced, a waiting cluster costs its host
    next to nothing, and a leader that appears is still seen within a fraction of
    ``--hv.matchmaking-time``."""

    _last_read = float("-inf")

    async def get_averagers(self, group_key, only_active):
        wait = self._last_read + GROUP_POLL_SECONDS - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_read = time.monotonic()
        return await super().get_averagers(group_key, only_active)


async def lower_floor_later(matchmaking: Matchmaking, group_bits: str, after: float) -> None:
    """After ``after`` seconds still in the round of ``group_bits``, let a group of two close
    (``min_group_size``): the floor was a majority of the roster while more than half of it was alive by the
    records (``outer/quorum.smallest_group``), and records that have expired since said so of a side of a
    real split. hivemind reads ``min_group_size`` each time a leader's window ends, so the next window
    closes the pair."""
    await asyncio.sleep(after)
    if matchmaking.group_key_manager.group_bits == group_bits:
        matchmaking.min_group_size = 2
