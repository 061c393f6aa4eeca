"""Goodput (``open_diloco/outer/goodput.py``): tokens committed into θ_outer, counted from the chain a cluster
holds, over tokens computed."""

from __future__ import annotations

from open_diloco.outer.goodput import Goodput
from open_diloco.outer.ledger import KEEP, Ledger, LedgerEntry, Member


def entry(rnd: int, members: tuple[int, ...], steps: int | None = 4, tag: str = "") -> LedgerEntry:
    return LedgerEntry(
        round=rnd,
        attempt=0,
        fragment=0,
        before=f"{tag}{rnd - 1}",
        after=f"{tag}{rnd}",
        members=tuple(Member(rank, 1.0, steps) for rank in members),
        codec="none",
        outer_optimizer="sgd",
    )


def appended(goodput: Goodput, ledger: Ledger, new: LedgerEntry) -> None:
    ledger.append(new)
    goodput.appended(new)


def test_a_cluster_counts_its_own_steps_in_the_rounds_it_is_a_member_of():
    goodput = Goodput(galaxy_rank=1, tokens_per_step=100, local_steps=4, fragments=2)
    ledger = Ledger()
    goodput.trained(8)  # two strides of a fragment each
    appended(goodput, ledger, entry(1, (0, 1)))  # 4 steps x 100 tokens / 2 fragments
    appended(goodput, ledger, entry(2, (0,)))  # left out: none of its own
    assert (goodput.computed, goodput.committed) == (800, 200)
    assert goodput.ratio == 0.25
    appended(goodput, ledger, entry(3, (0, 1), steps=None))  # an entry that does not say: H steps
    assert goodput.committed == 400
    assert goodput.metrics() == {"tokens_computed": 800, "tokens_committed": 400, "goodput": 0.5}


def test_a_chain_taken_instead_takes_out_the_dropped_rounds_and_counts_the_taken_ones():
    goodput = Goodput(galaxy_rank=0, tokens_per_step=10, local_steps=4)
    ledger = Ledger()
    for rnd in (1, 2, 3):
        appended(goodput, ledger, entry(rnd, (0,), tag="own"))  # a fork alone
    assert goodput.committed == 120
    # the galaxy kept the other fork from round 2 on; it holds this cluster's Δ in its round 3
    served = [entry(2, (1, 2)).to_wire(), entry(3, (0, 1, 2)).to_wire()]
    before = list(ledger.entries)
    dropped = ledger.take(served)
    goodput.chain_changed(before, ledger.entries)
    assert dropped is not None and dropped.rounds == (2, 3)
    assert goodput.committed == 40 + 40  # round 1 of its own, and its part of the kept round 3


def test_a_restart_that_takes_rounds_its_killed_launch_computed_counts_them_computed_too():
    # resumed from a checkpoint of round 1 (its counts: 40 computed, 40 committed), the cluster takes the
    # galaxy's chain, which holds its Δ of rounds 2 and 3 (computed by the killed launch after that
    # checkpoint): committed 120, and computed no less (the soak's twice-killed cluster read 100.2 %)
    goodput = Goodput(galaxy_rank=0, tokens_per_step=10, local_steps=4)
    goodput.load_state_dict({"computed": 40, "committed": 40})
    ledger = Ledger()
    ledger.take([entry(1, (0, 1)).to_wire()])
    before = list(ledger.entries)
    ledger.take([entry(rnd, (0, 1)).to_wire() for rnd in (1, 2, 3)])
    goodput.chain_changed(before, ledger.entries)
    assert (goodput.computed, goodput.committed, goodput.ratio) == (120, 120, 1.0)


def test_entries_that_only_fall_off_the_front_stay_counted():
    goodput = Goodput(galaxy_rank=0, tokens_per_step=1, local_steps=1)
    ledger = Ledger()
    for rnd in range(1, KEEP + 3):
        appended(goodput, ledger, entry(rnd, (0,), steps=1))
    assert len(ledger.entries) == KEEP and goodput.committed == KEEP + 2
    # a taken chain that pushes the front out: only what the taken chain changed counts
    before = list(ledger.entries)
    ledger.take([before[-1].to_wire(), entry(KEEP + 3, (0,), steps=1).to_wire()])
    goodput.chain_changed(before, ledger.entries)
    assert ledger.entries[0].round == 4 and goodput.committed == KEEP + 3


def test_the_counts_go_through_a_checkpoint_and_an_old_one_starts_them_at_zero():
    goodput = Goodput(galaxy_rank=0, tokens_per_step=5, local_steps=4)
    goodput.trained(3)
    goodput.committed = 10
    again = Goodput(galaxy_rank=0, tokens_per_step=5, local_steps=4)
    again.load_state_dict(goodput.state_dict())
    assert (again.computed, again.committed) == (15, 10)
    again.load_state_dict(None)
    assert (again.computed, again.committed, again.ratio) == (0, 0, None)
    assert "goodput" not in again.metrics()
