"""Outer-state memory: how much host memory a real 2-cluster round adds, in multiples of the fp32 shard.

    python scripts/bench/outer_memory.py --trainer                        # the real trainer, 96M: every case
    python scripts/bench/outer_memory.py --trainer --cases plain --path-model configs/models/llama-25m-fresh
    python scripts/bench/outer_memory.py --trainer --cases plain --path-model configs/models/llama-25m-fresh \
        configs/models/llama-100m-fresh PATH_TO_A_300M_CONFIG     # three sizes: the fit's slope and constant
    python scripts/bench/outer_memory.py                  # the outer loop alone, shards of 25M and 96M values
    python scripts/bench/outer_memory.py --numel 96000000 --cases momentum

Cases: ``plain`` (the default outer step, plain averaging: θ_outer and the wire buffer, 2x is the floor),
``momentum`` (``--hv.outer-momentum 0.9``: + the momentum, 3x) and ``int8`` (a lossy codec: + its error
feedback, 3x).

``--trainer`` (``outer_memory_trainer.py``): a 1-rank cluster of the real trainer (CPU, fake data, 2 rounds
of H = 4) alone, then two of them as a galaxy on 127.0.0.1 with a ``hivemind-dht``; each cluster's process
tree (torchrun, the rank, hivemind's DHT and averager processes, p2pd) is read from
``/proc/<pid>/smaps_rollup`` every 0.25 s. Extra = the galaxy member's peak anon + shmem PSS less the lone
cluster's, over the fp32 shard. This is the issue's measure, and includes what does not grow with the
model: p2pd, the DHT and averager processes' own heaps, hivemind's modules in the trainer. With two or more
``--path-model`` sizes it also fits extra = slope x fp32 shard + constant over every member of every size: the
slope is what the outer loop costs a large model, the constant is what makes a small one's ratio high.

Without ``--trainer``: each peer is a process with its DHT, averager and p2pd as children, and a flat
parameter as its model; memory is the PSS of that whole tree (shared memory, e.g. the averager's buffer,
counted once), sampled every 20 ms. Per peer:
  model   = tree PSS with the model built, before the galaxy starts;
  fixed   = what starting a galaxy over a 1-value shard adds (interpreters, p2pd: independent of model size);
  peak    = highest tree PSS during the outer loop's rounds over the real shard.
Outer state = (peak - model - fixed) / (4 * numel). With two or more sizes the bench also fits outer state =
slope x (4 * numel) + overhead: the slope is what a 70B model pays. Every process is ended by PID before exit.

Where the model lives matters because hivemind's DHT and averager are *forked* from the trainer, which
starts them before it materialises the model (``trainer.build_model_and_outer_loop``): a fork made after
the weights exist holds a copy-on-write image of them, and each inner step's writes turn it into a private
copy. This bench's peers build their model first, so ``--model-memory device`` (default) puts the parameter
in a shared mapping, which forks share instead of copying; ``host`` shows the cost of forking late.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import threading
import time

import psutil
import torch
from outer_step import FlatModel

from open_diloco.processes import alive, descendants, signal_pids, wait_gone

CTX = mp.get_context("spawn")
CASES = {"plain": {}, "momentum": {"outer_momentum": 0.9}, "int8": {"compression": "int8"}}
"""Each case's ``--hv.*`` settings (as HvConfig fields)."""
FLOORS = {"plain": 2, "momentum": 3, "int8": 3}
"""fp32 copies of the shard each case needs: θ_outer, the wire buffer, + the momentum or error feedback."""
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def tree_pss_by_process(pid: int) -> dict[str, int]:
    """PSS of each process of the tree, keyed by a readable name (``trainer``, ``averager/1234``,
    ``p2pd/…``)."""
    sizes = {}
    for member in [pid, *descendants(pid)]:
        try:
            proc = psutil.Process(member)
            name = "trainer" if member == pid else f"{proc.name()}/{member}"
            sizes[name] = proc.memory_full_info().pss
        except psutil.Error:
            pass
    return sizes


def tree_pss(pid: int) -> int:
    return sum(tree_pss_by_process(pid).values())


class PeakSampler:
    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self.at_peak: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sizes = tree_pss_by_process(self.pid)
            if sum(sizes.values()) > self.peak:
                self.peak, self.at_peak = sum(sizes.values()), sizes
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _peer(rank: int, numel: int, args, queue, barrier, maddrs_queue) -> None:
    import os

    from open_diloco.config import HvConfig
    from open_diloco.galaxy.build import ClusterShard, start_shard_averager
    from open_diloco.outer.diloco import DiLoCo

    mp.set_start_method("fork", force=True)
    torch.set_num_threads(1)
    me = os.getpid()

    hv = HvConfig(
        **CASES[args.case],
        local_steps=1,
        world_rank=rank,
        galaxy_size=2,
        on_partial_round="proceed",
        host_maddrs=LOOPBACK,
        matchmaking_time=1.0,
        averaging_timeout=60.0,
        join_timeout=30.0,
    )

    def start(numel: int, run_id: str, peers: list[str]):
        return start_shard_averager(
            hv.model_copy(update={"run_id": run_id}), ClusterShard.flat(numel), initial_peers=peers
        )

    model = FlatModel(numel, seed=0)
    if args.model_memory == "device":
        model.weight.data.share_memory_()  # no copy-on-write in the forks, as for parameters on a GPU
    time.sleep(0.5)
    model_pss = tree_pss(me)
    probe = start(1, "probe", [])
    time.sleep(1.0)
    fixed = tree_pss(me) - model_pss
    probe.shutdown()
    peers = []
    if rank == 1:
        peers = maddrs_queue.get(timeout=120)
    ours = start(numel, "memory", peers)
    if rank == 0:
        maddrs_queue.put(ours.visible_maddrs)
    try:
        diloco = DiLoCo(model, ours, hv, warn=lambda *_: None)
        noise = torch.Generator().manual_seed(rank)
        peers_seen = []
        with PeakSampler(me) as sampler:
            for _ in range(args.rounds):
                with (
                    torch.no_grad()
                ):  # "inner steps", a chunk at a time: no full-size temporary of the bench's own
                    for piece in model.weight.split(1 << 20):
                        piece.add_(torch.randn(piece.numel(), generator=noise), alpha=1e-3)
                barrier.wait(120)
                peers_seen.append(diloco.step()["galaxy_peers"])
        queue.put(("result", rank, model_pss, fixed, sampler.peak, peers_seen, sampler.at_peak))
    finally:
        ours.shutdown()


