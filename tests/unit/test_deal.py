"""The ledger's deal (outer/deal.py) and a cluster's side of it (outer/own_pages.py): pages dealt ahead,
committed only when every covering round carried them, everything else back in the queue, dealt first."""

from __future__ import annotations

from open_diloco.outer.deal import LOOKAHEAD, Deal, Hand, from_ranges, next_deal, to_ranges
from open_diloco.outer.own_pages import OwnPages


def _rounds(deal: Deal, rounds: list[tuple[dict, list[int]]], stride: int, fragments: int = 1):
    """Run ``rounds`` of (carries by rank, dealt_to) from ``deal``; what each committed and returned."""
    committed, returned = [], []
    for round_no, (carries, dealt_to) in enumerate(rounds, start=1):
        settled = next_deal(deal, round_no, carries, dealt_to, stride, fragments)
        deal = settled.deal
        committed.append(settled.committed)
        returned.append(settled.returned)
    return deal, committed, returned


def test_first_rounds_deal_ahead_and_a_full_stride_commits_its_pages():
    # genesis: rounds 1 and 2 carry nothing (no hand yet); round 1 deals stride 3, round 2 stride 4
    full = {0: {3: (0, 2)}, 1: {3: (0, 2)}}
    deal, committed, returned = _rounds(Deal(), [({0: {}, 1: {}}, [0, 1])] * 2 + [(full, [0, 1])], stride=2)
    assert LOOKAHEAD == 2
    assert committed[:2] == [{}, {}]
    assert committed[2] == {0: (0, 1), 1: (2, 3)}  # stride 3, dealt by round 1: all carried, all committed
    assert returned == [(), (), ()]
    assert deal.hand(4, 0).pages == (4, 5) and deal.hand(5, 1).pages == (10, 11)  # dealt by rounds 2 and 3
    assert deal.cursor == 12 and deal.queue == () and deal.committed == 4


def test_a_hand_not_carried_goes_back_and_is_dealt_first():
    deal = Deal(cursor=4, hands={1: {0: Hand((0, 1)), 1: Hand((2, 3))}})
    # cluster 1 is left out of round 1 (no member): its pages return; cluster 0 carried only its first page
    settled = next_deal(deal, 1, {0: {1: (0, 1)}}, [0, 1], stride_pages=2, fragments=1)
    assert settled.committed == {0: (0,)}
    assert settled.returned == (1, 2, 3)
    # the next stride is dealt from the queue first, lowest first, then fresh pages
    assert settled.deal.hand(3, 0).pages == (1, 2) and settled.deal.hand(3, 1).pages == (3, 4)
    assert settled.deal.cursor == 5 and settled.deal.queue == ()


def test_with_fragments_a_page_commits_only_when_every_fragment_carried_it():
    deal = Deal(cursor=4, hands={1: {0: Hand((0, 1)), 1: Hand((2, 3))}})
    first = next_deal(deal, 1, {0: {1: (0, 2)}, 1: {1: (0, 2)}}, [0, 1], 2, fragments=2)
    assert first.committed == {} and first.returned == ()  # stride 1 awaits its second fragment's round
    # round 2: cluster 1 re-synced in between (carries nothing of stride 1): its pages go back, 0's commit
    second = next_deal(first.deal, 2, {0: {1: (0, 2), 2: (0, 0)}, 1: {}}, [0, 1], 2, fragments=2)
    assert second.committed == {0: (0, 1)}
    assert second.returned == (2, 3)


def test_a_cluster_that_left_gives_back_what_it_was_dealt_at_once():
    deal = Deal(
        cursor=8, hands={2: {0: Hand((0, 1)), 5: Hand((2, 3))}, 3: {0: Hand((4, 5)), 5: Hand((6, 7))}}
    )
    # round 2: cluster 5 left (not dealt to, not a member): its stride 2 and its stride 3 come back now
    settled = next_deal(deal, 2, {0: {2: (0, 2)}}, [0], 2, fragments=1)
    assert settled.committed == {0: (0, 1)}
    assert settled.returned == (2, 3, 6, 7)
    assert settled.deal.hand(3, 5) is None and settled.deal.hand(3, 0).pages == (4, 5)
    assert settled.deal.hand(2 + LOOKAHEAD, 0).pages == (2, 3)  # the queue is dealt before fresh pages
    assert settled.deal.queue == (6, 7) and settled.deal.cursor == 8


def test_the_deal_round_trips_on_the_wire_and_pages_compress_to_runs():
    deal = Deal(cursor=9, queue=(1, 2, 5), hands={3: {7: Hand((3, 4, 8), 1, 2)}})
    assert Deal.from_wire(deal.to_wire()) == deal
    assert to_ranges([3, 4, 8, 1]) == [[3, 5], [8, 9], [1, 2]]
    assert from_ranges(to_ranges([3, 4, 8, 1])) == [3, 4, 8, 1]
    assert deal.in_flight == {1, 2, 5, 4}


def test_a_clusters_side_reads_its_hand_and_says_what_its_delta_carries():
    deal = Deal(cursor=8, hands={3: {7: Hand((10, 11))}, 4: {7: Hand((12, 13))}})
    own = OwnPages(galaxy_rank=7, stride=2, fragments=1, trains_at=lambda step: True, deal_of=lambda: deal)
    assert own.page_at(4) is None  # stride 2: no hand, no step
    assert [own.page_at(step) for step in (5, 6, 7, 8)] == [10, 11, 12, 13]
    assert own.upcoming(6) == [11, 12, 13]
    own.trained(5)
    own.trained(6)
    assert own.contribution(3, local_steps=2) == (1.0, 2, {"3": [0, 2]})
    own.reset()  # a held round: θ_local is θ_outer again
    own.trained(8)
    assert own.contribution(4, local_steps=2) == (0.5, 1, {"4": [1, 2]})
    assert own.contribution(5, local_steps=2) == (0.5, 0, {})  # nothing carried: weighs as one page
    restored = OwnPages(7, 2, 1, lambda step: True)
    restored.load_state_dict(own.state_dict())
    assert restored.carried == own.carried


def test_by_speed_a_cluster_trains_the_first_pages_of_its_hand():
    deal = Deal(cursor=8, hands={1: {0: Hand((0, 1, 2, 3))}})
    odd_steps = OwnPages(0, 4, 1, trains_at=lambda step: step % 2 == 0, by_speed=True, deal_of=lambda: deal)
    assert [odd_steps.page_at(step) for step in (1, 2, 3, 4)] == [None, 0, None, 1]
    assert odd_steps.upcoming(1) == [0, 1]
