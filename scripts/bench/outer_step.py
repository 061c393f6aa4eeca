"""Outer-step cost: open_diloco's whole outer step (pseudo-gradient, canonical all-reduce, hash exchange,
outer SGD-Nesterov, copy back) vs a raw hivemind ``DecentralizedAverager`` all-reduce of the same bytes,
measured in the same run, on the same DHT, with the same matchmaking settings and compression.

    python scripts/bench/outer_step.py                        # 2 peers on 127.0.0.1, 2M and 25M values
    python scripts/bench/outer_step.py --numel 2000000 --peers 3 --compression fp16

Each peer is a process of its own (its DHT, averager and p2pd are its children). Rounds alternate: a raw
hivemind round, then one open_diloco outer step, each started together behind a barrier. Printed per size:
median seconds of each, their ratio (target <= 1.2), and the bytes this peer put on the wire per round
against the model's fp32 size. Every process is ended by PID before the script exits.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import time

import torch

from open_diloco.processes import alive, descendants, signal_pids, wait_gone

CTX = mp.get_context("spawn")
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


class FlatModel(torch.nn.Module):
    """A model that is one parameter of ``numel`` values: DiLoCo only sees the flat shard anyway."""

    def __init__(self, numel: int, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(numel, generator=generator))


def _peer(rank: int, args: argparse.Namespace, numel: int, queue, barrier, initial_peers) -> None:
    from hivemind.averaging import DecentralizedAverager

    from open_diloco.config import HvConfig
    from open_diloco.galaxy.build import ClusterShard, averaging_settings, start_shard_averager
    from open_diloco.outer.diloco import DiLoCo

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(1)))
    mp.set_start_method("fork", force=True)  # hivemind forks its averager (a spawned child inherits "spawn")
    # Each peer stands for a cluster on a machine of its own: give it its share of the cores, else the peers'
    # OpenMP pools oversubscribe the machine and every local op stalls behind the other peer's threads.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.peers))
    hv = HvConfig(  # with momentum, as the figures in docs/results/outer-step.md were taken
        local_steps=1,
        world_rank=rank,
        galaxy_size=args.peers,
        on_partial_round="proceed",
        outer_momentum=0.9,
        host_maddrs=LOOPBACK,
        run_id=f"bench{numel}",
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.timeout,
        join_timeout=30.0,
        compression=args.compression,
    )
    ours = start_shard_averager(hv, ClusterShard.flat(numel), initial_peers=initial_peers)
    raw = DecentralizedAverager(
        [torch.zeros(numel)], ours.dht, prefix=f"raw{numel}", start=True, **averaging_settings(hv)
    )
    try:
        queue.put(("ready", rank, ours.visible_maddrs))
        model = FlatModel(numel, seed=0)  # every cluster starts from the same θ
        diloco = DiLoCo(model, ours, hv, warn=lambda *_: None)
        noise = torch.Generator().manual_seed(100 + rank)
        for round_id in range(args.rounds):
            with raw.get_tensors() as (tensor,):
                tensor.copy_(torch.randn(numel, generator=noise))
            barrier.wait(120)
            start = time.perf_counter()
            result = raw.step(timeout=args.timeout)
            raw_seconds = time.perf_counter() - start
            with torch.no_grad():  # "inner steps": this cluster's own drift away from θ_outer
                model.weight.add_(torch.randn(numel, generator=noise), alpha=1e-3)
            barrier.wait(120)
            start = time.perf_counter()
            record = diloco.step()
            ours_seconds = time.perf_counter() - start
            queue.put(
                (
                    "round",
                    rank,
                    round_id,
                    raw_seconds,
                    result is not None and len(result) == args.peers,
                    ours_seconds,
                    record,
                )
            )
    finally:
        raw.shutdown()
        ours.shutdown()
        queue.put(("done", rank))


def run_size(args: argparse.Namespace, numel: int) -> dict:
    queue, barrier = CTX.Queue(), CTX.Barrier(args.peers)
    procs, seen = [], set()
    try:
        first = CTX.Process(target=_peer, args=(0, args, numel, queue, barrier, []))
        first.start()
        procs.append(first)
        kind, _, maddrs = queue.get(timeout=120)
        assert kind == "ready"
        for rank in range(1, args.peers):
            proc = CTX.Process(target=_peer, args=(rank, args, numel, queue, barrier, maddrs))
            proc.start()
            procs.append(proc)
        rounds, done = [], 0
        deadline = time.monotonic() + 120 + args.rounds * 2 * args.timeout
        while done < args.peers:
            for proc in procs:
                seen.update([proc.pid, *descendants(proc.pid)])
            message = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            if message[0] == "round":
                rounds.append(message)
            elif message[0] == "done":
                done += 1
        for proc in procs:
            proc.join(30)
    finally:
        signal_pids(alive(seen | {p.pid for p in procs if p.pid}), signal.SIGKILL)  # end stragglers by PID
        left = wait_gone(seen, 5.0)
        assert not left, f"processes left behind: {left}"
    # the first round pays for warm-up (connections, allocations): keep it out of the medians
    measured = [r for r in rounds if r[2] > 0 and r[1] == 0]
    full = [r for r in measured if r[4] and r[6]["galaxy_peers"] == args.peers]
    raw = statistics.median(r[3] for r in full)
    ours = statistics.median(r[5] for r in full)
    hashes = {}
    for r in rounds:
        hashes.setdefault(r[2], set()).add(r[6]["param_hash"])
    return dict(
        numel=numel,
        rounds=len(full),
        raw=raw,
        ours=ours,
        ratio=ours / raw,
        allreduce=statistics.median(r[6]["allreduce_seconds"] for r in full),
        sent=statistics.median(r[6]["bytes_sent"] for r in full),
        identical=all(len(h) == 1 for h in hashes.values()),
        broken=sum(
            1
            for r in rounds
            if r[1] == 0 and not (r[6]["galaxy_complete"] and r[6]["galaxy_peers"] == args.peers)
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, nargs="+", default=[2_100_000, 25_000_000])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--compression", choices=["none", "fp16"], default="none")
    parser.add_argument("--matchmaking-time", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    print(
        f"{args.peers} peers on 127.0.0.1, compression {args.compression}, {args.rounds} rounds (first is "
        "warm-up)"
    )
    print(
        "| values | fp32 size | raw hivemind all-reduce | open_diloco outer step (its all-reduce) | ratio "
        "| bytes sent / peer / round | equal hashes every round | partial rounds |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for numel in args.numel:
        r = run_size(args, numel)
        size = 4 * numel
        print(
            f"| {numel:,} | {size / 2**20:.1f} MiB | {r['raw']:.3f} s | {r['ours']:.3f} s "
            f"({r['allreduce']:.3f} s) | {r['ratio']:.2f} | {r['sent'] / 2**20:.1f} MiB "
            f"({r['sent'] / size:.2f}x model) | {r['identical']} | {r['broken']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