def measure(numel: int, args) -> float:
    """Run the two peers over a shard of ``numel`` values, print their table, return the mean outer state
    (bytes)."""
    queue, maddrs, barrier = CTX.Queue(), CTX.Queue(), CTX.Barrier(2)
    procs = [CTX.Process(target=_peer, args=(rank, numel, args, queue, barrier, maddrs)) for rank in (0, 1)]
    seen: set[int] = set()
    try:
        for proc in procs:
            proc.start()
        results = []
        deadline = time.monotonic() + 300
        while len(results) < 2:
            for proc in procs:
                seen.update([proc.pid, *descendants(proc.pid)])
            results.append(queue.get(timeout=max(1.0, deadline - time.monotonic())))
        for proc in procs:
            proc.join(30)
    finally:
        signal_pids(alive(seen | {p.pid for p in procs if p.pid}), 9)
        left = wait_gone(seen, 5.0)
        assert not left, f"processes left behind: {left}"
    size = 4 * numel
    print(
        f"\n2 peers on 127.0.0.1, shard of {numel:,} values ({size / 2**20:.0f} MiB fp32), {args.rounds} "
        f"rounds, case {args.case}, model memory: {args.model_memory}"
    )
    print("| peer | model | galaxy fixed | peak | outer state | x fp32 shard | peers per round |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    outers = []
    for _, rank, model_pss, fixed, peak, peers, _at_peak in sorted(results, key=lambda r: r[1]):
        outer = peak - model_pss - fixed
        outers.append(outer)
        print(
            f"| {rank} | {model_pss / 2**20:.0f} MiB | {fixed / 2**20:.0f} MiB | {peak / 2**20:.0f} MiB | "
            f"{outer / 2**20:.0f} MiB | {outer / size:.2f} | {peers} |"
        )
    for _, rank, *_, at_peak in sorted(results, key=lambda r: r[1]):
        parts = ", ".join(f"{name} {pss / 2**20:.0f}" for name, pss in sorted(at_peak.items()))
        print(f"peer {rank} at its peak (MiB PSS): {parts}")
    print(f"outer state / fp32 shard: {statistics.mean(outers) / size:.2f}x")
    return statistics.mean(outers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", action="store_true", help="the real trainer (outer_memory_trainer.py)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["plain", "momentum", "int8"])
    parser.add_argument(
        "--path-model", nargs="+", default=None, help="--trainer: the models (default: the 96M config)"
    )
    parser.add_argument("--numel", type=int, nargs="+", default=[25_000_000, 96_000_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--model-memory",
        choices=["device", "host"],
        default="device",
        help="device: parameters outside the forks' copy-on-write, as on a GPU; host: forked late, copied",
    )
    args = parser.parse_args()
    if args.trainer:
        trainer_cases(args)
        return
    sizes = [4 * numel for numel in args.numel]
    for case in args.cases:
        args.case = case
        outers = [measure(numel, args) for numel in args.numel]
        if len(sizes) >= 2:
            slope, overhead = statistics.linear_regression(sizes, outers)
            print(
                f"\n{case}: outer state = {slope:.2f} x fp32 shard + {overhead / 2**20:.0f} MiB "
                f"(floor: {FLOORS[case]}x)"
            )


def trainer_cases(args) -> None:
    """Every case with the real trainer (``outer_memory_trainer.py``), one after the other, at every size."""
    from outer_memory_trainer import MODEL_100M, measure_trainer, report, shard_numel

    summary = []
    for case in args.cases:
        flags = [
            arg for key, value in CASES[case].items() for arg in (f"--hv.{key.replace('_', '-')}", str(value))
        ]
        points = []  # (fp32 shard bytes, extra bytes) of every member
        for path_model in args.path_model or [str(MODEL_100M)]:
            numel = shard_numel(path_model)
            result = measure_trainer(case, flags, path_model, steps=8, local_steps=4, numel=numel)
            report(result, numel)
            summary.append((case, result["model"], result["ratios"]))
            points += [(4 * numel, ratio * 4 * numel) for ratio in result["ratios"]]
        if len({shard for shard, _ in points}) >= 2:
            slope, constant = statistics.linear_regression(*zip(*points, strict=True))
            fit = f"{slope:.2f} x fp32 shard + {constant / 2**20:.0f} MiB"
            print(f"\n{case}: extra = {fit} (floor: {FLOORS[case]}x)")
    print("\n| case | model | extra / fp32 shard (cluster 0, cluster 1) | floor |")
    print("| --- | --- | --- | --- |")
    for case, model, ratios in summary:
        print(f"| {case} | {model} | {', '.join(f'{r:.2f}x' for r in ratios)} | {FLOORS[case]}x |")


if __name__ == "__main__":
    main()
