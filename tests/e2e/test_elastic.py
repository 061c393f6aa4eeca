"""An elastic galaxy on real clusters: clusters started without ``--hv.world-rank`` are known by an id kept in
their checkpoint directory, form the galaxy with its first round, and join and leave it by ledger entries."""

from __future__ import annotations

import json
import signal
import time

import pytest

from open_diloco.cluster_id import rank_of
from open_diloco.local_galaxy import outer_records, read_metrics
from tests.support.faults import paced

pytestmark = pytest.mark.e2e

QUICK = ["--hv.matchmaking-time", "1.0", "--hv.heartbeat-interval", "1", "--hv.member-expiry", "4"]
COMMON = ["--max-steps", "5000", "--hv.local-steps", "3", "--hv.on-partial-round", "proceed", *QUICK]
DEAL_AHEAD = 2
"""A stride is dealt by the entry two rounds before it (``outer/deal.py``): the galaxy's first two pass."""
"""Runs the test ends (Ctrl+C) once it has seen enough, paced like a device (``paced``)."""


def _start_record(metrics) -> dict:
    return json.loads(metrics.read_text().splitlines()[0])


def _entries(metrics_files) -> dict[int, dict]:
    """Every ledger entry the clusters' sync records hold, by round."""
    return {
        r["ledger"]["round"]: r["ledger"]
        for m in metrics_files
        for r in outer_records(m).values()
        if r.get("ledger")
    }


