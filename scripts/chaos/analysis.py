"""Judging a soak from its records: per cluster, per fault, and against issue 34's acceptance targets.

Words as the figures use them:
- a **good** sync: its ``param_hash`` equal to every other cluster's at the same outer step; a step no other
  cluster has a record of must also say ``in_sync`` (nothing to compare it with). Why hashes and not the
  cluster's own ``in_sync``: a cluster cut off by a partition records its last round before the link came
  back as alone (``in_sync`` false), and when the others then take exactly that state, the galaxy holds one θ
  at that step: the record is good (soak of 2026-11-28, fault #7);
- a fault's **repair**: from the fault's end (or, while a partition is still on then, the partition's end:
  :func:`repairable_from`) to a cluster's first good sync after it, in that cluster's syncs (1: its very next
  sync is good) and seconds; the fault's repair is the slowest cluster's;
- a sync is **due to a fault** while the fault lasts (a fault that takes clusters out of the galaxy, a kill, a
  late join or a cut, until they are back: :func:`windows`) and for the syncs after it until the cluster's
  repair, at most ``REPAIR_LIMIT``; everything else happened with no fault to blame.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from open_diloco.outer.goodput import share
from scripts.chaos.plan import CUTS, Fault, minority_of

REPAIR_LIMIT = 2  # syncs: every repair within 2, and no longer out-of-sync run after a fault
RESYNC_SHARE_LIMIT = 0.01  # re-synced syncs with no fault to blame
RETRY_SHARE_LIMIT = 0.05  # syncs retried with no fault to blame, in each cluster (issue 48)
TAKES_OUT = CUTS | {"kill_restart", "late_join"}
"""Faults that take clusters out of the galaxy (``plan.minority_of`` names them) until they are back."""
BACK_LIMIT = REPAIR_LIMIT + 1
"""Syncs a cluster out of the galaxy (killed, late, cut off) may take to be back after the fault's end: a
take, a second take when the galaxy committed during the first one's download, then its own Δ in a round."""
RECONNECT_SECONDS = 30.0
"""After a fault's end: how long a cluster's tries before it hears the others again (its record sees no
cluster alive beyond its own side, ``galaxy_alive``, and it took nothing) do not count towards its
``BACK_LIMIT``. Why: the soak's stride is about half a second, so a cut-off minority ran three to five such
tries in the 1-4 s after its link came back, while its connections were dialled anew, and used up its syncs
before it took the majority's state 10-15 s after the heal, which the judge then counted as a sit-out with no
fault to blame (`home`, seed 5, 2026-12-04). Such a try later than this counts: not hearing the others for
that long is a trouble of its own."""


@dataclass
class Window:
    fault: int
    start: float
    end: float  # the fault's end (repairs count from here)
    settled: float  # until here every cluster's syncs are the fault's (>= end)
    back: float  # >= settled: when the clusters it took out are back in a round (:func:`back_at`)


def hashes_by_step(syncs: list[list[dict]]) -> dict[int, dict[int, str]]:
    """outer step -> {cluster: param_hash} (a cluster's last record of that step)."""
    table: dict[int, dict[int, str]] = {}
    for cluster, records in enumerate(syncs):
        for record in records:
            table.setdefault(record["outer_step"], {})[cluster] = record.get("param_hash")
    return table


def is_good(record: dict, cluster: int, table: dict[int, dict[int, str]]) -> bool:
    others = [h for c, h in table.get(record["outer_step"], {}).items() if c != cluster]
    if not others:
        return bool(record.get("in_sync"))
    return all(h == record.get("param_hash") for h in others)


def windows(faults: list[Fault], syncs: list[list[dict]]) -> list[Window]:
    """The fired faults' spans; a kill or a late join lasts until the cluster's first sync after its launch
    (a restart spends tens of seconds loading before it can take part: its absence is still the fault, and a
    galaxy that waits for a member it was told of is waiting because of it).

    A fault that takes clusters out of the galaxy (a kill, a late join, a cut: the cut-off cluster, or a
    split's side without rank 0) also has a ``back``: when each of them is back in a round (:func:`back_at`).
    A cluster back from a cut first takes the state the galaxy committed without it (twice when the galaxy
    commits again during the download) before its Δ meets the others'; the rounds the others retry waiting
    for it, and its own re-syncs, are the fault's until then (:func:`due_to_fault`). Streaks of syncs out of
    sync still count from ``settled``: being apart longer is no excuse for being apart."""
    spans = []
    for f in faults:
        if not f.fired:
            continue
        settled = back = f.end
        if f.kind in ("kill_restart", "late_join"):
            settled = max(f.end, next((s["time"] for s in syncs[f.cluster] if s["time"] > f.end), f.end))
        if f.kind in TAKES_OUT:
            out = minority_of(f, len(syncs), faults)
            back = max([settled, *(back_at(syncs[c], f.end, len(out)) for c in out)])
        spans.append(Window(f.index, f.start, f.end, settled, back))
    return spans


