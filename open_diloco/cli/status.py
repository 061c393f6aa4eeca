"""``open-diloco status --initial-peers MADDR``: every cluster of a galaxy, read from the DHT as a client."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Annotated

from cyclopts import Parameter, validators

from open_diloco.errors import ConfigError, OpenDilocoError

if TYPE_CHECKING:
    from open_diloco.galaxy.status import StatusReader


def status(
    *,
    initial_peers: Annotated[list[str], Parameter(consume_multiple=True, negative=())],
    run_id: str = "open_diloco",
    watch: bool = False,
    interval: Annotated[float, Parameter(validator=validators.Number(gt=0))] = 5.0,
    json_output: Annotated[bool, Parameter(name="--json")] = False,
    timeout: Annotated[float, Parameter(validator=validators.Number(gt=0))] = 10.0,
    galaxy_size: Annotated[int | None, Parameter(validator=validators.Number(gte=1))] = None,
) -> None:
    """Show every cluster of a galaxy: steps, θ_outer hash, round times, and who is behind, silent or split.

    Joins the DHT as a client (it never takes part in a round) and reads the record each cluster's rank 0
    refreshes there every --hv.heartbeat-interval and after every round. Exit 1 when no cluster of the run
    has a record.

    Parameters
    ----------
    initial_peers
        Multiaddr(s) of a DHT peer of the galaxy (the line `hivemind-dht` printed).
    run_id
        The galaxy's --hv.run-id.
    watch
        Refresh every --interval seconds until Ctrl+C.
    interval
        Seconds between refreshes with --watch. [range: > 0]
    json_output
        Print a JSON array, one object per cluster (keys: open_diloco/status_view.py JSON_KEYS), instead of
        the table; with --watch, one array per line.
    timeout
        Seconds to join the DHT and to read it. [range: > 0]
    galaxy_size
        The galaxy's --hv.galaxy-size, to show how many clusters are missing. [range: ≥ 1]
    """
    reader = open_reader(initial_peers, run_id, timeout)
    from rich.console import Console

    from open_diloco.status_view import as_json_rows, build_table, galaxy_line, judge

    console = Console() if sys.stdout.isatty() else Console(width=200)  # a log or a pipe: cut no column
    with reader:
        while True:
            records = reader.read()
            rows = judge(records)
            if json_output:
                print(json.dumps(as_json_rows(rows)), flush=True)
            elif rows:
                if watch:
                    console.clear()
                console.print(build_table(rows, run_id, galaxy_size))
                console.print(galaxy_line(records))
            if not watch:
                break
            time.sleep(interval)
    if not rows:
        raise StatusEmpty(
            f"no cluster of run {run_id!r} has a status record in this DHT: check --run-id (the galaxy's "
            "--hv.run-id) and that its clusters have started"
        )


def open_reader(initial_peers: list[str], run_id: str, timeout: float) -> StatusReader:
    """A DHT client reading run ``run_id``'s records (``status``, ``ledger --initial-peers``): the addresses
    checked first, and one line naming them when no peer answers within ``timeout``."""
    from open_diloco.addresses import peer_address

    for maddr in initial_peers:
        peer_address(maddr, "--initial-peers")
    from open_diloco.galaxy.status import StatusReader

    try:
        return StatusReader(initial_peers, run_id, timeout)
    except ConfigError:
        raise ConfigError(
            f"no DHT peer answered at --initial-peers {' '.join(initial_peers)} within {timeout}s: check the "
            "address (the line hivemind-dht printed) and that the galaxy's DHT runs"
        ) from None


class StatusEmpty(OpenDilocoError):
    """``open-diloco status`` found nobody: exit 1, as a monitoring script expects of an empty galaxy."""
