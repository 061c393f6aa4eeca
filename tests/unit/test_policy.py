"""The round policy: one decision per round outcome, every rule pinned."""

from __future__ import annotations

import pytest

from open_diloco.outer.policy import Decision, RoundOutcome, RoundPolicy


def _outcome(clusters=2, attempts=0, alive=2) -> RoundOutcome:
    return RoundOutcome(clusters=clusters, attempts=attempts, alive=alive)


@pytest.mark.parametrize(
    "policy, outcome, decision",
    [
        ("retry", _outcome(), Decision.APPLY),
        ("retry", _outcome(clusters=1), Decision.RETRY),
        ("retry", _outcome(clusters=1, attempts=2), Decision.PROCEED),
        ("proceed", _outcome(clusters=1), Decision.PROCEED),
        ("fail", _outcome(clusters=1), Decision.STOP),
        ("fail", _outcome(), Decision.APPLY),
        # live membership: the round is judged against the clusters that are alive, not --hv.galaxy-size
        ("retry", _outcome(clusters=1, alive=1), Decision.APPLY),
        ("fail", _outcome(clusters=1, alive=1), Decision.APPLY),
        ("retry", _outcome(clusters=2, alive=3), Decision.RETRY),
        ("retry", _outcome(clusters=3, alive=3), Decision.APPLY),
    ],
)
def test_decision(policy, outcome, decision):
    assert RoundPolicy(on_partial_round=policy, max_retries=2).decide(outcome) is decision
