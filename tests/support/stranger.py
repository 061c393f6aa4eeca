"""A stranger to a galaxy, for the allowlist test: a real averager that knows the DHT address, the run id and
the shard's size (so hivemind's matchmaking would group it with the members), but is on nobody's allowlist.

It tries to download the state once, then to average ``--rounds`` rounds, then asks every member's averager
to lead its group, and prints one JSON line per attempt: ``{"download": bool}``,
``{"round": i, "target": r, "group_size": n}`` (``r``: the galaxy round it waited in) and
``{"asked_to_lead": {peer_id: answer}}`` (the code of each member's first answer, ``PROTOCOL_VIOLATION`` when
it refuses). A round's matchmaking key holds the round and the attempt, so it does what an intruder would:
reads the members' records for the round they are in and waits under the key of one they will soon reach
(:class:`MembersPace`), where they come to look for their group. Whether its matchmaking catches a member
looking for a group (a window of tens of milliseconds on loopback) is chance, so it then sends each member the
join request that matchmaking would have sent, over the real network. It ends its averager, DHT and p2pd
itself (the test checks by PID that nothing is left).

    python -m tests.support.stranger --initial-peers MADDR --run-id ID --numel N --model-fingerprint F
        [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from functools import partial

import torch
from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.timed_storage import get_dht_time

from open_diloco.config import HvConfig
from open_diloco.galaxy.averager import HivemindAverager
from open_diloco.galaxy.build import ClusterShard, start_shard_averager
from open_diloco.galaxy.canonical_averager import CanonicalAverager
from open_diloco.galaxy.dht import DHT_PIPE_LOCK

ASK_SECONDS = 10.0
"""How long one member has to answer a join request."""


class MembersPace:
    """Which round to wait in, so that the stranger is there before the members.

    The members' records show the round they started up to a heartbeat (1 s in the test) plus a DHT read
    ago, and on a fast machine they run a round every ~0.4 s: a stranger that waits in the round it read
    arrives after the members have grouped and gone, is overtaken, and never asks them anything (seen in a
    run of the e2e tests one by one: 8 rounds, no refusal). So it waits in the round they will reach
    :data:`LEAD_SECONDS` from now, at the pace measured between its own reads, and always at least one ahead.
    """

    LEAD_SECONDS = 2.0

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None

    def round_ahead(self, members_round: int) -> int:
        now = time.monotonic()
        if self.first is None:
            self.first = (now, members_round)
        since, from_round = self.first
        rounds_per_second = (members_round - from_round) / (now - since) if now - since >= 1.0 else 0.0
        return members_round + 1 + math.ceil(rounds_per_second * self.LEAD_SECONDS)


async def _ask_to_lead(_dht: DHT, node: DHTNode, prefix: str, peer: str) -> str:
    """Ask ``peer``'s averager, from this DHT's process and its p2pd, to lead our group, as hivemind's
    matchmaking does (``Matchmaking._request_join_group``); the code of its first answer, within
    :data:`ASK_SECONDS` (dialling it included)."""
    return await asyncio.wait_for(_first_answer(node, prefix, peer), ASK_SECONDS)


async def _first_answer(node: DHTNode, prefix: str, peer: str) -> str:
    stub = CanonicalAverager.get_stub(node.p2p, PeerID.from_base58(peer), namespace=prefix)
    stream = await stub.rpc_join_group(averaging_pb2.JoinRequest(expiration=get_dht_time() + ASK_SECONDS))
    try:
        return averaging_pb2.MessageCode.Name((await anext(stream)).code)
    finally:
        await stream.aclose()


def ask_members_to_lead(averager: HivemindAverager) -> dict[str, str]:
    """Each member's answer to a join request, by its averager's PeerID (from the members' records)."""
    answers = {}
    for peer in averager.membership().sources.values():
        ask = partial(_ask_to_lead, prefix=averager.averager.prefix, peer=peer)
        try:
            with DHT_PIPE_LOCK:
                answers[peer] = averager.dht.run_coroutine(ask)
        except Exception as err:  # no answer at all: the test names what happened
            answers[peer] = f"failed: {err!r}"[:200]
    return answers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--model-fingerprint", required=True, help="the members' (else the schema check tells)"
    )
    args = parser.parse_args()
    # galaxy rank 7 of a galaxy of 2: no member's rank, which no valid configuration says (model_construct
    # skips the checks, nothing else)
    hv = HvConfig.model_construct(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        run_id=args.run_id,
        world_rank=7,
        galaxy_size=2,
        matchmaking_time=3.0,
        averaging_timeout=10.0,
        join_timeout=10.0,
        compression="none",
        member_expiry=15.0,
    )
    shard = ClusterShard(index=0, ranks=1, numel=args.numel, model_fingerprint=args.model_fingerprint)
    averager = start_shard_averager(hv, shard, initial_peers=[args.initial_peers])
    try:
        print(
            json.dumps({"peer_id": averager.peer_id, "download": averager.download_state(5.0) is not None}),
            flush=True,
        )
        pace = MembersPace()
        for round_id in range(args.rounds):
            started = averager.membership().attempts.values()
            target = pace.round_ahead(max((started_round for started_round, _ in started), default=round_id))
            try:  # waits under the key (target, 0) for the members to come and look for their group there
                report = averager.all_reduce(torch.randn(args.numel), target, {"param_hash": "stranger"})
                print(
                    json.dumps({"round": round_id, "target": target, "group_size": report.group_size}),
                    flush=True,
                )
            except Exception as err:  # a round that failed outright
                said = {"round": round_id, "target": target, "group_size": 0, "error": str(err)[:200]}
                print(json.dumps(said), flush=True)
        print(json.dumps({"asked_to_lead": ask_members_to_lead(averager)}), flush=True)
    finally:
        averager.shutdown()


if __name__ == "__main__":
    main()
