"""scripts/bench/memory_soak.py's arithmetic: growth per round from samples of a galaxy (the bench itself runs
a galaxy for thousands of rounds, outside the suite)."""

from __future__ import annotations

import pytest

from scripts.bench.memory_soak import growth, slope

KIB = 1024


def sample(step: int, dht_bytes: int, *, shutting_down: bool = False) -> dict:
    cluster = {
        "outer_step": step,
        "trainer": 100 << 20,
        "dht": dht_bytes,
        "averager": 50 << 20,
        "p2pd": 90 << 20,
    }
    if shutting_down:
        del cluster["averager"]  # a role already gone: not a sample of a training galaxy
    return {"seconds": step / 5, "cluster0": cluster, "cluster1": dict(cluster), "bootstrap": 150 << 20}


def test_slope_is_least_squares():
    assert slope([(0, 1.0), (1, 3.0), (2, 5.0)]) == pytest.approx(2.0)
    assert slope([(0, 1.0), (1, 2.0), (2, 0.0)]) == pytest.approx(-0.5)
    assert slope([(3, 1.0)]) == 0.0 and slope([(3, 1.0), (3, 2.0)]) == 0.0


def test_growth_fits_each_role_after_the_warm_up_and_while_every_process_is_up():
    samples = [
        sample(step, (20 << 20) + (50_000 if step < 100 else 0) + 4 * KIB * step)
        for step in range(0, 1000, 10)
    ]
    samples.append(sample(1000, 900 << 20, shutting_down=True))  # would bend the line if it counted
    rows = {row["process"]: row for row in growth(samples, warmup_rounds=100)}
    assert rows["cluster0 dht"]["kib_per_round"] == pytest.approx(4.0)
    assert rows["cluster1 dht"]["rounds"] == "110..990"
    assert rows["cluster0 trainer"]["kib_per_round"] == pytest.approx(0.0)
    assert rows["hivemind-dht"]["uss_end_mib"] == pytest.approx(150.0)
    assert set(rows) == {
        f"cluster{c} {r}" for c in (0, 1) for r in ("averager", "dht", "p2pd", "trainer")
    } | {"hivemind-dht"}


def test_a_run_too_short_to_fit_says_so():
    with pytest.raises(SystemExit, match="more --rounds"):
        growth([sample(step, 20 << 20) for step in range(0, 50, 10)], warmup_rounds=100)
