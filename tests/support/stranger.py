"""A stranger to a galaxy, for the allowlist test: a real averager that knows the DHT address, the run id and
the shard's size (so hivemind's matchmaking would group it with the members), but is on nobody's allowlist.

It tries to download the state once, then to average ``--rounds`` rounds, and prints one JSON line per
attempt: ``{"download": bool}`` and ``{"round": i, "group_size": n}``. A round's matchmaking key holds the
round and the attempt, so it does what an intruder would: reads the members' records for the round they are in
and waits under the key of the next one, where the members come to look for their group. With ``--log`` (its
own output, with hivemind's debug log on) it goes on for up to ``--max-rounds`` until that log shows a member
refusing its join request. Its matchmaking time is longer than the members' (1 s in the tests), so it declares
itself a leader for later than they do and asks to join them, rather than wait for them to ask it (they never
would: its PeerID is not on their allowlist). It ends its averager, DHT and p2pd itself (the test checks by
PID that nothing is left).

    python -m tests.support.stranger --initial-peers MADDR --run-id ID --numel N --model-fingerprint F
        [--rounds R] [--log PATH --max-rounds M]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from open_diloco.config import HvConfig
from open_diloco.galaxy.build import ClusterShard, start_shard_averager

REFUSED = "got rejected with PROTOCOL_VIOLATION"
"""hivemind's debug line when a leader refuses a join request (a member's allowlist:
``CanonicalAverager``)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--model-fingerprint", required=True, help="the members' (else the schema check tells)"
    )
    parser.add_argument(
        "--log", help="this process's own output: go on until it shows a refused join request"
    )
    parser.add_argument("--max-rounds", type=int, default=10)
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
        for round_id in range(args.max_rounds if args.log else args.rounds):
            if round_id >= args.rounds and REFUSED in Path(args.log).read_text():
                break
            started = averager.membership().attempts.values()
            galaxy_round = max((started_round for started_round, _ in started), default=round_id)
            try:  # the members' next round starts from outer step galaxy_round: its key is (galaxy_round, 0)
                report = averager.all_reduce(
                    torch.randn(args.numel), galaxy_round, {"param_hash": "stranger"}
                )
                print(json.dumps({"round": round_id, "group_size": report.group_size}), flush=True)
            except Exception as err:  # a round that failed outright
                print(json.dumps({"round": round_id, "group_size": 0, "error": str(err)[:200]}), flush=True)
    finally:
        averager.shutdown()


if __name__ == "__main__":
    main()
