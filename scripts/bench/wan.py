r"""Communication yardstick: a real galaxy over the WAN lab (scripts/wan/), per profile and model, against a
raw hivemind all-reduce of the same bytes over the same lab in the same run (issue 13).

    python scripts/bench/wan.py                                # continent + intercontinental, 2M, 2 clusters
    python scripts/bench/wan.py --profiles intercontinental --models 2m 100m --clusters 2 4
    python scripts/bench/wan.py --profiles intercontinental --models 100m \
        --codecs none bf16 int8 int4 int2 sparse
    python scripts/bench/wan.py --profiles intercontinental --models 100m \
        --codecs sparse sparse,rule=random,density=0.0625
    python scripts/bench/wan.py --profiles intercontinental --models 25m --setups direct nat nat-client
    python scripts/bench/wan.py --profiles intercontinental --models 25m --codecs int8 --local-steps 20 \
        --trainer-flags "--hv.fragments 2 --hv.sync-delay 10"

Needs root and iproute2 (the lab's). Each case builds a lab, starts `hivemind-dht` and one 1-rank cluster per
lab namespace (open_diloco/local_galaxy.py, which ends everything by PID), trains ``--rounds`` + 2 rounds of
``--local-steps`` inner steps (the first warms up; the last may lose its tail when a cluster exits right after
it: docs/results/wan.md), then runs the raw baseline in the same namespaces. Printed per case:

- ``allreduce s``: the median over the steady rounds (all but the first and the last) of ``allreduce_seconds``
  (matchmaking included), and the raw hivemind round of the same number of fp32 values;
- ``wire bound s``: what the link allows for the bytes the round measured: the busier direction of this peer's
  ``bytes_sent``/``bytes_received`` ÷ the profile's rate, plus 3 round trips (join request and accept, the
  group's start message, the first part out and its average back: the all-reduce streams its parts, so the
  rest overlaps);
- ``÷ bound``: allreduce s ÷ wire bound. ``--matchmaking-time`` (1 s by default; 4 clusters sharing 2 cores
  need more to meet) is not a fixed wait: hivemind's leader starts the round as soon as the whole galaxy has
  joined its group, so it is only paid in full when a cluster is missing. What a whole round pays is the DHT
  lookups and the joins, inside ``allreduce s``;
- ``÷ fp32``: with ``--codecs``, allreduce s ÷ that of the uncompressed case (``none``, run first) of the same
  profile, model and size in the same run; the raw baseline moves fp32, so it runs with ``none`` only;
- ``÷ direct``: with ``--setups``, allreduce s ÷ that of the ``direct`` case (every cluster reachable, run
  first) of the same profile, model and size: ``nat`` puts cluster 1 behind a NAT of the lab
  (scripts/wan/nat.py), ``nat-client`` also gives it ``--hv.client-mode`` (docs/networks.md);
- ``mm s`` and ``exchange s``: the round split at its group's forming (``matchmaking_seconds``,
  ``exchange_seconds`` of the records: the DHT lookups and joins, then the all-reduce on the wire); the
  second ``÷ bound`` is their sum ÷ wire bound, ``ex ÷ bd`` the exchange alone ÷ wire bound; ``mm last``:
  the matchmaking of the cluster that arrived last (the least over the clusters: the rendezvous itself,
  without the wait for a slower cluster). With ``--hv.sync-delay`` a sync's ``allreduce s`` runs until it
  lands, τ inner steps later, so only these two say how long the network took;
- ``link MB``: what cluster 0's link carried (both directions, headers and retransmissions, every process of
  the cluster) between one sync's record and the next; ``÷ logged``: that ÷ the round's ``bytes_sent`` +
  ``bytes_received``; ``DHT MB``: what the DHT's link carried meanwhile;
- ``tcp s``: one plain TCP connection between clusters 0 and 1 carrying a round's bytes (the busier
  direction's) each way at once, on the same path once the galaxy has stopped (scripts/bench/tcp_flow.py; 2
  clusters only): what any all-reduce over one connection per pair can reach there; ``ex ÷ tcp`` the exchange
  ÷ that; ``p2p s``: the same bytes over 2 hivemind P2P streams through p2pd, nothing reduced
  (scripts/bench/p2p_flow.py): the transport's own figure; ``ex ÷ p2p`` the exchange ÷ that;
- ``utilization``: Σ inner-step seconds ÷ wall seconds over the steady rounds (wall from when each metrics
  line appeared, polled every 50 ms): the share of time the cluster computes. On this CPU machine the inner
  steps of the clusters share 2 cores, so only the ratios travel to GPUs, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from open_diloco.local_galaxy import Galaxy, kill_tree

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repo root: the lab (scripts/wan) is imported as scripts.wan

from scripts.bench import p2p_flow, tcp_flow  # noqa: E402
from scripts.bench.wan_rounds import (  # noqa: E402
    link_figures,
    link_sample,
    split_figures,
    steady_rounds,
    watch,
)
from scripts.wan.lab import Lab  # noqa: E402

MODELS = {
    "2m": REPO / "tests/models/llama-2m-fresh",
    "25m": REPO / "configs/models/llama-25m-fresh",
    "100m": REPO / "configs/models/llama-100m-fresh",
}
ROUND_TRIPS = 3
RAW_ROUND_TIMEOUT = 300.0
"""What one raw hivemind round may take (a 96M model's round over `intercontinental` takes about a minute)."""


def model_numel(path: Path) -> int:
    from open_diloco.model import build_model

    return sum(p.numel() for p in build_model(path, seed=0).parameters())


def raw_baseline(
    lab: Lab, dht_maddr: str, numel: int, clusters: int, rounds: int, matchmaking: float
) -> list[float]:
    """Seconds of each raw hivemind round (rank 0's), the same fp32 values, one peer per cluster namespace."""
    procs = [
        subprocess.Popen(
            [
                *lab.exec_prefix(f"cluster{rank}"),
                sys.executable,
                "-m",
                "scripts.bench.wan",
                "raw",
                "--initial-peers",
                dht_maddr,
                "--host",
                lab.address(f"cluster{rank}"),
                "--numel",
                str(numel),
                "--peers",
                str(clusters),
                "--rounds",
                str(rounds),
                "--matchmaking-time",
                str(matchmaking),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(clusters)
    ]
    try:
        outputs = [proc.communicate(timeout=rounds * RAW_ROUND_TIMEOUT + 60)[0] for proc in procs]
    finally:
        for proc in procs:
            kill_tree(proc.pid)  # by PID, with its DHT, averager and p2pd; nothing if it already ended
    rows = [json.loads(line) for line in outputs[0].splitlines() if line.startswith("{")]
    if not any("seconds" in row for row in rows):
        raise RuntimeError(f"no raw hivemind round finished: {rows}")
    return [row["seconds"] for row in rows if "seconds" in row]


def raw_peer(args: argparse.Namespace) -> None:
    """One raw hivemind peer: stock ``DecentralizedAverager``, no codec, our matchmaking time."""
    import torch
    from hivemind import DHT
    from hivemind.averaging import DecentralizedAverager

    dht = DHT(initial_peers=[args.initial_peers], host_maddrs=[f"/ip4/{args.host}/tcp/0"], start=True)
    averager = DecentralizedAverager(
        [torch.randn(args.numel)],
        dht,
        prefix="rawbench",
        start=True,
        target_group_size=args.peers,
        min_group_size=args.peers,
        min_matchmaking_time=args.matchmaking_time,
        request_timeout=args.matchmaking_time / 2,
        allreduce_timeout=600,
    )
    try:
        for _ in range(args.rounds):
            start = time.monotonic()
            try:
                averager.step(timeout=RAW_ROUND_TIMEOUT)
            except Exception as err:  # a round that found no group in time: say so, go on
                print(json.dumps({"failed": repr(err)}), flush=True)
                continue
            print(json.dumps({"seconds": time.monotonic() - start}), flush=True)
    finally:
        averager.shutdown()
        dht.shutdown()


def codec_flags(codec: str) -> list[str]:
    """``NAME[,key=value...]`` as trainer flags: the name is ``--hv.compression``, each key
    ``--hv.sparse-<key>`` (``sparse,rule=random,density=0.0625``: the sparse codec with another rule and
    density)."""
    name, *options = codec.split(",")
    flags = ["--hv.compression", name]
    for option in options:
        key, _, value = option.partition("=")
        if key not in ("rule", "density") or not value:
            raise SystemExit(
                f"--codecs {codec}: options are rule=... and density=..., e.g. sparse,rule=random"
            )
        flags += [f"--hv.sparse-{key}", value]
    return flags


def run_case(
    profile: str,
    model: str,
    clusters: int,
    rounds: int,
    local_steps: int,
    matchmaking: float,
    workdir: Path,
    codec: str = "none",
    setup: str = "direct",
    trainer_flags: tuple[str, ...] = (),
    sysctls: tuple[str, ...] = (),
) -> dict:
    numel = model_numel(MODELS[model])
    # one round to warm up and one at the end, plus one per two clusters past two for a late start
    steps = local_steps * (rounds + 2 + (clusters - 1) // 2)
    flags = [
        *("--path-model", str(MODELS[model]), "--max-steps", str(steps), "--seq-length", "64"),
        *("--hv.local-steps", str(local_steps), "--hv.matchmaking-time", str(matchmaking)),
        *("--hv.averaging-timeout", "900", "--hv.join-timeout", "120"),
        *codec_flags(codec),
        *trainer_flags,
    ]
    client = ["--hv.client-mode"] if setup == "nat-client" else []
    with Lab(clusters, profile, nat=[] if setup == "direct" else ["c1"], sysctls=sysctls) as lab:
        galaxy = Galaxy(workdir, lab=lab)
        try:
            names = [f"cluster{rank}" for rank in range(clusters)]
            metrics = [
                galaxy.start_cluster(rank, clusters, *flags, *(client if rank == 1 else []), nproc=1)
                for rank in range(clusters)
            ]
            seen = watch(galaxy, metrics, names, timeout=3600, sample=lambda: link_sample(lab))
            # the raw baseline moves fp32: it is the yardstick of the uncompressed case only
            raw = (
                raw_baseline(lab, galaxy.maddr, numel, clusters, rounds, matchmaking)
                if codec == "none" and setup == "direct"
                else []
            )
        finally:
            galaxy.close()
        # one plain TCP connection carrying a round's bytes each way on the same path, the galaxy gone
        whole = [r for r in seen[0].values() if r.get("galaxy_peers") == clusters == 2]
        per_direction = max(max(r["bytes_sent"], r["bytes_received"]) for r in whole) if whole else 0
        tcp = tcp_flow.measure(lab, per_direction, rounds) if per_direction else []
        p2p = p2p_flow.measure(lab, per_direction, rounds, streams=2) if per_direction else []
        link = lab.profile
    records = seen[0]
    before, *steady = steady_rounds(seen, clusters, rounds)
    first_step, last_step = before["step"], steady[-1]["step"]
    wall = records[last_step]["seen"] - records[first_step]["seen"]
    compute = sum(records[s]["step_seconds"] for s in range(first_step + 1, last_step + 1))
    rtt = 2 * link.delay_ms / 1000
    wire = [
        max(r["bytes_sent"], r["bytes_received"]) * 8 / (link.path_mbit() * 1e6) + ROUND_TRIPS * rtt
        for r in steady
    ]
    allreduce = [r["allreduce_seconds"] for r in steady]
    return {
        **link_figures(before, steady),
        **split_figures(seen, steady, wire),
        "profile": profile,
        "model": model,
        "numel": numel,
        "clusters": clusters,
        "codec": codec,
        "setup": setup,
        "rounds": len(steady),
        "allreduce_s": statistics.median(allreduce),
        "raw_s": statistics.median(raw[1:] or raw) if raw else None,
        "tcp_s": statistics.median(tcp) if tcp else None,
        "p2p_s": statistics.median(p2p) if p2p else None,
        "wire_bound_s": statistics.median(wire),
        "ratio": statistics.median(a / w for a, w in zip(allreduce, wire, strict=True)),
        "mb_per_round": statistics.median(r["bytes_sent"] + r["bytes_received"] for r in steady) / 1e6,
        "utilization": compute / wall,
        "wall_s": wall,
    }


def format_row(row: dict) -> str:
    """One case's line under the table's header."""

    def optional(value: float | None, width: int) -> str:
        return f"{value:>{width}.2f}" if value is not None else f"{'—':>{width}}"

    return (
        f"{row['profile']:<17} {row['model']:>5} {row['clusters']:>2} {row['codec']:>6} "
        f"{row['mb_per_round']:>9.1f} {row['allreduce_s']:>11.2f} {optional(row['raw_s'], 7)} "
        f"{row['wire_bound_s']:>12.2f} {row['ratio']:>8.2f} {optional(row['vs_fp32'], 7)} {row['setup']:>10} "
        f"{optional(row['vs_direct'], 8)} {row['utilization']:>11.0%} {row['matchmaking_s']:>6.2f} "
        f"{row['matchmaking_last_s']:>8.2f} "
        f"{row['exchange_s']:>10.2f} {row['sync_ratio']:>7.2f} {row['exchange_ratio']:>8.2f} "
        f"{row['link_mb']:>8.1f} {row['link_ratio']:>7.2f} {row['dht_link_mb']:>7.2f} "
        f"{optional(row['tcp_s'], 6)} {optional(row['tcp_s'] and row['exchange_s'] / row['tcp_s'], 6)} "
        f"{optional(row['p2p_s'], 6)} {optional(row['p2p_s'] and row['exchange_s'] / row['p2p_s'], 9)}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command")
    raw = sub.add_parser("raw", help="(internal) one raw hivemind peer inside a lab namespace")
    raw.add_argument("--initial-peers", required=True)
    raw.add_argument("--host", required=True)
    raw.add_argument("--numel", type=int, required=True)
    raw.add_argument("--peers", type=int, required=True)
    raw.add_argument("--rounds", type=int, required=True)
    raw.add_argument("--matchmaking-time", type=float, required=True)
    parser.add_argument("--profiles", nargs="+", default=["continent", "intercontinental"])
    parser.add_argument("--models", nargs="+", default=["2m"], choices=sorted(MODELS))
    parser.add_argument("--clusters", nargs="+", type=int, default=[2])
    parser.add_argument(
        "--rounds", type=int, default=3, help="steady rounds measured (one more runs before, one after)"
    )
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument(
        "--codecs",
        nargs="+",
        default=["none"],
        help="--hv.compression per case, NAME[,rule=R][,density=D] (sparse's options); 'none' runs "
        "first and is the ÷ fp32 yardstick",
    )
    parser.add_argument(
        "--setups",
        nargs="+",
        default=["direct"],
        choices=["direct", "nat", "nat-client"],
        help="cluster 1 reachable (direct), behind a NAT, or behind a NAT with --hv.client-mode",
    )
    parser.add_argument(
        "--trainer-flags",
        default="",
        help="more flags for every cluster, one string (e.g. '--hv.fragments 2 --hv.sync-delay 10')",
    )
    parser.add_argument(
        "--sysctls",
        nargs="*",
        default=[],
        help="set in every lab namespace after the lab's own: a host's TCP tuning, e.g. "
        "net.ipv4.tcp_slow_start_after_idle=0 (the congestion control is the host's: a namespace may not "
        "choose its own)",
    )
    parser.add_argument("--out", type=Path, help="also write the rows as JSON")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.command == "raw":
        return raw_peer(args)
    rows = []
    for codec in args.codecs:
        codec_flags(codec)  # a bad spec fails before any lab is built
    codecs = sorted(args.codecs, key=lambda codec: codec != "none")
    setups = sorted(args.setups, key=lambda setup: setup != "direct")
    print(
        f"{'profile':<17} {'model':>5} {'M':>2} {'codec':>6} {'MB/round':>9} {'allreduce s':>11} "
        f"{'raw s':>7} {'wire bound s':>12} {'÷ bound':>8} {'÷ fp32':>7} {'setup':>10} {'÷ direct':>8} "
        f"{'utilization':>11} {'mm s':>6} {'mm last':>8} {'exchange s':>10} {'÷ bound':>7} {'ex ÷ bd':>8} "
        f"{'link MB':>8} {'÷ logged':>7} {'DHT MB':>7} {'tcp s':>6} {'ex ÷ tcp':>6} {'p2p s':>6} "
        f"{'ex ÷ p2p':>9}",
        flush=True,
    )
    for profile in args.profiles:
        for model in args.models:
            for clusters in args.clusters:
                fp32 = direct = None
                for codec, setup in [(c, s) for c in codecs for s in setups]:
                    with tempfile.TemporaryDirectory(prefix="wanbench-") as workdir:
                        row = run_case(
                            profile,
                            model,
                            clusters,
                            args.rounds,
                            args.local_steps,
                            args.matchmaking_time,
                            Path(workdir),
                            codec,
                            setup,
                            tuple(shlex.split(args.trainer_flags)),
                            tuple(args.sysctls),
                        )
                    fp32 = row["allreduce_s"] if codec == "none" and setup == "direct" else fp32
                    direct = row["allreduce_s"] if setup == "direct" else direct
                    row["vs_fp32"] = row["allreduce_s"] / fp32 if fp32 and setup == "direct" else None
                    row["vs_direct"] = row["allreduce_s"] / direct if direct else None
                    rows.append(row)
                    print(format_row(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
