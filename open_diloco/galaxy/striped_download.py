"""A shard's state downloaded in parts from every cluster that holds it: the client's side, in the averager's
process (``CanonicalAverager.download_striped``). The parts' planning is ``galaxy/stripe_plan.py``; the
server's snapshots are ``galaxy/state_pins.py``.

The steps: pin the state at every holder (the first holder is the cluster the ranks agreed on: its outer step
and ``shard_hash`` are the ones wanted); keep the holders whose pinned snapshot is the same (same outer step,
hash, shapes and part hashes); allocate the destination tensors once; fetch the parts from all of them at
once, each checked against its hash as it lands and copied into place (no buffer of a whole state per
holder); a part that fails or lags is fetched from another holder. The caller checks the whole state against
``shard_hash`` as for any download (``outer/adoption.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.compression import deserialize_tensor_stream
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout

from open_diloco.galaxy.stripe_plan import StripePlan, part_bytes_for, split_into_parts
from open_diloco.outer.digests import fingerprint_bytes

log = logging.getLogger(__name__)

PIN_SECONDS = 10.0
"""How long a holder may take to pin its snapshot and describe it (hashing every part of it)."""
MESSAGE_SECONDS = 60.0
"""The most a part's stream may stay silent before it counts as failed (a holder gone mid-part). A part as a
whole may take the download's remaining time: on a slow link a 4 MiB part takes long, and a slow holder's part
is hedged at an idle holder anyway (``stripe_plan.HEDGE_AFTER_SECONDS``)."""
POLL_SECONDS = 0.05
"""How often an idle fetcher looks for work (a part landed elsewhere, a lagging one to hedge)."""
SAME_STATE_KEYS = ("shapes", "dtypes", "part_values", "hashes")


@dataclass(frozen=True)
class StripeStats:
    """What a striped download did, for its one log line and the caller's checks."""

    holders: list[str]
    """The holders that served the wanted state (pinned), the first one the agreed source."""
    parts: dict[str, int]
    """Parts each of them delivered."""
    refetched: int
    dropped: list[str]
    seconds: float
    pin_seconds: float
    """Of :attr:`seconds`, until every holder had pinned its snapshot and described its parts."""
    nbytes: int

    def line(self) -> str:
        rate = self.nbytes / max(self.seconds, 1e-9) / 1e6
        parts = ", ".join(f"{holder[-6:]}: {count}" for holder, count in self.parts.items())
        return (
            f"striped state download: {len(self.holders)} holder(s), {sum(self.parts.values())} parts "
            f"({parts}), {self.nbytes / 1e6:.1f} MB in {self.seconds:.2f} s "
            f"(pinned in {self.pin_seconds:.2f} s), {rate:.1f} MB/s, "
            f"{self.refetched} part(s) re-fetched, {len(self.dropped)} holder(s) dropped"
        )


