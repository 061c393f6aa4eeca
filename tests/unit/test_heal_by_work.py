"""Heal by the ledger (issue 49): of two chains, the galaxy keeps the one with more committed work
(``LedgerEntry.work``), whatever its round. A lighter fork further in rounds takes the heavier chain's state
and records the rounds it drops; the heavier side never takes the lighter fork's, mid-run or at the end."""

from __future__ import annotations

import dataclasses

from open_diloco.outer.diloco import DiLoCo
from open_diloco.outer.ledger import LedgerEntry, Member, round_entry
from open_diloco.outer.protocols import Membership
from tests.unit.test_round_protocol import ShardPeer, _hv, _model, _report


def _chain(first: int, last: int, tokens: int, work: int, before: str, tag: str) -> list[LedgerEntry]:
    """Entries of rounds ``first..last``, each committing ``tokens``, on top of a chain of ``work`` ending at
    θ ``before``."""
    entries = []
    for number in range(first, last + 1):
        work += tokens
        after = f"{tag}{number}"
        entries.append(
            LedgerEntry(number, 0, 0, before, after, (Member(0),), "none", "sgd", tokens=tokens, work=work)
        )
        before = after
    return entries


COMMON = _chain(1, 10, tokens=30, work=0, before="init", tag="c")  # three clusters together: work 300
HEAVY = COMMON + _chain(11, 25, tokens=20, work=300, before="c10", tag="h")  # two clusters on: 600 at 25
FORK = COMMON + _chain(11, 31, tokens=10, work=300, before="c10", tag="f")  # one alone, further: 510 at 31


class Records(ShardPeer):
    """Membership as the other clusters' records show it: each one's outer step and committed work."""

    def __init__(self, reports, served, works: dict[int, int]):
        super().__init__(1, reports, served)
        self.works = works

    def membership(self):
        steps = {rank: int(meta["outer_step"]) for rank, (meta, _) in self.served.items()}
        work, lead = max((self.works[rank], step) for rank, step in steps.items())
        sources = {rank: str(rank) for rank in self.served}
        return Membership(lead=lead, lead_work=work, steps=steps, sources=sources, works=dict(self.works))


def _cluster(values: list[float], step: int, chain: list[LedgerEntry], peer: ShardPeer, rank: int, warn=None):
    outer = DiLoCo(_model(values), peer, _hv(galaxy_size=3, world_rank=rank), warn=warn or (lambda *_: None))
    outer.state.outer_step = step
    outer.ledger.entries = list(chain)
    return outer


def _serving(values: list[float], step: int, chain: list[LedgerEntry]):
    """What a cluster at ``step`` on ``chain`` serves: its last entry names the θ it holds (a download is
    checked against it)."""
    donor = _cluster(values, step, chain, ShardPeer(1, [], {}), rank=0)
    donor.ledger.entries[-1] = dataclasses.replace(chain[-1], after=donor.committed.cluster_hash())
    return donor.committed.served()


def test_a_lighter_fork_further_in_rounds_takes_the_heavier_chain_and_records_what_it_drops():
    # cluster 1 committed alone after a partition (rounds 11..31, work 510); clusters 0 and 2 went on together
    # (rounds 11..25, work 600). Before: cluster 1 was "ahead" (31 > 25) and the two took its state
    heavy = _serving([0.25], step=25, chain=HEAVY)
    warnings: list[str] = []
    outer = _cluster([1.0], 31, FORK, Records([], {0: heavy}, works={0: 600}), rank=1, warn=warnings.append)
    record = outer.after_inner_step(1)
    assert record["round_outcome"] == "resynced" and record["state_source"] == 0, warnings
    assert record["outer_step"] == 25 and record["committed_work"] == 600
    assert outer.state.params.item() == 0.25 and outer.ledger.entries[-2] == HEAVY[-2]
    assert record["ledger_dropped"] == {
        "rounds": [11, 31],
        "head": FORK[-1].hash,
        "work": 510,
        "kept_head": outer.ledger.last.hash,
        "kept_work": 600,
    }
    assert any("rounds 11..31 (committed work 510" in line for line in warnings), warnings


def test_the_heavier_side_goes_on_with_its_round_when_a_lighter_fork_is_further():
    fork = _serving([9.0], step=31, chain=FORK)
    peer = Records([_report([0, 2])], {1: fork}, works={1: 510})
    outer = _cluster([1.0], 25, HEAVY, peer, rank=0)
    record = outer.after_inner_step(1)
    assert record["round_outcome"] == "applied" and record["outer_step"] == 26, record
    assert peer.sources_asked == []  # nothing downloaded from the fork
    # on top of the chain's 600: one step's tokens (one per step here) of each of the two members
    assert outer.ledger.entries[-2].work == 600 and outer.ledger.last.work == 602
    assert record["committed_work"] == outer.ledger.last.work


def test_an_entry_counts_its_members_tokens_on_top_of_the_most_work_a_member_held():
    peers = {0: {"tokens": 40, "work": 600}, 2: {"tokens": 20, "work": 600}, 5: {"tokens": 7, "work": 1}}
    entry = round_entry(
        round_no=26, attempt=0, fragment=0, before="h25", after="x", peers=peers, members={0, 2}
    )
    assert (entry.tokens, entry.work) == (60, 660)  # a non-member's tokens count for nothing
    assert LedgerEntry.from_wire(entry.to_wire()) == entry
    old = round_entry(round_no=1, attempt=0, fragment=0, before="a", after="b", peers={}, members={0})
    assert old.work == 0 and "work" in old.to_wire()
    legacy = {k: v for k, v in old.to_wire().items() if k not in ("tokens", "work", "hash")}
    assert LedgerEntry.from_wire(legacy).work is None  # an entry made before the count keeps its hash


def test_a_download_that_is_not_the_state_its_entry_committed_is_refused():
    served = _serving([0.25], step=25, chain=HEAVY)
    metadata, tensors = served
    forged = ({**metadata, "ledger": [*metadata["ledger"][:-1], HEAVY[-1].to_wire()]}, tensors)  # after "h25"
    warnings: list[str] = []
    outer = _cluster(
        [1.0], 3, COMMON[:3], Records([], {0: forged}, works={0: 600}), rank=1, warn=warnings.append
    )
    assert outer.catch_up.adoption.download(0, timeout=1.0) is None
    assert any("is not the one its ledger entry for outer step 25 committed (h25)" in w for w in warnings)
    outer.catch_up.adoption.averager.served = {0: served}
    assert outer.catch_up.adoption.download(0, timeout=1.0).step == 25
