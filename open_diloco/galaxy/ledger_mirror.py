"""The ledger's mirror in the DHT: every cluster's rank 0 stores each entry it commits, so that
``open-diloco ledger --initial-peers`` shows a live galaxy's rounds without anyone's files.

A mirror, never the truth: hivemind's DHT is last-writer-wins without compare-and-swap, so it could not decide
anything clusters race for. Entries live under ``{run_id}/ledger/{round // BUCKET}``, one subkey per
``{round}:{entry hash}``: the members of a round store the same entry under the same subkey (a harmless
rewrite of the same value), and two clusters that committed different rounds r store two subkeys, both shown.
Each entry is checked against its hash when read (``outer/ledger.py``), so a forged value is refused, not
believed.
"""

from __future__ import annotations

import logging
from typing import Any

from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from open_diloco.galaxy.dht import DHT_PIPE_LOCK

log = logging.getLogger(__name__)

BUCKET = 64
"""Rounds per DHT key: a reader fetches a galaxy's last thousand rounds in 16 reads."""
MIRROR_TTL = 3600.0
"""Seconds an entry stays in the mirror: as long as a status record (the clusters' checkpoints and metrics
keep every entry for good, ``outer/ledger.py``'s ``KEEP``)."""


def bucket_key(run_id: str, bucket: int) -> str:
    """The DHT key of the entries of rounds ``bucket × BUCKET`` … ``(bucket + 1) × BUCKET − 1``."""
    return f"{run_id}/ledger/{bucket}"


def store_entries(dht: DHT, run_id: str, entries: list[dict[str, Any]], timeout: float) -> bool:
    """Store ``entries`` (wire form, with their ``hash``); ``False`` when the DHT did not take them in time
    (the caller tries again with its next publication)."""
    try:
        futures = []
        with DHT_PIPE_LOCK:
            for entry in entries:
                futures.append(
                    dht.store(
                        bucket_key(run_id, int(entry["round"]) // BUCKET),
                        entry,
                        expiration_time=get_dht_time() + MIRROR_TTL,
                        subkey=f"{entry['round']}:{entry['hash']}",
                        return_future=True,
                    )
                )
        return all(future.result(timeout=timeout) for future in futures)
    except Exception as err:  # slow, unreachable or shutting down: the next publication tries again
        log.debug("ledger entries not mirrored: %r", err)
        return False


def first_round(dht: DHT, run_id: str, timeout: float) -> dict[str, Any] | None:
    """Round 1's entry as mirrored (any, if two were): a run whose galaxy began (``None``: none seen)."""
    return next((entry for entry in read_mirror(dht, run_id, 0, timeout) if entry.get("round") == 1), None)


def read_mirror(dht: DHT, run_id: str, up_to_round: int, timeout: float) -> list[dict[str, Any]]:
    """Every entry mirrored for rounds 0 … ``up_to_round`` (wire form, unchecked), oldest round first."""
    futures = []
    with DHT_PIPE_LOCK:
        for bucket in range(up_to_round // BUCKET + 1):
            futures.append(dht.get(bucket_key(run_id, bucket), latest=True, return_future=True))
    entries: list[dict[str, Any]] = []
    for future in futures:
        try:
            found = future.result(timeout=timeout)
        except Exception as err:  # one bucket unreadable: show what the others hold
            log.debug("a ledger bucket was not read: %r", err)
            continue
        if found is not None and isinstance(found.value, dict):
            entries += [item.value for item in found.value.values() if isinstance(item.value, dict)]
    return sorted(entries, key=lambda entry: int(entry.get("round", 0)))
