"""The round policy: one decision per round outcome, every rule pinned."""

from __future__ import annotations

import pytest

from open_diloco.outer.policy import Decision, RoundOutcome, RoundPolicy, most_advanced


def _outcome(clusters=2, in_sync=True, behind=False, attempts=0, alive=2) -> RoundOutcome:
    return RoundOutcome(clusters=clusters, in_sync=in_sync, behind=behind, attempts=attempts, alive=alive)


@pytest.mark.parametrize(
    "policy, outcome, decision",
    [
        ("retry", _outcome(), Decision.APPLY),
        ("retry", _outcome(clusters=1), Decision.RETRY),
        ("retry", _outcome(clusters=1, attempts=2), Decision.PROCEED),
        ("proceed", _outcome(clusters=1), Decision.PROCEED),
        ("fail", _outcome(clusters=1), Decision.STOP),
        ("fail", _outcome(), Decision.APPLY),
        ("retry", _outcome(in_sync=False, behind=True), Decision.RESYNC),
        ("retry", _outcome(in_sync=False, behind=False), Decision.APPLY),  # the others adopt our state
        ("retry", _outcome(clusters=1, in_sync=False, behind=True), Decision.RETRY),
        ("proceed", _outcome(clusters=1, in_sync=False, behind=True), Decision.RESYNC),
        # live membership: the round is judged against the clusters that are alive, not --hv.galaxy-size
        ("retry", _outcome(clusters=1, alive=1), Decision.APPLY),
        ("fail", _outcome(clusters=1, alive=1), Decision.APPLY),
        ("retry", _outcome(clusters=2, alive=3), Decision.RETRY),
        ("retry", _outcome(clusters=3, alive=3), Decision.APPLY),
    ],
)
def test_decision(policy, outcome, decision):
    assert RoundPolicy(on_partial_round=policy, max_retries=2).decide(outcome) is decision


def test_most_advanced_is_latest_round_then_lowest_rank():
    peers = {0: {"round_id": 3}, 1: {"round_id": 4}, 2: {"round_id": 4}}
    assert most_advanced(peers, outer_step=3, galaxy_rank=0) == (4, -1)
    assert most_advanced({}, outer_step=5, galaxy_rank=2) == (5, -2)
