r"""A joiner's state download from one holder against the same download striped over several (issue 51), in
the same run, between real averagers: over loopback, or over the WAN lab (scripts/wan/) with a profile.

    python scripts/bench/striped_join.py --model 1m                          # loopback, a few seconds
    sudo .venv/bin/python scripts/bench/striped_join.py --model 25m --profile home --holders 3
    ... --kill-after 10     # and once more with the last holder killed (its process tree) 10 s in

Each holder is one shard averager (``galaxy/build.py``) serving the same state (θ_outer of ``--model``'s size,
random, seeded), in a lab namespace of its own with ``--profile``; the joiner, in one more, downloads it three
ways, ``--repeats`` times each: in one stream from the first holder (the path before issue 51), striped from
that holder alone, and striped over all ``--holders``. Every download is checked bitwise against the first.
Printed: seconds (median), MB/s, and the ratio of one holder's striped time to all holders'. With ``home``
(10 Mbit/s up per site) one holder's uplink bounds the first two; all holders' together bound the third, so
the ratio should come near ``--holders`` where the joiner's downlink is not the limit.
The DHT, holders and joiner are ended by PID (``open_diloco/local_galaxy.py``)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: the lab (scripts/wan) is imported as scripts.wan

MODELS = {
    "1m": REPO / "tests/models/llama-1m-fresh",
    "2m": REPO / "tests/models/llama-2m-fresh",
    "25m": REPO / "configs/models/llama-25m-fresh",
    "100m": REPO / "configs/models/llama-100m-fresh",
}
WAYS = ("stream, 1 holder", "striped, 1 holder", "striped, all holders")
KILLED = "striped, one killed"
"""With ``--kill-after S``: the striped download once more, the last holder killed (its process tree, by PID)
S seconds into it: the others deliver its parts."""


def _averager(args: argparse.Namespace, rank: int):
    """A shard averager of a galaxy of holders + joiner, the whole model one shard."""
    from open_diloco.config import HvConfig
    from open_diloco.galaxy.build import ClusterShard, start_shard_averager

    hv = HvConfig(
        host_maddrs=[f"/ip4/{args.host}/tcp/0"],
        run_id="striped-bench",
        galaxy_size=args.holders + 1,
        world_rank=rank,
        join_timeout=60.0,
        averaging_timeout=600.0,
    )
    return start_shard_averager(hv, ClusterShard.flat(args.numel), initial_peers=[args.initial_peers])


def holder(args: argparse.Namespace) -> None:
    """Serve the seeded state until ended by PID; print this averager's PeerID first."""
    import torch

    averager = _averager(args, args.rank)
    state = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    averager.serve_state(lambda: ({"outer_step": 1, "shard_hash": "bench"}, [state]))
    print(json.dumps({"peer": averager.peer_id}), flush=True)
    try:
        time.sleep(24 * 3600)
    finally:
        averager.shutdown()


def joiner(args: argparse.Namespace) -> None:
    """Download the holders' state each way ``--repeats`` times (then once with a holder killed, with
    ``--kill-after``); print the seconds of each as JSON, and a line as each starts."""
    import torch

    averager = _averager(args, args.holders)
    peers = args.peers.split(",")
    ways = {WAYS[0]: None, WAYS[1]: [], WAYS[2]: peers[1:]}
    runs = [way for _ in range(args.repeats) for way in ways] + ([KILLED] if args.kill_after else [])
    ways[KILLED] = peers[1:]
    first = None
    try:
        for way in runs:
            print(json.dumps({"starting": way}), flush=True)
            started = time.monotonic()
            got = averager.download_state(args.timeout, source=peers[0], holders=ways[way])
            seconds = time.monotonic() - started
            same = got is not None and (first is None or torch.equal(got[1][0], first))
            first = got[1][0] if first is None and got is not None else first
            print(json.dumps({"way": way, "seconds": seconds, "bitwise": same}), flush=True)
    finally:
        averager.shutdown()


def _start(galaxy, lab, endpoint: str, args: argparse.Namespace, *role: str) -> subprocess.Popen:
    host = lab.listen_address(endpoint) if lab else "127.0.0.1"
    command = [
        *(lab.exec_prefix(endpoint) if lab else []),
        *(sys.executable, "-m", "scripts.bench.striped_join", *role),
        *("--initial-peers", galaxy.maddr, "--host", host, "--numel", str(args.numel)),
        *("--holders", str(args.holders), "--timeout", str(args.timeout), "--repeats", str(args.repeats)),
        *("--kill-after", str(args.kill_after)),
    ]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
    galaxy.procs[f"{role[0]}{len(galaxy.procs)}"] = proc  # ended by PID at galaxy.close()
    return proc


