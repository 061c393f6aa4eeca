"""Outer-loop memory of the real trainer: a 1-rank cluster alone, then the same cluster in a real 2-cluster
galaxy on 127.0.0.1, each cluster's process tree sampled from ``/proc/<pid>/smaps_rollup``
(``scripts/bench/outer_memory.py --trainer`` runs it; its docstring says what the figures mean).

The tree is torchrun's launcher, the rank (``trainer``), and what the rank starts for the galaxy:
hivemind's DHT process (the one with p2pd under it), ``p2pd``, and the shard's ``averager`` process. Two
sums are reported: ``pss`` (all of it) and ``anon`` (Pss_Anon + Pss_Shmem: the heap, the model, the outer
state, shared tensors). File-backed pages (torch's libraries) are shared with every other Python process on
the machine, a test suite's included, so their share of ``pss`` moves with whatever else runs; ``anon`` is
what the outer loop can add, and the ratio is taken from it. ``uss`` (private pages) says what each process
holds alone: a fork's anon PSS is mostly its share of the heap it was forked with.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from open_diloco.local_galaxy import (
    CLUSTER_ARGS,
    TORCHRUN,
    TRAIN_SCRIPT,
    Galaxy,
    kill_tree,
    trainer_env,
    with_overrides,
)
from open_diloco.processes import alive, descendants

REPO = Path(__file__).resolve().parents[2]
MODEL_100M = REPO / "configs" / "models" / "llama-100m-fresh"
FIELDS = ("Pss", "Pss_Anon", "Pss_Shmem", "Private_Clean", "Private_Dirty")


def rollup(pid: int) -> dict[str, int]:
    """``FIELDS`` of ``/proc/<pid>/smaps_rollup``, in bytes (empty once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    sizes = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in FIELDS:
            sizes[key] = int(rest.split()[0]) * 1024
    return sizes


def role(pid: int, root: int) -> str:
    """What a process of the tree is: ``launcher`` (torchrun), ``trainer``, ``p2pd``, ``dht`` (the fork with a
    p2pd child), ``averager`` (the other fork of the trainer)."""
    if pid == root:
        return "launcher"
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "gone"
    if comm == "p2pd":
        return "p2pd"
    if b"train_fsdp.py" in cmdline and not any(b"train_fsdp.py" in _cmdline(p) for p in _parents(pid, root)):
        return "trainer"
    if any(_comm(child) == "p2pd" for child in descendants(pid)):
        return "dht"
    return "averager"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _parents(pid: int, root: int) -> list[int]:
    """The ancestors of ``pid`` below ``root``."""
    chain = []
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return chain
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid in (root, 0, 1):
            return chain
        chain.append(pid)


def tree_sizes(root: int) -> dict[str, dict[str, int]]:
    """Per process of ``root``'s tree (keyed ``role/pid``): its ``pss`` and ``anon`` bytes."""
    sizes = {}
    for pid in [root, *descendants(root)]:
        fields = rollup(pid)
        if fields:
            anon = fields.get("Pss_Anon", 0) + fields.get("Pss_Shmem", 0)
            private = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
            sizes[f"{role(pid, root)}/{pid}"] = {"pss": fields["Pss"], "anon": anon, "uss": private}
    return sizes


class TreeSampler:
    """The peak of a process tree's ``anon`` sum (and the per-process sizes at it), sampled every 0.25 s."""

    def __init__(self, root: int):
        self.root, self.peak, self.at_peak = root, 0, {}
        self.series: list[tuple[float, dict[str, int]]] = []
        """(seconds since start, anon bytes by role) of every sample."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            sizes = tree_sizes(self.root)
            self.series.append((time.monotonic() - start, by_role(sizes, "anon"), by_role(sizes, "uss")))
            total = sum(size["anon"] for size in sizes.values())
            if total > self.peak:
                self.peak, self.at_peak = total, sizes
            time.sleep(0.25)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {
            "anon": self.peak,
            "pss": sum(size["pss"] for size in self.at_peak.values()),
            "processes": self.at_peak,
            "series": self.series,
        }


def shard_numel(path_model: str) -> int:
    """Values of the model (the shard of a 1-rank cluster), from its meta-device build."""
    from open_diloco.model import build_meta_model

    return sum(param.numel() for param in build_meta_model(Path(path_model)).parameters())


def run_flags(path_model: str, steps: int, local_steps: int, extra: list[str]) -> list[str]:
    """The flags a cluster gets on top of ``local_galaxy.CLUSTER_ARGS``."""
    flags = ["--path-model", path_model, "--max-steps", str(steps), "--hv.local-steps", str(local_steps)]
    return with_overrides(flags, extra)


def alone(path_model: str, steps: int, local_steps: int, extra: list[str], workdir: Path) -> dict:
    """The cluster without a galaxy (every ``--hv.*`` flag dropped): its tree's peak."""
    flags = with_overrides(CLUSTER_ARGS, run_flags(path_model, steps, local_steps, extra))
    plain, skip = [], False
    for arg in flags:  # every --hv.* flag takes a value
        if not skip and not arg.startswith("--hv."):
            plain.append(arg)
        skip = arg.startswith("--hv.") and not skip
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=1", str(TRAIN_SCRIPT), *plain]
    cmd += ["--total-batch-size", "4", "--metrics-path", str(workdir / "alone.jsonl")]
    with (workdir / "alone.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=trainer_env(), stdout=log, stderr=subprocess.STDOUT)
    sampler = TreeSampler(proc.pid)
    seen: set[int] = set()
    try:
        while proc.poll() is None:
            seen.update([proc.pid, *descendants(proc.pid)])
            time.sleep(0.5)
    finally:
        peak = sampler.stop()
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 0, (workdir / "alone.log").read_text()[-3000:]
    assert not alive(seen), f"processes left behind: {alive(seen)}"
    return peak


def in_galaxy(path_model: str, steps: int, local_steps: int, extra: list[str], workdir: Path) -> list[dict]:
    """Two such clusters averaging: each tree's peak (cluster 0, cluster 1)."""
    galaxy = Galaxy(workdir)
    samplers = []
    try:
        for rank in (0, 1):
            galaxy.start_cluster(rank, 2, *run_flags(path_model, steps, local_steps, extra), nproc=1)
            samplers.append(TreeSampler(galaxy.procs[f"cluster{rank}"].pid))
        for rank in (0, 1):
            code = galaxy.wait(f"cluster{rank}", timeout=1200)
            assert code == 0, galaxy.log(f"cluster{rank}")[-3000:]
    finally:
        peaks = [sampler.stop() for sampler in samplers]
        galaxy.close()
    return peaks


def measure_trainer(
    case: str, extra: list[str], path_model: str, steps: int, local_steps: int, numel: int
) -> dict:
    """One case (its flags ``extra``): the cluster alone, then in the galaxy; the extra ``anon`` of each
    galaxy member over the alone run, per fp32 shard."""
    workdir = Path(tempfile.mkdtemp(prefix=f"outer-memory-{case}-"))
    try:
        base = alone(path_model, steps, local_steps, extra, workdir)
        members = in_galaxy(path_model, steps, local_steps, extra, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    shard = 4 * numel
    return {
        "case": case,
        "model": Path(path_model).name,
        "alone": base,
        "members": members,
        "ratios": [(member["anon"] - base["anon"]) / shard for member in members],
        "pss_ratios": [(member["pss"] - base["pss"]) / shard for member in members],
    }


def by_role(processes: dict[str, dict[str, int]], key: str) -> dict[str, int]:
    """Sum a tree's per-process sizes by role (``trainer/123`` → ``trainer``)."""
    sums: dict[str, int] = {}
    for name, size in processes.items():
        sums[name.split("/")[0]] = sums.get(name.split("/")[0], 0) + size[key]
    return sums


def report(result: dict, numel: int) -> None:
    """Print one case's table (MiB; ratios in fp32 shards)."""
    mib = 2**20
    base = result["alone"]
    print(
        f"\ncase {result['case']}: {result['model']}, 1 rank per cluster, shard {numel:,} values "
        f"({4 * numel / mib:.0f} MiB fp32)"
    )
    print("| tree | anon+shmem PSS | PSS | extra anon / shard | extra PSS / shard | per process (anon MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = [("alone", base, None, None)]
    rows += [
        (f"cluster {rank}", member, result["ratios"][rank], result["pss_ratios"][rank])
        for rank, member in enumerate(result["members"])
    ]
    for name, tree, ratio, pss_ratio in rows:
        parts = ", ".join(f"{k} {v / mib:.0f}" for k, v in sorted(by_role(tree["processes"], "anon").items()))
        ratio_text = "" if ratio is None else f"{ratio:.2f}x"
        pss_text = "" if pss_ratio is None else f"{pss_ratio:.2f}x"
        print(
            f"| {name} | {tree['anon'] / mib:.0f} MiB | {tree['pss'] / mib:.0f} MiB | {ratio_text} | "
            f"{pss_text} | {parts} |"
        )
