"""The pure parts of a striped state download: the parts' plan and failover (``galaxy/stripe_plan.py``), the
server's pinned snapshots (``galaxy/state_pins.py``), rank 0's choice of holders (``outer/adoption.py``)."""

from __future__ import annotations

import torch

from open_diloco.galaxy.state_pins import Pin, StatePins
from open_diloco.galaxy.stripe_plan import (
    MIN_PART_BYTES,
    PART_BYTES,
    Part,
    StripePlan,
    part_bytes_for,
    split_into_parts,
)
from open_diloco.outer.adoption import choose_holders
from open_diloco.outer.digests import fingerprint_bytes
from open_diloco.outer.protocols import Membership


def test_parts_cover_every_value_once_and_size_follows_the_state():
    parts = split_into_parts([10, 0, 7], [4, 4, 3])
    first, empty, last = [Part(0, 0, 4), Part(0, 4, 8), Part(0, 8, 10)], [], [Part(2, 0, 3), Part(2, 3, 6)]
    assert parts == first + empty + last + [Part(2, 6, 7)]
    assert part_bytes_for(1 << 30, 3) == PART_BYTES  # a big state: the largest parts
    assert part_bytes_for(4_200_000, 3) == 350_000  # a 1M model's shard: 4 parts a holder
    assert part_bytes_for(1000, 3) == MIN_PART_BYTES


def _drain(plan: StripePlan, holder: str, now: float) -> list[int]:
    """Every part ``plan`` gives ``holder`` now (up to its in-flight limit)."""
    got = []
    while (index := plan.next_for(holder, now)) is not None:
        got.append(index)
    return got


def test_parts_spread_over_holders_and_land_once():
    plan = StripePlan([Part(0, i, i + 1) for i in range(6)], ["a", "b", "c"])
    asked = {holder: _drain(plan, holder, 0.0) for holder in "abc"}
    assert asked == {"a": [0, 1], "b": [2, 3], "c": [4, 5]}  # two in flight each, none twice
    for holder, indices in asked.items():
        for index in indices:
            assert plan.landed(index, holder, 0.5)
    assert plan.complete and plan.parts_by_holder() == {"a": 2, "b": 2, "c": 2} and plan.refetched == 0


def test_a_failed_part_goes_to_another_holder_and_two_failures_drop_a_holder():
    plan = StripePlan([Part(0, i, i + 1) for i in range(4)], ["a", "b"], in_flight_per_holder=1)
    assert plan.next_for("a", 0.0) == 0 and plan.next_for("b", 0.0) == 1
    plan.failed(0, "a")
    assert "a" not in plan.dropped and plan.refetched == 1
    assert plan.next_for("a", 0.1) == 2  # a never gets part 0 again
    assert plan.landed(1, "b", 0.2) and plan.next_for("b", 0.2) == 0
    plan.failed(2, "a")  # a's second strike: dropped, its part goes back
    assert plan.dropped == {"a"} and plan.next_for("a", 0.3) is None
    assert plan.landed(0, "b", 0.4) and plan.next_for("b", 0.4) == 2
    assert plan.landed(2, "b", 0.5) and plan.next_for("b", 0.5) == 3 and plan.landed(3, "b", 0.6)
    assert plan.complete and plan.parts_by_holder() == {"a": 0, "b": 4} and plan.refetched == 2


def test_a_wrong_part_drops_its_holder_at_once_and_its_parts_in_flight_move():
    plan = StripePlan([Part(0, i, i + 1) for i in range(4)], ["a", "b"])
    assert _drain(plan, "a", 0.0) == [0, 1] and _drain(plan, "b", 0.0) == [2, 3]
    plan.failed(0, "a", wrong=True)
    assert plan.dropped == {"a"} and sorted(plan.pending) == [0, 1]  # both of a's parts, to be asked of b
    assert not plan.hopeless()
    for index in (2, 3):
        plan.landed(index, "b", 1.0)
    assert sorted(_drain(plan, "b", 1.0)) == [0, 1]


def test_a_lagging_part_is_hedged_at_an_idle_holder_and_the_first_answer_wins():
    plan = StripePlan([Part(0, i, i + 1) for i in range(3)], ["slow", "fast"], in_flight_per_holder=1)
    assert plan.next_for("slow", 0.0) == 0 and plan.next_for("fast", 0.0) == 1
    assert plan.landed(1, "fast", 0.1) and plan.next_for("fast", 0.1) == 2 and plan.landed(2, "fast", 0.2)
    assert plan.next_for("fast", 0.5) is None  # part 0 is out, but not for long yet
    assert plan.next_for("fast", 1.5) == 0 and plan.refetched == 1  # hedged
    assert plan.landed(0, "fast", 1.6) and plan.complete
    assert not plan.landed(0, "slow", 2.0)  # the slow answer comes second: not copied
    assert plan.parts_by_holder() == {"slow": 0, "fast": 3}