def run(args: argparse.Namespace, workdir: Path, lab=None) -> dict[str, list[dict]]:
    """The holders and the joiner on ``lab`` (or loopback); the joiner's rows by way."""
    from open_diloco import processes
    from open_diloco.local_galaxy import Galaxy

    galaxy = Galaxy(workdir, lab=lab)
    try:
        holders = [
            _start(galaxy, lab, f"cluster{rank}", args, "holder", "--rank", str(rank))
            for rank in range(args.holders)
        ]
        peers = [json.loads(proc.stdout.readline())["peer"] for proc in holders]
        joining = _start(galaxy, lab, f"cluster{args.holders}", args, "joiner", "--peers", ",".join(peers))
        killer = threading.Timer(args.kill_after, processes.kill_tree, [holders[-1].pid])
        # the joiner's bound: killed past it, its output ends and the loop below with it
        bound = (args.repeats * len(WAYS) + 1) * (args.timeout + 10) + 120
        watchdog = threading.Timer(bound, processes.kill_tree, [joining.pid])
        killer.daemon = watchdog.daemon = True
        watchdog.start()
        out = []
        for line in joining.stdout:  # each download's row, and a line as each starts
            out.append(line)
            if line.startswith("{") and json.loads(line).get("starting") == KILLED:
                killer.start()
        joining.wait(timeout=10)
        killer.cancel()
        watchdog.cancel()
    finally:
        galaxy.close()
    rows: dict[str, list[dict]] = {way: [] for way in (*WAYS, KILLED)}
    for line in out:
        if line.startswith("{") and "way" in (row := json.loads(line)):
            rows[row["way"]].append(row)
    return rows


def report(rows: dict[str, list[dict]], megabytes: float, holders: int) -> str:
    lines = [
        f"state {megabytes:.1f} MB, {holders} holder(s)",
        f"{'way':<22} {'median s':>9} {'MB/s':>7} bitwise",
    ]
    medians = {}
    for way, got in rows.items():
        if not got:
            lines.append(f"{way:<22} (no download finished)")
            continue
        medians[way] = statistics.median(row["seconds"] for row in got)
        ok = all(row["bitwise"] for row in got)
        lines.append(f"{way:<22} {medians[way]:>9.2f} {megabytes / medians[way]:>7.1f} {ok}")
    if WAYS[1] in medians and WAYS[2] in medians:
        lines.append(f"1 holder ÷ {holders} holders (striped): {medians[WAYS[1]] / medians[WAYS[2]]:.2f}x")
    if KILLED in medians and WAYS[2] in medians and WAYS[1] in medians:
        # the killed holder's parts (1/holders of the state, less what it sent before) fetched again from the
        # others: at most its share at the survivors' joint rate
        bound = medians[WAYS[2]] + medians[WAYS[1]] / holders / (holders - 1)
        lines.append(
            f"one holder killed: {medians[KILLED] - medians[WAYS[2]]:+.1f} s over all holders "
            f"(its whole share again from the others: {bound - medians[WAYS[2]]:+.1f} s)"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("role", nargs="?", choices=["holder", "joiner"], help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=sorted(MODELS), default="1m")
    parser.add_argument("--profile", help="a WAN lab profile (scripts/wan/profiles.toml; needs root)")
    parser.add_argument("--holders", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="one download's bound, seconds")
    parser.add_argument(
        "--kill-after", type=float, default=0.0, help="then once more, the last holder killed after S seconds"
    )
    for internal in ("--initial-peers", "--host", "--peers"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    parser.add_argument("--numel", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.role == "holder":
        return holder(args)
    if args.role == "joiner":
        return joiner(args)
    from open_diloco.model import build_model

    args.numel = sum(p.numel() for p in build_model(MODELS[args.model], seed=0).parameters())
    with tempfile.TemporaryDirectory(prefix="striped-join-") as workdir:
        if args.profile:
            from scripts.wan.lab import Lab

            with Lab(args.holders + 1, args.profile) as lab:
                rows = run(args, Path(workdir), lab)
        else:
            rows = run(args, Path(workdir))
    print(report(rows, args.numel * 4 / 1e6, args.holders))


if __name__ == "__main__":
    main()
