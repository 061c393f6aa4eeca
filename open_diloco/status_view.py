"""How ``open-diloco status`` judges and shows the galaxy's status records (pure: no DHT, no torch).

A record (:class:`~open_diloco.membership_record.MemberRecord`) is what one cluster's rank 0 published
(:mod:`open_diloco.galaxy.status`). Judging adds the flags an on-call engineer acts on:

- ``stopped``: the cluster said it ended (finished, stopped by a signal, failed), with how;
- ``silent``: it still claims to train but has not refreshed its record for longer than its
  ``--hv.member-expiry`` (killed, hung, or cut off from the DHT): the galaxy's rounds no longer wait for it;
- ``behind``: it trains, but its outer step trails the most advanced cluster that is still training;
- ``hash differs``: its θ_outer hash differs from the majority of the clusters at the same outer step (after a
  round, clusters of one galaxy hold bitwise-identical weights, so any difference is a split).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from open_diloco.membership_record import MemberRecord, chain_weight
from open_diloco.outer.goodput import share


def judge(records: list[MemberRecord]) -> list[dict[str, Any]]:
    """One row per record: what it published (:meth:`MemberRecord.to_wire`), its ``last_seen_seconds``,
    ``flags`` (a list of short strings, empty when all is well) and ``behind_by`` (outer steps behind the most
    advanced training cluster)."""
    live = [record for record in records if record.training and not _silent(record)]
    lead = max((record.outer_step for record in live), default=None)
    majority = _majority_hash_per_outer_step(records)
    rows = []
    for record in records:
        flags: list[str] = []
        if not record.training:
            flags.append(str(record.state or "stopped"))
        elif _silent(record):
            flags.append(f"silent {record.last_seen_seconds:.0f}s")
        behind_by = max(0, lead - record.outer_step) if lead is not None else 0
        if behind_by and record.training:  # a stopped cluster is flagged as such
            flags.append(f"behind {behind_by} round(s)")
        if record.param_hash is not None and record.param_hash != majority.get(record.outer_step):
            flags.append("hash differs")
        row = {**record.to_wire(), "last_seen_seconds": record.last_seen_seconds}
        rows.append({**row, "behind_by": behind_by, "flags": flags, "goodput": _goodput([record])})
    return rows


def _goodput(records: list[MemberRecord]) -> float | None:
    """Tokens committed ÷ tokens computed over ``records`` (``outer/goodput.py``); ``None`` when none says."""
    return share((r.tokens_computed, r.tokens_committed) for r in records)


def galaxy_line(records: list[MemberRecord]) -> str:
    """The galaxy's goodput (every cluster with a record, ended ones too: their work counts) beside its
    throughput (the training clusters' tokens per second): a cluster that computes less lowers the second;
    and the roster of the chain with the most committed work (the one the galaxy keeps): whose majority a
    round needs, so an operator sees a cluster the roster dropped."""
    goodput = _goodput(records)
    rate = sum(r.tokens_per_second or 0.0 for r in records if r.training and not _silent(r))
    shown = "-" if goodput is None else f"{goodput:.1%}"
    line = f"galaxy: goodput {shown} (tokens committed / computed), {rate:,.0f} tokens/s training"
    named = [r for r in records if r.roster is not None]
    if named:
        heaviest = max(named, key=lambda r: (*chain_weight(r), -r.galaxy_rank))
        line += f"; roster {sorted(heaviest.roster)} (cluster {heaviest.galaxy_rank}'s chain, the heaviest)"
        joiners = sorted(  # an elastic galaxy's (a fixed one's cluster off the roster was dropped)
            r.galaxy_rank
            for r in records
            if r.cluster_id and r.training and not _silent(r) and r.galaxy_rank not in heaviest.roster
        )
        if joiners:
            line += f"; joining {joiners}"
        line += _data_line(heaviest)
    return line


def _data_line(record: MemberRecord) -> str:
    """An elastic galaxy's data as the heaviest chain's deal has it (``outer/deal.py``): the cursor, the pages
    committed (their share of those dealt) and, on a corpus, the epoch."""
    if record.data_cursor is None:
        return ""
    committed = record.data_committed_pages or 0
    share_of = f" ({committed / record.data_cursor:.1%})" if record.data_cursor else ""
    epoch = f", epoch {record.data_epoch:.2f}" if record.data_epoch is not None else ""
    return f"; data: {record.data_cursor} pages dealt, {committed} committed{share_of}{epoch}"


def _silent(record: MemberRecord) -> bool:
    """The cluster has not refreshed its record for longer than its own ``--hv.member-expiry``: the galaxy's
    rounds no longer wait for it (:attr:`MemberRecord.silent_after`)."""
    return record.last_seen_seconds > record.silent_after


def _majority_hash_per_outer_step(records: list[MemberRecord]) -> dict[int, str | None]:
    """The hash most clusters at each outer step agree on; ``None`` where there is no strict majority (two
    clusters that disagree are both flagged: the board cannot tell which one split off)."""
    by_step: dict[int, Counter[str]] = {}
    for record in records:
        if record.param_hash is not None:
            by_step.setdefault(record.outer_step, Counter())[record.param_hash] += 1
    majority: dict[int, str | None] = {}
    for step, counts in by_step.items():
        (top, votes), *_ = counts.most_common(1)
        majority[step] = top if votes * 2 > sum(counts.values()) else None
    return majority


# -- what the person sees ----------------------------------------------------------------------------------
JSON_KEYS = (
    "galaxy_rank",
    "state",
    "host",
    "ranks",
    "inner_step",
    "outer_step",
    "param_hash",
    "in_sync",
    "loss",
    "tokens_per_second",
    "allreduce_seconds",
    "round_wall_seconds",
    "bytes_sent",
    "bytes_received",
    "galaxy_peers",
    "galaxy_alive",
    "codec",
    "model_fingerprint",
    "local_steps",
    "version",
    "peer_id",
    "last_seen_seconds",
    "behind_by",
    "flags",
    "shard_peer_ids",
    "round_steps",
    "inner_steps",
    "round_inner_steps",
    "round_weight",
    "inner_step_seconds",
    "client_mode",
    "tokens_computed",
    "tokens_committed",
    "goodput",
    "roster",
    "cluster_id",
    "data_cursor",
    "data_committed_pages",
    "data_epoch",
)
"""What ``--json`` prints per cluster, in this order (a public contract, like the metrics keys: add, don't
rename)."""


def as_json_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: row.get(key) for key in JSON_KEYS} for row in rows]


def build_table(rows: list[dict[str, Any]], run_id: str, expected_size: int | None = None) -> Any:
    """A rich table, one row per cluster, flagged rows in red."""
    from rich.table import Table

    clusters = f"{len(rows)} cluster(s)" + (f" of {expected_size}" if expected_size else "")
    table = Table(title=f"galaxy {run_id}: {clusters}", title_justify="left")
    # --hv.round-steps by-speed: how many of a round's steps each cluster takes, and what its Δ weighs
    by_speed = any(row.get("round_weight") is not None for row in rows)
    for name, justify in (
        ("rank", "right"),
        ("host", "left"),
        ("ranks", "right"),
        ("state", "left"),
        ("inner", "right"),
        ("outer", "right"),
        ("loss", "right"),
        ("tok/s", "right"),
        ("round s", "right"),
        ("MB sent", "right"),
        ("goodput", "right"),
        *((("steps/round", "right"), ("weight", "right")) if by_speed else ()),
        ("codec", "left"),
        ("hash", "left"),
        ("seen", "right"),
        ("flags", "left"),
    ):
        table.add_column(name, justify=justify)
    for row in rows:
        pace = (
            (
                f"{row.get('round_inner_steps', '?')}/{row.get('local_steps', '?')}",
                _number(row.get("round_weight"), "{:.2f}"),
            )
            if by_speed
            else ()
        )
        table.add_row(
            str(row["galaxy_rank"]) + (f" ({row['cluster_id']})" if row.get("cluster_id") else ""),
            str(row.get("host", "?")),
            str(row.get("ranks", "?")),
            str(row.get("state", "?")),
            str(row.get("inner_step", "?")),
            str(row.get("outer_step", "?")),
            _number(row.get("loss"), "{:.4f}"),
            _number(row.get("tokens_per_second"), "{:,.0f}"),
            _number(row.get("allreduce_seconds"), "{:.2f}"),
            _number(row.get("bytes_sent"), "{:.1f}", scale=1e-6),
            _number(row.get("goodput"), "{:.1%}"),
            *pace,
            str(row.get("codec", "?")),
            str(row.get("param_hash") or "-"),
            f"{row['last_seen_seconds']:.0f}s ago",
            ", ".join(row["flags"]) or "ok",
            style="red" if row["flags"] else None,
        )
    return table


def _number(value: Any, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else fmt.format(value * scale)
