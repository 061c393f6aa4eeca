"""What the e2e tests assert of the galaxy's ledger (``outer/ledger.py``), through the user's own command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from open_diloco.local_galaxy import read_metrics


def entries_by_round(metrics: Path) -> dict[int, dict]:
    """A cluster's ledger entries by round, from its round records (the last record naming each round)."""
    return {
        r["ledger"]["round"]: r["ledger"] for r in read_metrics(metrics) if isinstance(r.get("ledger"), dict)
    }


def assert_one_chain(metrics: list[Path], rounds: list[int], members: list[int]) -> None:
    """Every cluster holds the same entry for each of ``rounds`` (made by each member on its own), with
    ``members``, and the entries chain: round r starts from the θ round r − 1 ended at."""
    held = [entries_by_round(m) for m in metrics]
    for round_no in rounds:
        hashes = {cluster[round_no]["hash"] for cluster in held}
        assert len(hashes) == 1, (round_no, [cluster.get(round_no) for cluster in held])
        assert [m["rank"] for m in held[0][round_no]["members"]] == members, held[0][round_no]
    for previous, entry in zip(rounds, rounds[1:], strict=False):
        assert held[0][entry]["before"] == held[0][previous]["after"], (held[0][previous], held[0][entry])


def ledger_command(*args: str | Path) -> subprocess.CompletedProcess:
    """``open-diloco ledger ARGS`` as a user runs it (stdout and stderr captured, never raising)."""
    return subprocess.run(
        [sys.executable, "-m", "open_diloco", "ledger", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_verifies_and_refuses_an_altered_hash(metrics: list[Path], work: Path) -> None:
    """``open-diloco ledger --verify`` passes on the run's metrics, and refuses in one line (exit 1) a copy
    in which one round's recorded θ hash was altered."""
    verified = ledger_command(*metrics, "--verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "verified:" in verified.stdout
    work.mkdir(parents=True, exist_ok=True)
    altered = work / "altered.jsonl"
    lines = metrics[0].read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if '"ledger"' in line)
    record = json.loads(lines[index])
    record["param_hash"] = "0" * len(record["param_hash"])
    lines[index] = json.dumps(record)
    altered.write_text("\n".join(lines) + "\n")
    refused = ledger_command(altered, *metrics[1:], "--verify")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "altered" in refused.stderr, refused.stderr
