"""``open-diloco ledger RUN_DIR_OR_FILES...`` (or ``--initial-peers MADDR``): the galaxy's chain of committed
rounds, from a run's metrics and checkpoints or from a live galaxy's DHT; ``--verify`` checks it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from cyclopts import Parameter, validators

from open_diloco.errors import ConfigError, OpenDilocoError


def ledger(
    inputs: Annotated[list[Path] | None, Parameter(name="RUN_DIR_OR_FILES", consume_multiple=True)] = None,
    /,
    *,
    verify: bool = False,
    rounds: Annotated[int, Parameter(validator=validators.Number(gte=0))] = 20,
    json_output: Annotated[bool, Parameter(name="--json")] = False,
    initial_peers: Annotated[list[str] | None, Parameter(consume_multiple=True, negative=())] = None,
    run_id: str = "open_diloco",
    timeout: Annotated[float, Parameter(validator=validators.Number(gt=0))] = 10.0,
) -> None:
    """Show what the galaxy trained, round by round: each committed round's members and weights, the θ it
    started from and produced, its codec and outer optimizer; forks (two entries for one round) and gaps.

    Parameters
    ----------
    inputs
        A run's directory (searched for the clusters' *.jsonl metrics and for checkpoints), metrics files
        (--metrics-path) or checkpoint directories.
    verify
        Check instead of only showing: every entry matches its hash, every record's param_hash is its entry's,
        each cluster's chain continues and ends at its final θ, each checkpoint's θ is on its chain (and, with
        metrics, committed by some cluster). Exit 1 with one line on the first break.
    rounds
        Rounds of the chain to list, the latest (the summary and the forks are always shown). [range: ≥ 0]
    json_output
        Print every entry found, one JSON object per line (the ledger's wire form), instead of the table.
    initial_peers
        Read a live galaxy's DHT mirror instead of files: multiaddr(s) of a DHT peer (hivemind-dht's line).
    run_id
        With --initial-peers: the galaxy's --hv.run-id.
    timeout
        With --initial-peers: seconds to join the DHT and to read it. [range: > 0]
    """
    from open_diloco import ledger_view

    if bool(inputs) == bool(initial_peers):
        raise ConfigError(
            "give either a run's directories or files, or --initial-peers (a live galaxy's DHT): one of them"
        )
    if initial_peers:
        galaxy = ledger_view.galaxy_ledger([], _mirrored(initial_peers, run_id, timeout))
        problems = ledger_view.chain_problems(galaxy)
    else:
        clusters, checkpoints = ledger_view.read_sources(inputs)
        extra = [entry for ckpt in checkpoints for entry in ckpt.entries]
        galaxy = ledger_view.galaxy_ledger(clusters, extra)
        problems = ledger_view.verify(clusters, checkpoints) + ledger_view.chain_problems(galaxy)
    if json_output:
        for entries in (galaxy.by_round[r] for r in sorted(galaxy.by_round)):
            for entry in entries.values():
                print(json.dumps(entry.to_wire()))
    else:
        print("\n".join(ledger_view.render(galaxy, rounds)))
    if problems and verify:
        more = f" (and {len(problems) - 1} more: run without --verify to list them)" if problems[1:] else ""
        raise LedgerCheckFailed(problems[0] + more)
    for problem in problems:
        print(f"break: {problem}")
    if verify:
        print(f"verified: {len(galaxy.chain)} rounds on the chain, every source continuous")


def _mirrored(initial_peers: list[str], run_id: str, timeout: float) -> list:
    """The entries a live galaxy's DHT mirrors, up to the furthest outer step a cluster's record shows."""
    from open_diloco import ledger_view
    from open_diloco.cli.status import open_reader
    from open_diloco.galaxy.ledger_mirror import read_mirror

    with open_reader(initial_peers, run_id, timeout) as reader:
        top = max((record.outer_step for record in reader.read()), default=0)
        values = read_mirror(reader.dht, run_id, top, timeout)
    return ledger_view.entries_from_wire(values, f"an entry of run {run_id!r}'s DHT mirror")


class LedgerCheckFailed(OpenDilocoError):
    """``open-diloco ledger --verify`` found a break: one line, exit 1 (the check ran; the chain failed)."""
