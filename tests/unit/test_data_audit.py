"""The data audit (``open_diloco/data_audit.py``) on hand-made logs: what each kind of round does to pages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from open_diloco.data_audit import audit
from tests.conftest import REPO


class Cluster:
    """Writes one cluster's sample log (one rank) and metrics, one event a second."""

    def __init__(self, root: Path, rank: int = 0, fragments: int = 1, delay: int = 0, fake: bool = True):
        self.root, self.rank, self.clock = root, rank, 0.0
        (root / "samples").mkdir(exist_ok=True)
        self.samples = root / "samples" / f"cluster{rank}.rank0.jsonl"
        self.metrics = root / f"cluster{rank}.jsonl"
        self.config = {
            "fake_data": fake,
            "hv": {"world_rank": rank, "fragments": fragments, "sync_delay": delay},
        }
        self.start()

    def _write(self, path: Path, line: dict) -> None:
        self.clock += 1.0
        with open(path, "a") as file:
            file.write(json.dumps({"time": self.clock, **line}) + "\n")

    def start(self, resumed_from: str | None = None) -> None:
        self._write(self.metrics, {"event": "start", "config": self.config, "resumed_from": resumed_from})

    def read(self, step: int, page: int | None = None, ids: list[int] | None = None) -> None:
        page = step if page is None else page
        ids = [10 * page, 10 * page + 1] if ids is None else ids
        line = {"step": step, "inner_steps": page, "galaxy_rank": self.rank, "rank": 0, "sample_ids": ids}
        self._write(self.samples, line)

    def sync(self, step: int, outcome: str, number: int, fragment: int = 0, members=None, **extra) -> None:
        members = [self.rank] if members is None else members
        entry = {"round": number, "members": [{"rank": r} for r in members]}
        record = {"step": step, "outer_step": number, "fragment": fragment, "round_outcome": outcome}
        self._write(self.metrics, {**record, "ledger": entry, **extra})


def _one(cluster: Cluster):
    (pages,) = audit(cluster.root / "samples", [cluster.metrics]).clusters
    return pages


