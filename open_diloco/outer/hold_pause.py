"""A cluster that holds trains nothing until news comes that a commit could come of it.

A cluster holds when those it averaged with are no majority of its chain's roster (``outer/quorum.py``):
it commits nothing, drops the stride and goes back a stride to train it again (``CatchUp.clock_after``). That
stride is thrown away in turn unless the round then commits, which it can only once a majority is back (a cut
healed, a restarted cluster up: and then the galaxy is usually ahead, so the cluster takes its state and drops
the stride anyway) or on a fork after ``--hv.fork-after``. Trained at once, round after round, the strides of
a cut-off cluster were most of the galaxy's waste: in the elastic chaos soak of 2026-12-04, 270 of the 332
inner steps trained and never committed (81 %) were strides trained again while holding (goodput 83.7 %).

So after a held round the cluster waits, its GPUs idle, polling the membership records every
:data:`POLL_SECONDS`, for the first of:

- **the others are there**: clusters heard from within a heartbeat (their record refreshed less than
  ``--hv.heartbeat-interval`` + :data:`PUBLISH_SLACK_SECONDS` ago) or since the pause began make, with this
  one, a quorum of the roster (``has_quorum``; an elastic galaxy's first round: ``--hv.galaxy-size``
  clusters). Clusters it still averages with refresh too, so a side of an even split without the lowest rank
  waits on: its pair is no majority. Within a heartbeat, not only since the pause: four connected clusters,
  each alone in a round by a matchmaking miss, all held; paused until the next refresh, they woke up to 5 s
  apart, missed each other's matchmaking and held again, for 107 s (``lan`` soak, seed 5, 2026-12-05). Fresh
  records mean the others are there: no pause, and they retry in step as before. A cut cluster's first held
  round comes after the round's retries, ~10 s into the cut, when the others' records are that old already;
- **the galaxy is ahead**: a live cluster's chain holds more committed work (its next round sits out and takes
  that state, ``Round.start``);
- **the others ended their run**: it is a quorum alone (those that ended vote no more);
- **the fork is due**: the hold has lasted ``--hv.fork-after``; the stride trains and its round commits on a
  fork (``Round._fork_due``).

Nothing to learn from (no record read: the DHT did not answer in time, or the in-process galaxy of unit tests)
is no pause. Every rank of the cluster polls; news on any rank wakes them all (the same collectives on every
rank). A stop signal ends the wait as any other. The pause is the trainer's idle time: ``compute_utilization``
and tokens per second say so, and goodput is not bought by computing less: what the cluster does not train
could not be committed. The price: a hold that ends with news ends up to a poll and a heartbeat
(``--hv.heartbeat-interval``) later than it would have, training on."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from open_diloco.outer.protocols import Membership
from open_diloco.outer.quorum import has_quorum, roster_of

if TYPE_CHECKING:
    from open_diloco.outer.round import RoundContext

POLL_SECONDS = 1.0
"""How often a holding cluster reads the membership records for news."""
PUBLISH_SLACK_SECONDS = 3.0
"""How late a refreshed record may become readable (``galaxy/record_ages.PUBLISH_DELAY_SECONDS``): a live
cluster's record is never older than a heartbeat plus this."""


def news(
    view: Membership,
    paused_for: float,
    own: tuple[int, int],
    galaxy_rank: int,
    need: int | frozenset[int],
    fresh_within: float = 8.0,
) -> str | None:
    """Why a holding cluster should train again, by one membership read ``paused_for`` seconds into its
    pause; ``None``: no news. ``own``: its chain's (committed work, outer step); ``need``: the roster whose
    quorum a round needs, or (an elastic galaxy's first round) how many clusters; ``fresh_within``: a record
    younger than this is a cluster that is there."""
    if (view.lead_work, view.lead) > own:
        return f"the galaxy is ahead (outer step {view.lead})"
    ended = {rank for rank in view.departed - view.silent if rank in view.reported}
    heard = max(paused_for, fresh_within)
    back = {rank for rank, age in view.ages.items() if age < heard} - ended - {galaxy_rank}
    present = back | {galaxy_rank}
    if not (len(present) >= need if isinstance(need, int) else has_quorum(present, need, ended)):
        return None
    return f"clusters {sorted(back)} are there" if back else f"the others ended their run ({sorted(ended)})"


def pause_while_held(ctx: RoundContext) -> None:
    """Wait for :func:`news` (see the module docstring), at most until the fork is due."""
    hv, began = ctx.hv, time.monotonic()
    fork_at = (ctx.holding_since or began) + hv.fork_after
    last = ctx.committed.ledger.last
    roster = roster_of(last, hv.galaxy_size, hv.elastic)
    need: int | frozenset[int] = hv.galaxy_size if hv.elastic and not roster else roster
    fresh_within = hv.heartbeat_interval + PUBLISH_SLACK_SECONDS
    while ctx.cluster.all_true(time.monotonic() < fork_at):
        view = ctx.averager.membership()
        own = (ctx.committed.work, ctx.state.outer_step)
        why = news(view, time.monotonic() - began, own, ctx.galaxy_rank, need, fresh_within)
        if not ctx.cluster.all_true(why is None and bool(view.ages)):  # (no record read: nothing to learn)
            break
        time.sleep(POLL_SECONDS)