def _wait_for_entry(galaxy, metrics_files, names, test, seconds: float = 240.0) -> int:
    """The first round whose ledger entry passes ``test``, waited for while the clusters ``names`` run."""
    deadline = time.monotonic() + seconds
    while True:
        found = [n for n, e in sorted(_entries(metrics_files).items()) if test(e)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, _entries(metrics_files)
        assert all(galaxy.procs[name].poll() is None for name in names), [
            galaxy.log(n)[-2000:] for n in names
        ]
        galaxy.track()
        time.sleep(1.0)


def _ranks(entry: dict) -> set[int]:
    return {member["rank"] for member in entry["members"]}


def test_clusters_without_a_rank_form_a_galaxy_a_third_joins_by_an_entry_and_one_leaves(galaxy):
    names = ("alpha", "beta", "gamma")
    samples = galaxy.workdir / "samples"
    common = [*COMMON, "--sample-log", str(samples)]
    metrics = {
        name: galaxy.start_cluster(None, 2, *common, nproc=1, name=name, env=paced(0.2)) for name in names[:2]
    }
    galaxy.wait_for_step(metrics["beta"], 6, 240)
    metrics["gamma"] = galaxy.start_cluster(None, 2, *common, nproc=1, name="gamma", env=paced(0.2))
    # each is known by the id kept in its checkpoint directory, and ranked by it
    ranks = {}
    for name in names:
        galaxy.wait_for_step(metrics[name], 1, 240)
        cluster_id = (galaxy.workdir / f"{name}-ckpt" / "cluster_id").read_text().strip()
        hv = _start_record(metrics[name])["config"]["hv"]
        assert hv["cluster_id"] == cluster_id and hv["world_rank"] == rank_of(cluster_id), hv
        ranks[name] = hv["world_rank"]
    assert len(set(ranks.values())) == 3
    a, b, c = (ranks[name] for name in names)
    files = list(metrics.values())
    # gamma joins the roster with the first entry it is a member of
    joined = _wait_for_entry(galaxy, files, names, lambda e: c in _ranks(e))
    # alpha leaves with Ctrl+C: it says it ended, and the next entries' roster is the two others
    galaxy.procs["alpha"].send_signal(signal.SIGINT)
    assert galaxy.wait("alpha", 60) != 0
    galaxy.track()
    left = _wait_for_entry(
        galaxy, files, names[1:], lambda e: e["round"] > joined and set(e["roster"]) == {b, c}
    )
    _wait_for_entry(galaxy, files, names[1:], lambda e: e["round"] > left)
    for name in names[1:]:
        galaxy.procs[name].send_signal(signal.SIGINT)
        assert galaxy.wait(name, 60) != 0
    # the galaxy is gone: a new cluster of the same run id (no checkpoint) would make a second first round
    galaxy.start_cluster(None, 2, *common, nproc=1, name="delta", env=paced(0.2))
    assert galaxy.wait("delta", 120) != 0, galaxy.log("delta")[-2000:]
    assert "error: --hv.run-id open_diloco had its first round already" in galaxy.log("delta")
    entries = _entries(files)
    # the first round is the galaxy's genesis: alpha and beta, both needed (--hv.galaxy-size 2)
    assert set(entries[1]["roster"]) == _ranks(entries[1]) == {a, b}, entries[1]
    assert c in entries[joined]["roster"] and c not in entries[joined - 1]["roster"], entries[joined]
    assert any(set(e["roster"]) == {a, b, c} for e in entries.values()), entries
    # every round is bitwise identical among the clusters in it; gamma is in sync from its first round in
    rounds = {name: outer_records(metrics[name]) for name in names}
    for number, entry in entries.items():
        members = [name for name in names if ranks[name] in _ranks(entry)]
        hashes = {rounds[name][number]["param_hash"] for name in members if number in rounds[name]}
        assert hashes == {entry["after"]}, (number, members, hashes)
    assert rounds["gamma"][joined]["in_sync"], rounds["gamma"][joined]
    for name in names[:2]:  # (gamma starts from the galaxy's θ)
        losses = [r["loss"] for r in read_metrics(metrics[name]) if r.get("trained")]
        assert losses[-1] < 0.8 * losses[0], name
    _assert_the_ledger_dealt_the_data(samples, list(metrics.values()), entries, ranks)


def _assert_the_ledger_dealt_the_data(samples, metrics_files, entries, ranks) -> None:
    """The data, dealt by the ledger in pages of one galaxy order: the first strides (no deal yet) train
    nothing; every cluster reads only its hands' pages (from the sample ids its loader handed the model: one
    page = one inner step = positions p·S … p·S + S − 1 of the galaxy's fake-data stream); and the audit of
    those readings against the ledger: no page committed twice, none below the final cursor missing but
    those the final deal holds in flight, and the entries' ``pages`` are the readings' committed ones."""
    from open_diloco.data_audit import audit
    from open_diloco.outer.deal import Deal, from_ranges

    for number in range(1, DEAL_AHEAD + 1):
        assert all(m["inner_steps"] == 0 for m in entries[number]["members"]), entries[number]
    page_samples = _start_record(metrics_files[0])["config"]["total_batch_size"]
    read = [json.loads(line) for path in samples.glob("*.jsonl") for line in path.read_text().splitlines()]
    assert read, "no sample log"
    for line in read:
        page = line["page"]
        assert line["sample_ids"] == list(range(page * page_samples, (page + 1) * page_samples)), line
        dealt = Deal.from_wire(entries[max(1, line["step"] // 3 - DEAL_AHEAD + 1)]["deal"])
        assert dealt.cursor > page, line
    committed = [
        (p, int(r)) for e in entries.values() for r, runs in e["pages"].items() for p in from_ranges(runs)
    ]
    assert committed and len({p for p, _ in committed}) == len(committed), committed  # none twice
    assert {r for _, r in committed} == set(ranks.values()), committed  # every cluster's work is in θ_outer
    galaxy = audit(samples, metrics_files)
    assert galaxy.dealt is not None and galaxy.problems == [], galaxy.problems
    assert galaxy.dealt.once == len(committed) > 10, galaxy.dealt


RESUME = ["--hv.local-steps", "4", "--hv.fragments", "2", "--hv.sync-delay", "1", "--warmup-steps", "2"]
"""Two fragments, one of them in flight at every checkpoint (a sync started at step 8 lands at step 9)."""
SPEED = {"a": "1.0", "b": "0.5"}
"""Steps by speed, fixed so that runs repeat: ``b`` trains one step of each stride of two, the first page of
its hand (the other goes back to the queue)."""


def _run_pair(galaxy, phase: str, *extra: str) -> list[list[dict]]:
    """Clusters ``a`` and ``b`` (no rank: ids ``a`` and ``b``, 1 rank each, steps by speed) to step 20; their
    records."""
    fixed = ["--max-steps", "20", *RESUME, "--hv.round-steps", "by-speed"]
    metrics = []
    for name in ("a", "b"):
        flags = [*fixed, "--hv.cluster-id", name, "--hv.cluster-speed", SPEED[name]]
        flags += [flag.format(name=name) for flag in extra]
        metrics.append(galaxy.start_cluster(None, 2, *flags, nproc=1, name=f"{phase}-{name}"))
    for name in ("a", "b"):
        assert galaxy.wait(f"{phase}-{name}", 240) == 0, galaxy.log(f"{phase}-{name}")[-3000:]
    return [read_metrics(m) for m in metrics]


def test_an_elastic_galaxy_resumed_from_its_checkpoints_reads_the_same_pages_bit_exact(galaxy, tmp_path):
    """The deal is in the ledger and what each Δ carries in the outer state: both are in the checkpoints, so a
    galaxy stopped and resumed (new processes, a round in flight, steps by speed) deals, reads and commits
    exactly as the straight run did, loss for loss."""
    from open_diloco.local_galaxy import round_was_clean

    samples = tmp_path / "samples"
    for attempt in ("straight", "again"):  # one trajectory as reference: no partial round in it
        saving = ("--ckpt.interval", "8", "--ckpt.path", str(tmp_path / f"{attempt}-{{name}}"))
        straight = _run_pair(galaxy, attempt, *saving, "--sample-log", str(samples / attempt))
        if all(round_was_clean(r) for side in straight for r in side if "outer_step" in r):
            break
    resume = ("--ckpt.resume", str(tmp_path / f"{attempt}-{{name}}" / "step_00000008"))
    resumed = _run_pair(galaxy, "resumed", *resume, "--sample-log", str(samples / "resumed"))
    for name, before, after in zip("ab", straight, resumed, strict=True):
        losses = {r["step"]: r["loss"] for r in after if r.get("trained")}
        every = 1 if name == "a" else 2  # (b: one step a stride)
        assert len(losses) == len(range(9, 21, every)), sorted(losses)
        assert losses == {r["step"]: r["loss"] for r in before if r["step"] > 8 and r.get("trained")}
        rounds = {r["outer_step"]: r for r in after if "outer_step" in r}
        reference = {r["outer_step"]: r for r in before if "outer_step" in r}
        assert rounds and all(rounds[n]["ledger"] == reference[n]["ledger"] for n in rounds), rounds
        assert all(rounds[n].get("pages") == reference[n].get("pages") for n in rounds)
    read = {phase: _read_after(samples / phase, 8) for phase in (attempt, "resumed")}
    assert read[attempt] == read["resumed"] and read["resumed"], read


def _read_after(directory, step: int) -> list[tuple]:
    """(cluster and rank, step, page, sample ids) of every step after ``step`` the loaders read."""
    read = []
    for path in directory.glob("*.jsonl"):
        who = path.name.split("-", 1)[1]  # (the phase's name off: "a.rank0.jsonl")
        for line in map(json.loads, path.read_text().splitlines()):
            if line["step"] > step:
                read.append((who, line["step"], line["page"], tuple(line["sample_ids"])))
    return sorted(read)