def test_blocking_rounds_commit_every_page_once(tmp_path):
    c = Cluster(tmp_path)
    for step in range(1, 7):
        c.read(step)
        if step % 2 == 0:
            c.sync(step, "applied", step // 2)
    pages = _one(c)
    assert (pages.cursor, pages.once, pages.lost, pages.twice, pages.in_flight) == (
        6,
        [1, 2, 3, 4, 5, 6],
        [],
        [],
        [],
    )


def test_a_take_loses_the_round_and_the_pages_it_jumped_over(tmp_path):
    c = Cluster(tmp_path)
    for step in (1, 2, 3, 4):
        c.read(step)
    c.sync(2, "applied", 1)  # (logged after step 4 was read: the sync covers what was read up to its step)
    c.sync(4, "resynced", 3, state_source=1)  # took outer step 3, round 1 in its chain: goes on from step 6
    for step in (7, 8):
        c.read(step)
    c.sync(8, "applied", 4)
    pages = _one(c)
    assert pages.once == [1, 2, 7, 8] and pages.lost == [3, 4, 5, 6] and pages.skipped == [5, 6]
    assert pages.causes == {"taken": 2, "never read": 2}


def test_a_round_this_cluster_is_not_a_member_of_commits_nothing_of_its_own(tmp_path):
    c = Cluster(tmp_path)
    for step in (1, 2):
        c.read(step)
    c.sync(2, "applied", 1, members=[1, 2])
    assert _one(c).lost == [1, 2] and _one(c).causes == {"left out": 2}


def test_a_held_round_drops_every_fragments_progress_and_its_stride_is_trained_again(tmp_path):
    c = Cluster(tmp_path, fragments=2)
    c.read(1), c.read(2)
    c.sync(2, "applied", 1, fragment=0)
    c.read(3), c.read(4)
    c.sync(4, "held", 2, fragment=1)  # θ_local back to θ_outer: pages 1-4 lost for fragment 1, 3-4 for 0
    c.read(3), c.read(4)  # the stride again
    c.sync(4, "applied", 2, fragment=1)
    c.read(5), c.read(6)
    c.sync(6, "applied", 3, fragment=0)
    pages = _one(c)
    assert pages.lost == [1, 2] and pages.once == [3, 4] and pages.in_flight == [5, 6] and not pages.twice
    assert pages.causes == {"held": 2}


def test_a_delayed_sync_leaves_the_steps_trained_in_flight_to_the_next(tmp_path):
    c = Cluster(tmp_path, delay=1)
    c.read(1), c.read(2), c.read(3)
    c.sync(3, "applied", 1, sync_step=2)  # started after step 2, landed after step 3: page 3 is the next's
    c.read(4)
    c.sync(4, "applied", 2, sync_step=4)  # the run's last: started and landed at once
    pages = _one(c)
    assert pages.once == [1, 2, 3, 4] and pages.in_flight == []


def test_a_dropped_fork_takes_its_rounds_back(tmp_path):
    c = Cluster(tmp_path)
    for step in (1, 2, 3, 4):
        c.read(step)
        if step % 2 == 0:
            c.sync(step, "applied", step // 2)
    c.read(5), c.read(6)
    c.sync(6, "resynced", 3, state_source=1, ledger_dropped={"rounds": [2, 2]})
    assert _one(c).lost == [3, 4, 5, 6] and _one(c).causes == {"dropped fork": 2, "taken": 2}


def test_a_killed_launch_loses_what_came_after_its_checkpoint_and_a_commit_it_made_counts(tmp_path):
    c = Cluster(tmp_path)
    for step in (1, 2, 3):
        c.read(step)
    c.sync(2, "applied", 1)
    c.start(resumed_from="ckpt/step_2")  # killed after step 3; resumed from step 2
    c.read(3), c.read(4)
    c.sync(4, "applied", 2)
    assert _one(c).once == [1, 2, 3, 4]
    (tmp_path / "again").mkdir()
    again = Cluster(tmp_path / "again")
    for step in (1, 2, 3, 4):
        again.read(step)
        if step % 2 == 0:
            again.sync(step, "applied", step // 2)
    again.start(resumed_from="ckpt/step_2")  # the galaxy kept round 2: the resume trains pages 3, 4 again
    again.read(3), again.read(4)
    again.sync(4, "applied", 2)
    assert _one(again).twice == [3, 4]


def test_real_data_committed_by_two_clusters_is_named_and_verify_exits_1(tmp_path):
    clusters = [Cluster(tmp_path, rank, fake=False) for rank in (0, 1)]
    for c, ids in zip(clusters, ([1, 2], [2, 3]), strict=True):
        c.read(1, ids=ids)
        c.sync(1, "applied", 1, members=[0, 1])
    galaxy = audit(tmp_path / "samples", [c.metrics for c in clusters])
    assert galaxy.shared_ids == [2] and galaxy.problems == [
        "1 sample(s) committed by two clusters (first [2])"
    ]
    args = [str(tmp_path / "samples"), *(str(c.metrics) for c in clusters)]
    command = [sys.executable, "-m", "open_diloco", "audit-data", *args, "--verify"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "committed by two clusters" in done.stderr, done
    assert "cluster 1: 1 pages, 1 committed once" in done.stdout


def test_a_resumed_launch_that_went_on_past_its_checkpoint_took_the_galaxys_state(tmp_path):
    c = Cluster(tmp_path, fragments=2)
    for step in (1, 2, 3, 4, 5):
        c.read(step)
        if step in (2, 4):
            c.sync(step, "applied", step // 2, fragment=step // 2 - 1)
    c.start(resumed_from="ckpt/step_00000004")  # killed after step 5; the galaxy was at step 8 by then
    c.read(9), c.read(10)
    c.sync(10, "applied", 5, fragment=0)
    pages = _one(c)
    # pages 3, 4: fragment 1 took them at step 4, fragment 0's sync (step 6) never came: the take lost them
    assert pages.lost == [3, 4, 5, 6, 7, 8] and pages.once == [1, 2] and pages.in_flight == [9, 10]
    assert pages.causes == {"taken": 2, "launch ended": 1, "never read": 3}


def test_a_resumed_launch_that_took_the_galaxys_state_at_its_own_step_says_so(tmp_path):
    """The galaxy had committed the round the checkpoint held in flight: the resumed launch downloads it and
    goes on at its checkpoint's step, which no sync record shows; its ``took_state`` record does."""
    c = Cluster(tmp_path, fragments=2)
    for step in (1, 2, 3, 4):
        c.read(step)
        if step == 2:
            c.sync(step, "applied", 1, fragment=0)
    c.start(resumed_from="ckpt/step_00000004")  # killed after round 2 (fragment 1) started at step 4
    c._write(c.metrics, {"event": "took_state", "galaxy_outer_step": 2, "state_source": 1})
    c.read(5), c.read(6)
    c.sync(6, "applied", 3, fragment=0)
    c.sync(6, "applied", 4, fragment=1)
    pages = _one(c)
    # pages 1, 2 went into fragment 0 at round 1 but fragment 1's round 2 never carried them for this cluster
    assert pages.once == [5, 6] and pages.lost == [1, 2, 3, 4] and pages.causes == {"taken": 4}


def _elastic_pair(root: Path, b_reads: list[int]) -> list[Path]:
    """Two clusters of an elastic galaxy (ranks 1 and 2, one page an inner step, pages dealt by the ledger):
    rounds 3 and 4 commit pages 0-3 and 4-7, and deal 8-9 ahead; cluster 2 reads ``b_reads`` in round 4 and is
    killed before it logs that round (its Δ had gone out: the galaxy's entry 4 holds it)."""
    (root / "samples").mkdir(parents=True)
    entries = [
        {"round": 3, "before": "h2", "after": "h3", "work": 4, "pages": {"1": [[0, 2]], "2": [[2, 4]]}},
        {"round": 4, "before": "h3", "after": "h4", "work": 8, "pages": {"1": [[4, 6]], "2": [[6, 8]]}},
    ]
    entries[1]["deal"] = {"cursor": 10, "queue": [], "hands": {"6": {"1": [[[8, 10]], 0, None]}}}
    for entry in entries:
        entry["members"] = [{"rank": 1}, {"rank": 2}]
    files = []
    for rank, reads in ((1, [[0, 1], [4, 5]]), (2, [[2, 3], b_reads])):
        config = {"fake_data": True, "hv": {"world_rank": rank, "cluster_id": f"c{rank}", "fragments": 1}}
        lines, metrics, clock = [], [{"time": 0.0, "event": "start", "config": config}], 0.0
        for number, (entry, pages) in enumerate(zip(entries, reads, strict=True)):
            for page in pages:
                clock += 1.0
                step = 4 + 2 * number + (page % 2) + 1
                where = {"galaxy_rank": rank, "rank": 0, "sample_ids": [10 * page, 10 * page + 1]}
                lines.append({"time": clock, "step": step, "inner_steps": step, "page": page, **where})
            clock += 1.0
            if rank == 1 or number == 0:  # (cluster 2 is killed before its record of round 4)
                record = {"time": clock, "step": 6 + 2 * number, "outer_step": entry["round"], "fragment": 0}
                metrics.append({**record, "round_outcome": "applied", "ledger": entry})
        (root / "samples" / f"c{rank}.rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        files.append(root / f"c{rank}.jsonl")
        files[-1].write_text("".join(json.dumps(x) + "\n" for x in metrics))
    return files


def test_an_elastic_galaxys_pages_are_audited_against_the_chain_it_ended_on(tmp_path):
    files = _elastic_pair(tmp_path / "whole", b_reads=[6, 7])
    dealt = audit(tmp_path / "whole" / "samples", files).dealt
    assert dealt is not None and (dealt.cursor, dealt.once) == (10, 8)
    assert (dealt.lost, dealt.twice, dealt.in_flight, dealt.unmatched) == ([], [], [8, 9], [])
    # the ledger says cluster 2 committed page 7, which its loader never read: the two disagree
    files = _elastic_pair(tmp_path / "unread", b_reads=[6])
    galaxy = audit(tmp_path / "unread" / "samples", files)
    assert galaxy.dealt.unmatched == [7] and "1 the ledger and the readings disagree on" in galaxy.problems[0]


def test_the_chain_walk_takes_a_round_that_changed_nothing_and_counts_fragments_taken_twice():
    """A round whose members all carried no page leaves θ as it was (``before`` = ``after``): the walk back
    from the final entry goes by round as well as by θ. A page one fragment took from two readings (partly
    committed, given back, trained again) is counted apart, not as committed twice."""
    from collections import Counter

    from open_diloco.data_audit import _dealt_pages

    deal = {"cursor": 4, "queue": [], "hands": {}}
    entries = [
        {"round": 1, "before": "h0", "after": "h1", "work": 2, "pages": {"7": [[0, 2]]}},
        {"round": 2, "before": "h1", "after": "h1", "work": 2, "pages": {}},  # nobody had a page
        {"round": 3, "before": "h1", "after": "h3", "work": 4, "pages": {"7": [[2, 4]]}, "deal": deal},
    ]
    read = {(page, 7) for page in range(4)}
    parts = Counter({(page, 0): 1 for page in range(4)} | {(page, 1): 1 for page in range(4)})
    parts[(3, 0)] = 2  # page 3: fragment 0 took an earlier reading too
    dealt = _dealt_pages(Counter(dict.fromkeys(read, 1)), read, entries, parts)
    assert (dealt.once, dealt.lost, dealt.twice, dealt.unmatched) == (4, [], [], [])
    assert dealt.fragment_twice == [3]