def back_at(records: list[dict], after: float, side: int = 1) -> float:
    """When a cluster out of the galaxy since ``after`` is back: the time of its first sync after it that
    commits with other clusters (``committed``, peers ≥ 2), at most its ``BACK_LIMIT``-th sync after it (a
    cluster not back by then has a trouble of its own, which counts), not counting the tries in which it saw
    no more than its own side alive (``side`` clusters) within ``RECONNECT_SECONDS``; ``after`` if it never
    syncs again."""
    counted, seen = 0, after
    for record in (r for r in records if r["time"] > after):
        seen = record["time"]
        peers = record.get("galaxy_peers") or 0
        if record.get("committed", not record.get("resynced")) and peers >= 2:
            break
        alive = record.get("galaxy_alive", peers) or 0
        if alive <= side and not record.get("resynced") and record["time"] - after <= RECONNECT_SECONDS:
            continue  # it has not heard the others again yet
        counted += 1
        if counted == BACK_LIMIT:
            break
    return seen


def repair(after: float, records: list[dict], cluster: int, table: dict) -> tuple[int, float] | None:
    """(syncs, seconds) from ``after`` to the cluster's first good sync; None if it never had one."""
    later = [r for r in records if r["time"] > after]
    for i, record in enumerate(later, 1):
        if is_good(record, cluster, table):
            return i, record["time"] - after
    return None


def repairable_from(fault: Fault, faults: list[Fault]) -> float:
    """When ``fault``'s repair can begin: its end, or, while a partition is still on then, the partition's
    end (and so on). Why: a lost average fires on its own clock and can land inside a partition (soak of
    2026-11-28, #14 inside #1); the syncs a cut-off cluster runs alone until the link comes back are the
    partition's, and no protocol repairs anything across a cut link. Other faults overlapping it (a late
    joiner not there yet, a slow cluster) do not move it: the galaxy can repair around them."""
    cuts = [f for f in faults if f.fired and f.kind in CUTS and f.index != fault.index]
    t = fault.end
    while (ongoing := next((c for c in cuts if c.start <= t < c.end), None)) is not None:
        t = ongoing.end
    return t


def fault_figures(faults: list[Fault], syncs: list[list[dict]], table: dict) -> list[dict]:
    """Each fault with its repair: per cluster, the target's, and the galaxy's (the slowest cluster)."""
    out = []
    for f in faults:
        row = f.to_json()
        if f.fired:
            after = repairable_from(f, faults)
            if after > f.end:
                row["repair_from"] = after
            per = {
                c: repair(after, records, c, table)
                for c, records in enumerate(syncs)
                if any(r["time"] > after for r in records)
            }
            row["repair_by_cluster"] = {str(c): (list(r) if r else None) for c, r in per.items()}
            row["repair_target"] = per.get(f.cluster) and list(per[f.cluster])
            healed = [r for r in per.values() if r is not None]
            row["repaired"] = bool(per) and len(healed) == len(per)
            row["repair_syncs"] = max((r[0] for r in healed), default=None) if row["repaired"] else None
            row["repair_seconds"] = max((r[1] for r in healed), default=None) if row["repaired"] else None
            row["syncs_after"] = bool(per)
        out.append(row)
    return out


def due_to_fault(t: float, cluster: int, times: list[float], spans: list[Window], repairs: dict) -> bool:
    """Whether cluster ``cluster``'s sync at ``t`` (``times``: all its syncs' times, sorted) falls in a fault
    (until the clusters it took out are back: :func:`windows`) or among the syncs after it up to the
    cluster's repair (at most ``REPAIR_LIMIT``)."""
    for w in spans:
        if w.start <= t <= w.back:
            return True
        if t > w.settled:
            nth_after = bisect_right(times, t) - bisect_right(times, w.settled)
            if nth_after <= min(repairs.get((w.fault, cluster)) or REPAIR_LIMIT, REPAIR_LIMIT):
                return True
    return False


