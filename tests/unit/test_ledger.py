"""The ledger (open_diloco/outer/ledger.py) and what `open-diloco ledger` makes of it (ledger_view.py):
entries that every member computes alike, a chain a taken state brings along, and a check that refuses what
was altered. The ledger in real rounds, over hivemind: tests/e2e/test_galaxy.py, test_galaxy_checkpoint.py and
test_status.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from open_diloco import ledger_view
from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.ledger import KEEP, Ledger, LedgerBroken, LedgerEntry, round_entry
from open_diloco.outer.testing import InProcessGalaxy
from tests.support.tiny_outer import linear_model, outer_hv

META = {"weight": 1.0, "inner_steps": 5, "codec": "none", "outer_optimizer": "sgd lr=1 momentum=0"}


def entry(round_no: int, before: str, after: str, members=(0, 1), peers=None) -> LedgerEntry:
    peers = peers if peers is not None else {rank: META for rank in members}
    return round_entry(
        round_no=round_no, attempt=0, fragment=0, before=before, after=after, peers=peers, members=members
    )


def test_an_entry_is_the_same_whoever_computes_it_and_names_a_misconfigured_member():
    ours = entry(1, "a", "b")
    # gathered in another order, with extra keys in the metadata
    theirs = entry(1, "a", "b", members={1, 0}, peers={1: META, 0: {**META, "delta_norm": 0.5}})
    assert ours == theirs and ours.hash == theirs.hash
    assert LedgerEntry.from_wire(json.loads(json.dumps(ours.to_wire()))) == ours
    mixed = entry(1, "a", "b", peers={0: META, 1: {**META, "codec": "int8"}})
    assert mixed.codec == "int8|none" and mixed.hash != ours.hash


def test_an_altered_entry_is_refused_in_one_line():
    wire = entry(3, "a", "b").to_wire()
    wire["after"] = "c"
    with pytest.raises(LedgerBroken, match="round 3.*altered after it was written"):
        LedgerEntry.from_wire(wire, "x.jsonl:7")
    with pytest.raises(LedgerBroken, match="malformed"):
        LedgerEntry.from_wire({"round": 1}, "x.jsonl:8")


def test_a_taken_chain_replaces_the_rounds_it_covers_and_a_break_is_said():
    ledger = Ledger()
    assert ledger.append(entry(1, "a", "b")) is None
    assert ledger.append(entry(2, "b", "c")) is None
    assert ledger.append(entry(3, "c", "x", members=(0,))) is None  # alone: a fork of its own
    ledger.take([entry(3, "c", "d").to_wire(), entry(4, "d", "e").to_wire()])
    assert [(e.round, e.after) for e in ledger.entries] == [(1, "b"), (2, "c"), (3, "d"), (4, "e")]
    assert "round 5 starts from θ q" in ledger.append(entry(5, "q", "r"))
    ledger.take(None)  # a source of an older version serves no chain: nothing changes
    assert len(ledger.entries) == 5
    for round_no in range(6, KEEP + 10):
        ledger.append(entry(round_no, "r", "r"))
    assert len(ledger.entries) == KEEP and ledger.last.round == KEEP + 9


def test_in_process_rounds_record_one_chain_in_every_cluster_and_checkpoint_it():
    """Real DiLoCo rounds (the in-process galaxy): every cluster's entry of a round is the same; the chain
    continues; the result's record carries it; a checkpoint holds it and a resume takes it back."""
    galaxy = InProcessGalaxy(2)
    locals_ = {0: [[0.5, 2.5], [0.4, 2.2], [0.3, 2.0]], 1: [[0.9, 1.5], [0.6, 1.8], [0.5, 1.9]]}
    results = {}

    def cluster(rank: int) -> None:
        model = linear_model([1.0, 2.0])
        hv = outer_hv(world_rank=rank, galaxy_size=2)
        outer = DiLoCo(model, galaxy.averager(rank, 2), hv, warn=lambda *_: None)
        records = []
        for local in locals_[rank]:
            with torch.no_grad():
                model.weight.copy_(torch.tensor([local]))
            records.append(outer.after_inner_step(1))
        results[rank] = (records, outer)

    threads = [threading.Thread(target=cluster, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    (records0, outer0), (records1, _) = results[0], results[1]
    for round_no in (1, 2, 3):
        a, b = records0[round_no - 1], records1[round_no - 1]
        assert a["ledger"] == b["ledger"] and a["ledger"]["round"] == round_no
        assert a["ledger"]["after"] == a["param_hash"]
        assert [m["rank"] for m in a["ledger"]["members"]] == [0, 1]
        assert a["ledger"]["outer_optimizer"].startswith("sgd lr=0.7 momentum=0.9")
    assert records0[1]["ledger"]["before"] == records0[0]["ledger"]["after"]
    saved = outer0.state_dict()
    assert saved["param_hash"] == records0[-1]["param_hash"] and len(saved["ledger"]) == 3
    fresh = DiLoCo(linear_model([1.0, 2.0]), InProcessGalaxy(1).averager(0, 2), outer_hv(), warn=print)
    fresh.load_state_dict(saved)
    assert fresh.ledger.entries == outer0.ledger.entries


def write_metrics(path: Path, entries: list[LedgerEntry], outcome: str = "applied") -> Path:
    records = [{"event": "start", "config": {"hv": {"world_rank": int(path.stem[-1])}}}]
    records += [
        {
            "step": 5 * e.round,
            "outer_step": e.round,
            "param_hash": e.after,
            "round_outcome": outcome,
            "ledger": e.to_wire(),
        }
        for e in entries
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_verify_passes_a_chain_shows_a_fork_and_refuses_breaks(tmp_path):
    main = [entry(1, "a", "b"), entry(2, "b", "c"), entry(3, "c", "d")]
    files = [write_metrics(tmp_path / f"cluster{rank}.jsonl", main) for rank in (0, 1)]
    clusters, checkpoints = ledger_view.read_sources([tmp_path])
    assert ledger_view.verify(clusters, checkpoints) == []
    galaxy = ledger_view.galaxy_ledger(clusters)
    assert [e.round for e in galaxy.chain] == [1, 2, 3] and ledger_view.chain_problems(galaxy) == []

    # cluster 2 applied round 3 alone (a fork), then re-synced onto the galaxy's: shown, not refused
    alone = entry(3, "c", "x", members=(2,))
    forked = write_metrics(tmp_path / "cluster2.jsonl", [*main[:2], alone])
    with forked.open("a") as out:
        out.write(
            json.dumps(
                {
                    "outer_step": 3,
                    "param_hash": "d",
                    "round_outcome": "resynced",
                    "resynced": True,
                    "ledger": main[2].to_wire(),
                }
            )
            + "\n"
        )
    clusters, _ = ledger_view.read_sources([tmp_path])
    assert ledger_view.verify(clusters, []) == []
    shown = "\n".join(ledger_view.render(ledger_view.galaxy_ledger(clusters), rounds=5))
    assert "fork at round 3: 2 entries" in shown and "(on the chain)" in shown

    # a round that does not start where the previous ended, within one launch: refused
    write_metrics(files[1], [main[0], entry(2, "z", "c"), main[2]])
    clusters, _ = ledger_view.read_sources(files[1:])
    assert "cluster 1's chain breaks at round 2" in ledger_view.verify(clusters, [])[0]


def test_a_checkpoint_must_end_its_chain_at_its_theta(tmp_path):
    ckpt = tmp_path / "step_00000010"
    ckpt.mkdir()
    (ckpt / ".metadata").write_text("")
    (ckpt / "metadata.json").write_text(json.dumps({"outer_step": 2, "param_hash": "c"}))
    (ckpt / "ledger.jsonl").write_text(
        "".join(json.dumps(e.to_wire()) + "\n" for e in (entry(1, "a", "b"), entry(2, "b", "c")))
    )
    _, checkpoints = ledger_view.read_sources([tmp_path])
    assert ledger_view.verify([], checkpoints) == []
    (ckpt / "metadata.json").write_text(json.dumps({"outer_step": 2, "param_hash": "q"}))
    _, checkpoints = ledger_view.read_sources([tmp_path])
    assert (
        "holds θ q at outer step 2, but its ledger ends at round 2 on θ c"
        in ledger_view.verify([], checkpoints)[0]
    )