def test_a_part_every_holder_failed_makes_the_download_hopeless():
    plan = StripePlan([Part(0, 0, 1), Part(0, 1, 2)], ["a", "b"], in_flight_per_holder=1)
    plan.next_for("a", 0.0), plan.next_for("b", 0.0)
    plan.failed(0, "a")
    assert not plan.hopeless()
    plan.landed(1, "b", 0.1)
    assert plan.next_for("b", 0.1) == 0
    plan.failed(0, "b")
    assert plan.hopeless() and not plan.complete
    assert StripePlan([Part(0, 0, 1)], []).hopeless()


def _pin(step: int, values: torch.Tensor, at: float = 0.0) -> Pin:
    return Pin({"outer_step": step, "shard_hash": fingerprint_bytes(values)}, [values, values[:3] * 2], at)


def test_a_pin_describes_its_parts_and_serves_them_within_bounds():
    values = torch.arange(100_000, dtype=torch.float32)
    pin = _pin(3, values)
    described = pin.describe(MIN_PART_BYTES)
    assert described["part_values"] == [MIN_PART_BYTES // 4, MIN_PART_BYTES // 4]
    assert described["shapes"] == [[100_000], [3]] and described["dtypes"] == ["float32", "float32"]
    parts = split_into_parts([100_000, 3], described["part_values"])
    hashes = [digest for per_tensor in described["hashes"] for digest in per_tensor]
    assert len(parts) == len(hashes) == 7 + 1
    for part, digest in zip(parts, hashes, strict=True):
        assert fingerprint_bytes(pin.part(part.tensor, part.start, part.end)) == digest
    assert pin.describe(1) == pin.describe(MIN_PART_BYTES)  # clamped to the smallest part
    assert pin.part(2, 0, 1) is None and pin.part(0, 5, 5) is None and pin.part(0, 0, 100_001) is None
    big = _pin(3, torch.zeros(PART_BYTES // 4 + 1))
    assert big.part(0, 0, PART_BYTES // 4 + 1) is None and big.part(0, 0, PART_BYTES // 4) is not None


def test_pins_are_kept_by_outer_step_bounded_in_number_and_dropped_when_idle():
    pins = StatePins(idle_seconds=30.0, max_pins=2)
    first = pins.add(_pin(3, torch.ones(4)), now=0.0)
    assert pins.add(_pin(3, torch.zeros(4)), now=1.0) is first  # the parts already served came from it
    pins.add(_pin(4, torch.ones(4)), now=2.0)
    assert pins.get(3, now=10.0) is first  # a request keeps it
    pins.add(_pin(5, torch.ones(4)), now=11.0)  # a third: the least recently asked (4) goes
    assert pins.get(4, now=11.0) is None and len(pins) == 2
    assert pins.get(3, now=35.0) is first  # asked at 10: still there
    assert pins.get(5, now=45.0) is None and pins.get(3, now=70.0) is None and len(pins) == 0


def test_holders_are_the_live_serving_clusters_at_the_source_step_and_hash():
    view = Membership(
        steps={0: 5, 1: 5, 2: 5, 3: 4, 4: 5, 5: 5},
        sources={0: "p0", 1: "p1", 2: "p2", 3: "p3", 4: "p4"},
        reported={
            0: (5, "h", True),
            1: (5, "h", True),
            2: (5, "h", True),
            3: (4, "h", True),  # behind
            4: (5, "other", True),  # the same step, another θ
            5: (5, "h", True),  # serves no state for this shard (client mode)
            6: (5, "h", False),  # gone
        },
    )
    assert choose_holders(view, own_rank=2, source=0) == [1]
    assert choose_holders(view, own_rank=7, source=0) == [1, 2]
    assert choose_holders(view, own_rank=7, source=0, only=frozenset({0, 2})) == [2]
    unhashed = Membership(steps={0: 5, 1: 5}, sources={0: "p0", 1: "p1"}, reported={0: (5, None, True)})
    assert choose_holders(unhashed, own_rank=2, source=0) == []