def galaxy_goodput(clusters: list[dict]) -> float | None:
    """Tokens committed ÷ tokens computed over every cluster that counted them (``None``: none did)."""
    return share((c.get("tokens_computed"), c.get("tokens_committed")) for c in clusters)


def galaxy_token_rates(clusters: list[dict]) -> tuple[float, float] | None:
    """The galaxy's tokens per second over its syncs' span (the first cluster's first sync to the last one's
    last): ``(computed, committed)``. Beside goodput, so that a cluster computing less shows: it lowers the
    first and must not lower the second (issue 50). ``None``: no cluster counted tokens."""
    counted = [c for c in clusters if c.get("tokens_computed") and c.get("first_sync_time") is not None]
    if not counted:
        return None
    span = max(c["last_sync_time"] for c in counted) - min(c["first_sync_time"] for c in counted)
    if span <= 0:
        return None
    computed = sum(c["tokens_computed"] for c in counted)
    return computed / span, sum(c.get("tokens_committed") or 0 for c in counted) / span


def _longest_streak(bad: list[bool], counted: list[bool] | None = None) -> int:
    """The longest run of bad syncs; a bad one not ``counted`` (inside a fault: the fault's doing) neither
    adds to a run nor breaks it, a good one ends it."""
    longest = run = 0
    for is_bad, counts in zip(bad, counted or [True] * len(bad), strict=True):
        if not is_bad:
            run = 0
        elif counts:
            run += 1
            longest = max(longest, run)
    return longest


def cluster_figures(
    cluster: int, records: list[dict], spans: list[Window], repairs: dict, table: dict
) -> dict:
    """Counts and streaks of one cluster's syncs; ``repairs``: (fault, cluster) -> repair in syncs or None.

    A sync is out of sync when its ``param_hash`` differs from another cluster's at the same outer step
    (:func:`is_good`, as repairs count). The cluster's own ``in_sync`` flag compares hashes at the round's
    *start*, so it lags: a cut-off cluster whose alone rounds the galaxy then took keeps it false for a sync
    or two while every cluster holds its θ. Its streaks are reported beside (``in_sync_false``)."""
    times = sorted(r["time"] for r in records)
    good = [is_good(r, cluster, table) for r in records]
    outside = [not any(w.start <= r["time"] <= w.settled for w in spans) for r in records]
    free = [r for r in records if not due_to_fault(r["time"], cluster, times, spans, repairs)]
    resynced_free = sum(bool(r.get("resynced")) for r in free)
    retried_free = sum(bool(r.get("retries")) for r in free)
    sat_out = [r for r in records if r.get("galaxy_peers") == 0]
    bad = [
        r for r in records if r.get("pseudo_grad_finite") is False or r.get("pseudo_grad_in_bound") is False
    ]
    last = records[-1] if records else {}
    return {
        "syncs": len(records),
        "out_of_sync": good.count(False),
        "longest_out_of_sync_run": _longest_streak([not g for g in good]),
        "longest_out_of_sync_run_after_faults": _longest_streak([not g for g in good], outside),
        "in_sync_false": sum(not r.get("in_sync") for r in records),
        "longest_in_sync_false_run_after_faults": _longest_streak(
            [not r.get("in_sync") for r in records], outside
        ),
        "resynced": sum(bool(r.get("resynced")) for r in records),
        "syncs_without_fault": len(free),
        "resynced_without_fault": resynced_free,
        "resynced_share_without_fault": resynced_free / len(free) if free else 0.0,
        "retried_without_fault": retried_free,
        "retried_share_without_fault": retried_free / len(free) if free else 0.0,
        "sat_out": len(sat_out),
        "sat_out_without_fault": sum(
            not due_to_fault(r["time"], cluster, times, spans, repairs) for r in sat_out
        ),
        "sat_out_bad_pseudo_grad": len(bad),
        "retries": sum(r.get("retries") or 0 for r in records),
        "split_syncs": sum(not is_good({**r, "in_sync": True}, cluster, table) for r in records),
        "final_outer_step": last.get("outer_step"),
        "final_step": last.get("step"),
        "final_param_hash": last.get("param_hash"),
        # goodput (outer/goodput.py), as the last record counts it: a killed launch's steps after its last
        # checkpoint are not in tokens_computed
        "tokens_computed": last.get("tokens_computed"),
        "tokens_committed": last.get("tokens_committed"),
        "goodput": last.get("goodput"),
        "first_sync_time": times[0] if times else None,
        "last_sync_time": times[-1] if times else None,
    }