class StripedDownload:
    """One striped download over ``holders`` (base58 PeerIDs, the agreed source first), within ``timeout``.

    ``stub_for(peer)`` gives the averager's stub for a peer (the allowlist checked); ``serializer`` is the
    averager's (msgpack)."""

    def __init__(self, stub_for, serializer, holders: list[str], timeout: float, state_bytes: int):
        self.stub_for, self.serializer = stub_for, serializer
        self.holders, self.timeout = list(dict.fromkeys(holders)), timeout
        self.part_bytes = part_bytes_for(state_bytes, len(self.holders))
        self.deadline = time.monotonic() + timeout
        self.source_pinned = False
        """Whether the agreed source answered the pin: when not (an older peer without the RPC, say), the
        caller may take the state in one stream instead."""

    async def run(self) -> tuple[dict[str, Any], list[torch.Tensor], StripeStats] | None:
        """``(metadata, tensors, stats)`` of the wanted state; ``None`` when the agreed source serves none,
        or no holder is left before every part landed, or the time is up."""
        started = time.monotonic()
        pinned = await asyncio.gather(*(self._pin(holder) for holder in self.holders))
        wanted, pin_seconds = pinned[0], time.monotonic() - started
        if wanted is None:
            return None
        self.source_pinned = True
        holders = [holder for holder, got in zip(self.holders, pinned, strict=True) if _same(got, wanted)]
        tensors = [
            torch.empty(shape, dtype=getattr(torch, dtype))
            for shape, dtype in zip(wanted["shapes"], wanted["dtypes"], strict=True)
        ]
        parts = split_into_parts([tensor.numel() for tensor in tensors], wanted["part_values"])
        hashes = [digest for per_tensor in wanted["hashes"] for digest in per_tensor]
        plan = StripePlan(parts, holders)
        step = wanted["metadata"].get("outer_step")
        fetchers = [
            asyncio.create_task(self._fetcher(plan, holder, step, tensors, hashes))
            for holder in holders
            for _ in range(plan.in_flight_per_holder)
        ]
        try:
            while not plan.complete and not plan.hopeless() and time.monotonic() < self.deadline:
                await asyncio.sleep(POLL_SECONDS)
        finally:
            for fetcher in fetchers:
                fetcher.cancel()
            await asyncio.gather(*fetchers, return_exceptions=True)
        if not plan.complete:
            log.warning(
                "a striped state download came short: %d of %d parts from %s",
                len(plan.landed_from),
                len(parts),
                plan.parts_by_holder(),
            )
            return None
        stats = StripeStats(
            holders=holders,
            parts=plan.parts_by_holder(),
            refetched=plan.refetched,
            dropped=sorted(plan.dropped),
            seconds=time.monotonic() - started,
            pin_seconds=pin_seconds,
            nbytes=sum(tensor.numel() * tensor.element_size() for tensor in tensors),
        )
        return wanted["metadata"], tensors, stats

    async def _pin(self, holder: str) -> dict[str, Any] | None:
        """``holder``'s description of the snapshot it pinned (``StatePins``); ``None`` when it serves
        none in time. All holders are asked at once, for whatever state they hold: the first one's is the
        wanted one (the agreed source), and a holder whose snapshot differs is left out."""
        request = dict(outer_step=None, part_bytes=self.part_bytes)
        try:
            stub = self.stub_for(holder)
            answer = await asyncio.wait_for(
                stub.rpc_pin_state(averaging_pb2.DownloadData(metadata=self.serializer.dumps(request))),
                min(PIN_SECONDS, self._left()),
            )
            return self.serializer.loads(answer.metadata) if answer.metadata else None
        except Exception as err:  # unreachable, refused, an older peer without the RPC: not a holder
            log.warning("pinning the state at %s failed: %r", holder, err)
            return None

    async def _fetcher(
        self, plan: StripePlan, holder: str, step: Any, tensors: list[torch.Tensor], hashes: list[str]
    ) -> None:
        """Fetch the parts ``plan`` gives ``holder``, one at a time, until every part landed or the holder is
        dropped."""
        while not plan.complete and holder not in plan.dropped:
            index = plan.next_for(holder, time.monotonic())
            if index is None:
                await asyncio.sleep(POLL_SECONDS)
                continue
            part = plan.parts[index]
            try:
                values = await asyncio.wait_for(self._fetch(holder, step, part), max(0.0, self._left()))
            except Exception as err:
                log.debug("part %s from %s failed: %r", part, holder, err)
                values = None
            if values is None or values.numel() != part.end - part.start:
                plan.failed(index, holder)
            elif fingerprint_bytes(values) != hashes[index]:
                log.warning("a state part from %s does not match its hash: dropping that holder", holder)
                plan.failed(index, holder, wrong=True)
            elif plan.landed(index, holder, time.monotonic()):
                tensors[part.tensor].view(-1)[part.start : part.end].copy_(values)

    async def _fetch(self, holder: str, step: Any, part) -> torch.Tensor | None:
        """One part's values from ``holder``'s snapshot at ``step``; ``None`` for an empty answer (the pin
        dropped, refused)."""
        request = dict(outer_step=step, tensor=part.tensor, start=part.start, end=part.end)
        stub = self.stub_for(holder)
        stream = await stub.rpc_download_state_part(
            averaging_pb2.DownloadData(metadata=self.serializer.dumps(request))
        )

        async def pieces():
            async for message in aiter_with_timeout(stream, timeout=MESSAGE_SECONDS):
                yield [message.tensor_part]

        got = await deserialize_tensor_stream(pieces())
        return got[0].reshape(-1) if len(got) == 1 else None

    def _left(self) -> float:
        return self.deadline - time.monotonic()


def _same(got: dict[str, Any] | None, wanted: dict[str, Any]) -> bool:
    """A holder pinned the wanted state: the same outer step and shard hash, and the same parts."""
    if got is None:
        return False
    keys = ("outer_step", "shard_hash")
    if any(got["metadata"].get(key) != wanted["metadata"].get(key) for key in keys):
        return False
    return all(got.get(key) == wanted.get(key) for key in SAME_STATE_KEYS)
