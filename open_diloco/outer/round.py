"""One round of one cluster, as one object: :class:`Round`, identified by :class:`RoundId` (the outer step it
produces, and the attempt), from its start to what it came to (a :class:`RoundResult`).

Its states (:class:`Phase`), in the order a round goes through them::

    start ─► started ─► averaged ─► decided ─► committed  apply the average (alone: its own Δ)
      │                                    ├─► taken      from a committer: adopted, or re-synced
      │                                    ├─► retried    attempt a + 1 of the same round (a new Round)
      │                                    └─► held       no quorum: nothing committed, the stride dropped
      └─► sitting out ─► sat out, or taken (re-synced)    nothing sent: diverged, out of bound, behind

*Matched* is inside the averager: its report names the group the round matched and the average it got.

**The commit rule.** A cluster *commits* a round (applies the average its reducers sent) only when every
shard's average arrived whole and every shard's group held the same clusters: then every cluster that commits
holds the reducers' exact bytes, by construction. Otherwise it never applies its own partial values; it takes
the round from a cluster that committed it (with its own Δ in it: *adopted*, nothing lost), or runs it again
under the next attempt. Why: with one average lost on one shard, "apply what arrived" left one cluster a model
no other cluster held, and the repairs after the fact (re-syncs a round later) cascaded on lossy links.

**The quorum.** A commit also needs a majority of the roster the cluster's chain names (``outer/quorum.py``):
a side of a partition without one holds, and takes the majority's state once it is back; after
``--hv.fork-after`` seconds of holding it commits on a fork.

Every branch runs the same collectives on every rank of the cluster (:class:`ClusterComm`), so every shard
follows the same path. ``docs/round-protocol.md`` tells the whole story.
"""

from __future__ import annotations

import contextlib
import enum
import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from open_diloco.errors import GalaxyError, GalaxyMismatch, RoundFailed
from open_diloco.outer.codecs import all_finite, codec_label
from open_diloco.outer.digests import combine_hashes
from open_diloco.outer.guard import valid_claim, valid_weight, wire_norm
from open_diloco.outer.policy import Decision, RoundOutcome
from open_diloco.outer.protocols import MEMBERSHIP_READ_SECONDS, AloneRound, PendingRound, RoundReport
from open_diloco.outer.quorum import has_quorum, roster_of, smallest_group
from open_diloco.outer.round_result import RoundResult

if TYPE_CHECKING:
    from open_diloco.config import HvConfig
    from open_diloco.outer.adoption import StateAdoption
    from open_diloco.outer.catching_up import CatchUp
    from open_diloco.outer.cluster import ClusterComm
    from open_diloco.outer.committed_state import CommittedState
    from open_diloco.outer.guard import NormHistory
    from open_diloco.outer.policy import RoundPolicy
    from open_diloco.outer.protocols import Averager, StatusBoard
    from open_diloco.outer.state import OuterState


@dataclass(frozen=True)
class RoundId:
    """Which round: the outer step it produces (``number``) and the attempt (0 first). Attempts of a round
    meet in different matchmaking groups; every attempt carries the same Δ."""

    number: int
    attempt: int = 0

    def __str__(self) -> str:
        return f"round {self.number} attempt {self.attempt}"


class Phase(enum.Enum):
    STARTED = "started"
    """Δ sent, the galaxy's average in flight."""
    SITTING_OUT = "sitting out"
    """Nothing sent: Δ not finite, out of bound, or the galaxy already past this round."""
    AVERAGED = "averaged"
    """The averager's report is in (a group matched and averaged, or it failed), and the ranks agree on it."""
    DECIDED = "decided"
    """Commit, take, or retry: chosen."""
    COMMITTED = "committed"
    TAKEN = "taken"
    RETRIED = "retried"
    SAT_OUT = "sat out"
    HELD = "held"
    """No quorum: nothing committed, the stride dropped (``outer/quorum.py``)."""


MOVES = {
    Phase.STARTED: {Phase.AVERAGED},
    Phase.SITTING_OUT: {Phase.SAT_OUT, Phase.TAKEN},
    Phase.AVERAGED: {Phase.DECIDED},
    Phase.DECIDED: {Phase.COMMITTED, Phase.TAKEN, Phase.RETRIED, Phase.HELD},
    # nobody served the state in time: its own Δ alone, with a quorum (else held)
    Phase.TAKEN: {Phase.COMMITTED, Phase.HELD},
}
"""The moves a round may make; the ends (committed, taken, retried, sat out, held) have none but the one
above."""


HOLD_REMINDER_SECONDS = 30.0
"""While a cluster holds round after round with nothing new to say, it says so again this often. Why: a
cut-off cluster holds at every stride (the soak's half-second strides wrote one line per rank each, half of
its log), and a line per stride says no more than one per half-minute and a last one when the hold ends."""


class Next(enum.Enum):
    COMMIT = "commit"
    TAKE = "take"
    RETRY = "retry"


@dataclass(frozen=True)
class Verdict:
    """What the cluster does with an averaged round (:meth:`Round.decide`)."""

    next: Next
    clusters: int = 0
    """Clusters whose Δ is whole in the average (less the rejected and the stale)."""
    alive: int = 0
    """The live clusters the round should have had (less the rejected and the stale)."""
    appear_within: float | None = None
    """``take``: give up when no record shows a committer after this long (nobody may have committed)."""


@dataclass
class Contribution:
    """What this cluster puts into the round besides its Δ: the weight of its Δ in the average and the inner
    steps behind it (``--hv.round-steps by-speed``), the same at every attempt."""

    weight: float = 1.0
    inner_steps: int | None = None
    carries: dict[str, list[int]] | None = None
    """An elastic galaxy: per stride the Δ covers, the range of this cluster's hand it carries
    (``outer/own_pages.py``); the members' entry settles the deal by it (``outer/deal.py``)."""


@dataclass
class RoundContext:
    """What every round of one cluster works with, for the whole run (built once by ``DiLoCo``), and the few
    things that outlive a round."""

    hv: HvConfig
    committed: CommittedState
    averager: Averager
    cluster: ClusterComm
    status: StatusBoard
    policy: RoundPolicy
    norm_history: NormHistory
    adoption: StateAdoption
    catch_up: CatchUp
    galaxy_rank: int
    warn: Any
    alive_before: int
    """Live clusters at the last commit, to say when it changes."""
    bad_rounds: int = 0
    """Rounds in a row this cluster sat out with a bad pseudo-gradient (not finite, or out of bound)."""
    fastest_seconds: float | None = None
    """The least seconds per inner step a live cluster published, as the last round's start read it."""
    holding_since: float | None = None
    """When this cluster began to hold (no quorum), on this rank's clock; ``None`` while it commits."""
    held_rounds: int = 0
    """Rounds held since ``holding_since``."""
    hold_said: tuple[float, tuple] | None = None
    """When this cluster last said it holds, and what it said (:data:`HOLD_REMINDER_SECONDS`)."""
    tokens_per_step: int = 1
    """Tokens of one inner step of this cluster (``--total-batch-size`` × ``--seq-length``): what a round's
    ledger entry counts as committed work (1 in in-process tests: work counts steps)."""

    @property
    def state(self) -> OuterState:
        return self.committed.state


@dataclass(frozen=True)
class RoundView:
    """One round as every shard of the cluster saw it, the same on every rank (:meth:`agree`)."""

    whole: bool
    """Every shard's average arrived whole (no failed reducer, no lost part, a result at all)."""
    same_group: bool
    """Every shard's group held the same clusters."""
    group: frozenset[int]
    """The clusters of rank 0's shard's group (this one included)."""
    overtaken: bool
    """Some shard saw, while it looked for a group, that the galaxy already applied this round without it."""
    rejected: list[int]
    """Clusters some reducer left out as garbage (guard)."""
    stale: list[int]
    """Clusters some reducer left out for starting from another θ_outer than the round's most advanced
    peer."""
    in_sync: bool
    """Every shard's peers (less the stale ones) started from this cluster's θ_outer."""
    left_out: bool
    """Some shard's reducers left this very cluster out as stale: it must take the round's reference peer's
    state (retrying cannot help: its next Δ would come from the same θ_outer)."""
    shard_groups: tuple[str, ...] = ()
    """Each shard's group (its clusters, comma-separated), in rank order: what a warning names."""
    overtaken_shards: tuple[int, ...] = ()
    """The local ranks whose shard was overtaken while it looked for a group."""
    gone: frozenset[int] = frozenset()
    """Clusters outside the group that some member (any shard, any rank) calls gone in its metadata: the
    round's one view of who is not coming, the same for every member of a committable round."""
    known: frozenset[int] = frozenset()
    """An elastic galaxy's clusters as any member knows them (their metadata's ``known``); empty in a fixed
    galaxy."""

    @property
    def committable(self) -> bool:
        return self.whole and self.same_group

    @staticmethod
    def agree(
        cluster: ClusterComm, report: RoundReport, failed: bool, own_hash: str, galaxy_rank: int
    ) -> RoundView:
        """Gather what each shard's report says into one view (a fixed sequence of collectives on every
        rank)."""
        groups = cluster.gather_strings(",".join(map(str, sorted(report.peers))))
        rejected = _ranks_by_any_rank(cluster, report.rejected)
        stale = _ranks_by_any_rank(cluster, report.stale)
        left_out = galaxy_rank in stale
        in_sync = cluster.all_true(
            not left_out
            and all(
                meta.get("param_hash") == own_hash
                for rank, meta in report.peers.items()
                if rank not in stale or rank == galaxy_rank
            )
        )
        overtaken = cluster.gather_strings("1" if report.overtaken else "")
        called_gone = sorted({int(rank) for meta in report.peers.values() for rank in meta.get("gone") or ()})
        gone = _ranks_by_any_rank(cluster, called_gone)
        said_known = sorted({int(rank) for meta in report.peers.values() for rank in meta.get("known") or ()})
        known = _ranks_by_any_rank(cluster, said_known)
        group = frozenset(int(rank) for rank in groups[0].split(",") if rank)
        return RoundView(
            whole=cluster.all_true(report.complete and not failed),
            same_group=len(set(groups)) == 1,
            group=group,
            overtaken=any(overtaken),  # any shard: a cluster never half-adopts
            rejected=rejected,
            stale=stale,
            in_sync=in_sync,
            left_out=left_out,
            shard_groups=tuple(groups),
            overtaken_shards=tuple(rank for rank, flag in enumerate(overtaken) if flag),
            gone=frozenset(gone) - group,
            known=frozenset(known),
        )


def _groups(view: RoundView) -> str:
    """Each shard's group, for a warning: ``shard 0: [0, 1, 2]; shard 1: [0, 1]``."""
    shards = enumerate(view.shard_groups)
    return "; ".join(f"shard {shard}: [{group.replace(',', ', ')}]" for shard, group in shards)


def _ranks_by_any_rank(cluster: ClusterComm, ranks: list[int]) -> list[int]:
    """Galaxy ranks some shard's report names, the same list on every rank of the cluster."""
    gathered = cluster.gather_strings(",".join(map(str, ranks)))
    return sorted({int(rank) for ranks in gathered for rank in ranks.split(",") if rank})


@dataclass
class Round:
    """One attempt of one round of this cluster (see the module docstring). :meth:`start` makes it;
    :meth:`finish` (or :meth:`sit_out`, when it sits out) ends it in a :class:`RoundResult`."""

    ctx: RoundContext = field(repr=False)
    id: RoundId
    contribution: Contribution
    own_hash: str
    """Hash of this shard's θ_outer when the round started."""
    alive: int
    """Clusters alive when the round started (membership), this one included; agreed by the ranks."""
    phase: Phase = Phase.STARTED
    pending: PendingRound | None = None
    """The all-reduce in flight; ``None`` when nothing was sent or it could not even start."""
    local_sq: float = math.nan
    """‖Δ‖² of this shard before averaging (for the ``pseudo_grad_norm`` metric)."""
    start_error: str | None = None
    diverged: bool = False
    """Δ is not finite on some rank of this cluster: nothing was sent."""
    bound: float | None = None
    """The largest ‖Δ‖ this shard could send this round (``guard.NormHistory``); ``None``: the check is
    off."""
    out_of_bound: bool = False
    """Δ is finite but out of bound on some rank of this cluster: nothing was sent."""
    lead: int = -1
    """The outer step of the live cluster whose chain holds the most committed work, by the membership records
    (agreed by the ranks); ahead of this cluster's, its Δ would come from a θ_outer the galaxy left behind:
    nothing is sent."""
    silent: int = 0
    """Other clusters gone silent (not ended) when the round started (membership), the most any rank saw."""
    ended: frozenset[int] = frozenset()
    """Clusters whose records say they ended their run (any rank saw it): they vote in no quorum."""
    gone: frozenset[int] = frozenset()
    """Clusters this rank's membership read calls gone (ended, or silent): the round's live count."""
    left: frozenset[int] = frozenset()
    """Of those, the clusters that left for good as this rank reads them (said they ended, have no record at
    all, or silent past ``--hv.fork-after``): the roster drops them (``outer/quorum.py``)."""
    started_after: int = 0
    """The inner step the round (a sync) started after: its Δ holds the training up to it (``sync_step``)."""
    lands_at: int = 0
    """The inner step after which the round's update lands (its start + ``--hv.sync-delay``)."""
    known: frozenset[int] = frozenset()
    """An elastic galaxy's clusters as this rank knows them (its chain's roster, every cluster with a
    record, this one): what a member tells the round, whose live count is theirs less the gone. Empty in a
    fixed galaxy (its clusters are the ranks of ``--hv.galaxy-size``)."""
    history: list[Phase] = field(default_factory=list)
    """The phases it went through, oldest first (the current one last)."""

    @property
    def sits_out(self) -> bool:
        return self.pending is None and self.start_error is None

    def _enter(self, phase: Phase) -> None:
        if phase not in MOVES.get(self.phase, set()):
            raise RuntimeError(f"{self.id}: no move from {self.phase.value} to {phase.value}")
        self.history.append(self.phase)
        self.phase = phase

    # -- start ----------------------------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def start(cls, ctx: RoundContext, contribution: Contribution, attempt: int = 0) -> Round:
        """Δ = θ_outer − θ_local into the averager's buffer, then launch the galaxy average of it. Every rank
        runs the same collectives whatever happens on it."""
        state = ctx.state
        own_hash = state.hash()
        seen = _membership(ctx)
        alive, (lead, lead_work), (ended, unheard) = seen.alive, seen.lead, seen.ended_unheard
        attempt = max(attempt, seen.attempt)  # join the galaxy's current attempt, not one nobody is in
        ctx.status.update({"round_attempt": [state.outer_step + 1, attempt]})
        made = cls(
            ctx, RoundId(state.outer_step + 1, attempt), contribution, own_hash, alive, silent=seen.silent
        )
        # a cluster without a record votes no more only before any entry named a roster (it never started);
        # one the chain's roster names was a member: unreadable is not ended (a side of a split that read no
        # record of the others committed alone, as if they had all ended: chaos soak, 2026-12-02 evening)
        genesis = (last := ctx.committed.ledger.last) is None or last.roster is None
        made.ended, made.gone, made.left = ended | unheard if genesis else ended, seen.gone, seen.left
        made.known = seen.known
        # the galaxy committed more than this cluster's chain holds (a late joiner, a side of a cut, a lighter
        # fork): its Δ comes from a θ_outer the galaxy left behind
        if (lead_work, lead) > (ctx.committed.work, state.outer_step):
            made.lead, made.phase = lead, Phase.SITTING_OUT
            return made
        with contextlib.ExitStack() as held:
            pseudo_grad = _locked_buffer(ctx, held)
            if pseudo_grad is None:
                made.start_error = "the averager is still busy with a previous round"
                return made
            made.local_sq = state.pseudo_grad_for_wire_into(pseudo_grad)
            finite = math.isfinite(made.local_sq)
            # the claim the reducers hold our parts to: the norm of exactly what is sent (guard.py)
            claim = (
                math.sqrt(made.local_sq) if state.compressor is None or not finite else wire_norm(pseudo_grad)
            )
        if not ctx.cluster.all_true(finite):  # never sent: it would poison every cluster
            made.diverged, made.lead, made.phase = True, lead, Phase.SITTING_OUT
            return made
        theta_norm = math.sqrt(state.sq_norm())
        made.bound = ctx.norm_history.bound(theta_norm, contribution.weight)
        if not ctx.cluster.all_true(made.bound is None or claim <= made.bound):  # blown up: not sent
            made.out_of_bound, made.lead, made.phase = True, lead, Phase.SITTING_OUT
            return made
        fingerprint = {
            "param_hash": own_hash,
            "numel": state.numel,
            "delta_norm": claim,
            "theta_norm": theta_norm,
            "committed_by": len(state.committed_group),
            **made.own_metadata(),
        }
        try:
            if alive == 1 and not ctx.hv.alone:  # everyone else is gone: waiting could only time out
                meta = {**fingerprint, "galaxy_rank": ctx.galaxy_rank, "round_id": state.outer_step}
                made.pending = AloneRound(ctx.galaxy_rank, meta)
            else:
                plan = ctx.averager.matchmaking_plan(alive, bool(seen.behind))
                plan = replace(plan, min_group=smallest_group(made.roster, made.ended, alive))
                plan = plan.agreed(ctx.cluster.min_int)
                made.pending = ctx.averager.start_round(state.outer_step, fingerprint, attempt, plan=plan)
        except RoundFailed as err:  # fails on this rank: its wait reports it, at the same collectives
            made.start_error = str(err)
        return made

    def own_metadata(self) -> dict[str, Any]:
        """What this cluster says of itself in the round's metadata, for the members' ledger entries."""
        hv = self.ctx.hv
        return {
            "weight": self.contribution.weight,
            "inner_steps": self.contribution.inner_steps,
            "codec": codec_label(hv.compression, hv.sparse_density, hv.sparse_rule),
            "outer_optimizer": (
                f"sgd lr={hv.outer_lr:g} momentum={hv.outer_momentum:g} nesterov={hv.outer_nesterov} "
                f"warmup_rounds={hv.outer_warmup_rounds}"
            ),
            "roster": sorted(self.roster),
            "known": sorted(self.known),
            "gone": sorted(self.gone),
            "left": sorted(self.left),
            "tokens": self.tokens,
            "work": self.ctx.committed.work,
            **({"carries": self.contribution.carries} if self.contribution.carries is not None else {}),
        }

    @property
    def tokens(self) -> int:
        """The tokens this cluster's Δ puts into θ_outer if the round commits: its inner steps' tokens, over
        the fragments (a fragment's round carries that share of the model)."""
        hv, steps = self.ctx.hv, self.contribution.inner_steps
        return (hv.local_steps if steps is None else steps) * self.ctx.tokens_per_step // hv.fragments

    @property
    def roster(self) -> frozenset[int]:
        """The clusters whose majority this round needs: what this cluster's chain names."""
        return roster_of(self.ctx.committed.ledger.last, self.ctx.hv.galaxy_size, self.ctx.hv.elastic)

    # -- finish: wait, agree, decide ------------------------------------------------------------------------
    @torch.no_grad()
    def finish(self) -> RoundResult:
        """Wait for the round and end it as :meth:`decide` says: commit it, take it from a cluster that did,
        or run it again under the next attempt (a new :class:`Round`, whose end is this one's)."""
        self.ctx.bad_rounds = 0
        current, network_wait = self, 0.0
        while True:
            waited = time.perf_counter()
            report, failed = current._wait()
            network_wait += time.perf_counter() - waited
            view = current._averaged(report, failed)
            verdict = current.decide(view)
            if verdict.next is Next.TAKE:
                return current._take(view, report, network_wait, verdict.appear_within)
            if verdict.next is Next.COMMIT:
                return current._commit(view, report, network_wait, verdict.clusters, verdict.alive)
            current = current._retry(view, verdict.clusters)
            if current.sits_out:
                if current.diverged or current.out_of_bound:
                    return current.sit_out()
                # the galaxy is ahead: it committed this round after our check (its record a read behind).
                # Take it, as a commit when our Δ is in it, rather than re-sync
                return current._take(view, report, network_wait)

    def _wait(self) -> tuple[RoundReport, bool]:
        """The round's report, or a group of one (``failed``) when it produced no result."""
        error = self.start_error
        if self.pending is not None:
            try:
                return self.pending.wait(), False
            except RoundFailed as err:
                error = str(err)
        self.ctx.warn(f"outer step {self.id.number}: all-reduce failed ({error})")
        return RoundReport(group_size=1, complete=False), True

    def _averaged(self, report: RoundReport, failed: bool) -> RoundView:
        ctx = self.ctx
        for rank, meta in report.peers.items():
            if rank != ctx.galaxy_rank and meta.get("numel") not in (None, ctx.state.numel):
                raise GalaxyMismatch(
                    f"cluster {rank} averages a shard of {meta['numel']} values, this one "
                    f"{ctx.state.numel}: every cluster must train the same model config with the same "
                    "number of ranks"
                )
        self._enter(Phase.AVERAGED)
        return RoundView.agree(ctx.cluster, report, failed, self.own_hash, ctx.galaxy_rank)

    def decide(self, view: RoundView) -> Verdict:
        """Commit when every shard got the average whole from the same clusters and the policy is content
        (``--hv.on-partial-round``); take the round when the galaxy applied it without this cluster, left
        this cluster out, or committed it elsewhere while ours is not whole; else retry, up to
        ``--hv.max-retries``; out of attempts with nothing whole (or whole but alone), take it from a
        committer whose record shows up soon, and commit our own Δ alone only when none does."""
        ctx, number = self.ctx, self.id.number
        self._enter(Phase.DECIDED)
        if view.overtaken:
            ctx.warn(
                f"outer step {number}: the galaxy applied this round without this cluster while it "
                "looked for a group: it takes the galaxy's state rather than wait for the next round "
                f"(overtaken: shard(s) {list(view.overtaken_shards)}; {_groups(view)})"
            )
            return Verdict(Next.TAKE)
        if view.left_out:
            ctx.warn(
                f"outer step {number}: this cluster started the round from another θ_outer than the "
                "galaxy's most advanced cluster: its Δ was left out, it takes that cluster's state"
            )
            return Verdict(Next.TAKE)
        clusters = len(view.group) - len(view.rejected) - len(view.stale)
        alive = self.alive_by(view) - len(view.rejected) - len(view.stale)  # garbage is no use waiting for
        retry_partial = ctx.policy.on_partial_round == "retry"
        # whoever committed it has our Δ if we were in its group
        if (not view.committable or (clusters < alive and retry_partial)) and self._committed_elsewhere():
            return Verdict(Next.TAKE)
        decision = (
            Decision.RETRY
            if not view.committable
            else ctx.policy.decide(RoundOutcome(clusters=clusters, alive=alive, attempts=self.id.attempt))
        )
        if decision is Decision.RETRY and self.id.attempt < ctx.hv.max_retries:
            return Verdict(Next.RETRY, clusters, alive)
        if decision is Decision.STOP:
            raise GalaxyError(
                f"outer step {number}: only {clusters} of {self.alive} live clusters averaged and "
                "--hv.on-partial-round is `fail`: stopping (use `retry` or `proceed` to tolerate missing "
                "clusters)"
            )
        if clusters <= 1 and not ctx.hv.alone and self._committed_elsewhere():
            # alone because the others finished their run meanwhile (a finished cluster is gone from the
            # rounds but serves its last state): the round they committed is the galaxy's, not our Δ alone
            return Verdict(Next.TAKE)
        if not view.committable or (clusters <= 1 < alive and retry_partial):
            # the others are likely committing this round right now, their records a heartbeat behind. Seen
            # in the soak: applying alone at once split the galaxy's last round.
            return Verdict(Next.TAKE, appear_within=ctx.hv.heartbeat_interval + 2 * MEMBERSHIP_READ_SECONDS)
        return Verdict(Next.COMMIT, clusters, alive)

    def alive_by(self, view: RoundView) -> int:
        """The live clusters a committable round should have had, as its members agree: the galaxy less the
        clusters outside the group that any member calls gone. Every member reads the same gathered metadata,
        so all commit or all retry. Why: each cluster's own count split rounds after a heal (chaos soak,
        2026-12-02, `home`): a member one read behind still counted a cluster back from a cut as gone, found
        its group whole and committed, while the others retried a "partial" round, then took its round (17 s
        of download) and came late to the next one. Not committable: this cluster's own count (nothing is
        applied from such a round either way)."""
        if not view.committable:
            return self.alive
        if self.ctx.hv.elastic:  # the clusters any member knows (the same view in every member)
            return max(len(view.known | view.group) - len(view.gone), self._genesis_need())
        return self.ctx.hv.galaxy_size - len(view.gone)

    def _genesis_need(self) -> int:
        """The clusters an elastic galaxy's first round needs (``--hv.galaxy-size``); 0 with a roster."""
        return self.ctx.hv.galaxy_size if self.ctx.hv.elastic and not self.roster else 0

    def _quorum(self, voting: set[int]) -> bool:
        """Whether ``voting`` may commit (``outer/quorum.py``); an elastic galaxy's first round: when it holds
        the clusters the first round needs."""
        if need := self._genesis_need():
            return len(voting) >= need
        return has_quorum(voting, self.roster, self.ended)

    def _committed_elsewhere(self) -> bool:
        """A live cluster's record shows this round applied on a chain with at least this cluster's committed
        work (agreed by the ranks): it is the round's state now. A lighter fork past this round is not."""
        ctx, view = self.ctx, self.ctx.averager.membership()
        steps = [
            step
            for rank, step in view.steps.items()
            if rank != ctx.galaxy_rank and view.works.get(rank, 0) >= ctx.committed.work
        ]
        return -ctx.cluster.min_int(-max(steps, default=-1)) >= self.id.number  # (ours: an older life's?)

    def _retry(self, view: RoundView, clusters: int) -> Round:
        """This attempt ends retried; the next one starts, with the same Δ."""
        ctx, number = self.ctx, self.id.number
        what = (
            f"partial round ({clusters} of {self.alive_by(view)} live clusters)"
            if view.committable
            else "an average did not arrive whole on every shard"
            if not view.whole
            else f"its shards met different groups ({_groups(view)})"
        )
        ctx.warn(
            f"outer step {number}: {what}: nothing applied; "
            f"attempt {self.id.attempt + 1}/{ctx.hv.max_retries}"
        )
        self._enter(Phase.RETRIED)
        return Round.start(ctx, self.contribution, self.id.attempt + 1)

    # -- the ends -------------------------------------------------------------------------------------------
    def _commit(
        self,
        view: RoundView,
        report: RoundReport,
        network_wait: float,
        clusters: int,
        alive: int,
        alone: str | None = None,
    ) -> RoundResult:
        """Apply the round: the galaxy's average, or with ``alone`` (why) this cluster's own Δ alone, which
        keeps its progress and which the next round's hash check repairs; then land it in the model and record
        its ledger entry."""
        ctx, state, number = self.ctx, self.ctx.state, self.id.number
        galaxy_average = alone is None
        voting = view.group - set(view.rejected) - set(view.stale) if galaxy_average else {ctx.galaxy_rank}
        fork = not self._quorum(voting)
        if fork and not self._fork_due():
            return self._hold(view, report, network_wait, voting)
        self._enter(Phase.COMMITTED)
        self._say_who_was_left_out(view)
        if galaxy_average:
            self._record_claims(report, view)
        self._note_alive()
        self._say_what_is_applied(clusters, alive, alone)
        before = ctx.committed.cluster_hash(self.own_hash)
        with contextlib.ExitStack() as held:
            averaged = _locked_buffer(ctx, held)
            if averaged is None:
                raise GalaxyError(
                    f"outer step {number}: the averager is still busy with a previous round past "
                    "--hv.averaging-timeout; stopping (resume from the last checkpoint)"
                )
            finite = ctx.cluster.all_true(not galaxy_average or all_finite(averaged))
            if not finite:
                ctx.warn(
                    f"outer step {number}: the galaxy's average is not finite (a peer sent or reduced "
                    "garbage): it is not applied, this cluster takes its own pseudo-gradient this round"
                )
            if not (galaxy_average and finite):  # our own Δ again, never a partial or poisoned average
                state.pseudo_grad_for_wire_into(averaged)
            held.enter_context(ctx.committed.changing())
            state.apply(averaged)
            members = voting if finite else {ctx.galaxy_rank}
            state.committed_group = sorted(members)
            fragment = state.fragment
            state.land()
            peers = {**report.peers, ctx.galaxy_rank: self.own_metadata()}
            entry = ctx.committed.record_commit(
                self.id.attempt,
                fragment,
                before,
                peers,
                members,
                not (galaxy_average and finite),
                fork,
                known=view.known | members,
            )
        in_sync = (
            view.in_sync
            and galaxy_average
            and not view.stale
            and clusters >= alive
            and not (clusters == 1 and self.silent)
        )
        return self._result(
            "applied",
            report,
            network_wait,
            in_sync=in_sync,
            average_finite=finite,
            galaxy_complete=view.whole,
            rejected_peers=view.rejected,
            fragment=fragment,
            ledger=entry,
            param_hash=entry.after,  # θ_outer's hash, gathered for the entry a moment ago
        )

    def _fork_due(self) -> bool:
        """Whether this cluster has held for ``--hv.fork-after`` seconds (every rank agrees): it commits on a
        fork rather than hold on (the majority may be gone for good)."""
        ctx = self.ctx
        since = ctx.holding_since
        held = 0.0 if since is None else time.monotonic() - since
        if not ctx.cluster.all_true(held >= ctx.hv.fork_after):  # 0: never hold (every side commits)
            return False
        if since is not None:
            need, roster = self._genesis_need(), sorted(self.roster)
            why = f"the first round's {need} clusters" if need else f"no majority of the roster {roster}"
            ctx.warn(
                f"outer step {self.id.number}: {why} for --hv.fork-after={ctx.hv.fork_after:g}s: this "
                "cluster commits on a fork of the ledger"
            )
        return True

    def _hold(
        self, view: RoundView, report: RoundReport, network_wait: float, voting: set[int]
    ) -> RoundResult:
        """Commit nothing: no quorum (``outer/quorum.py``). θ_outer and the chain stay, so once the partition
        heals this cluster is behind the majority and takes its state. θ_local goes back to θ_outer, every
        fragment of it (:meth:`OuterState.drop_progress`): its progress is dropped, as it would be at the heal
        anyway; kept, the next Δ would grow with every held round until the guard called it out of bound and
        the cluster diverged. The trainer then waits for news of the others (``outer/hold_pause.py``) and
        trains the stride again (``CatchUp.clock_after``)."""
        ctx, roster, now = self.ctx, self.roster, time.monotonic()
        self._enter(Phase.HELD)
        if ctx.holding_since is None:
            ctx.holding_since, ctx.held_rounds, ctx.hold_said = now, 0, None
        ctx.held_rounds += 1
        present = sorted(voting & (roster - self.ended))
        said = (tuple(present), tuple(sorted(roster)), tuple(sorted(self.ended)))
        last = ctx.hold_said
        if last is None or last[1] != said or now - last[0] >= HOLD_REMINDER_SECONDS:
            ctx.hold_said = (now, said)
            held = f"held {ctx.held_rounds} round(s) in {now - ctx.holding_since:.0f}s"
            if need := self._genesis_need():
                ctx.warn(
                    f"outer step {self.id.number}: the galaxy's first round needs {need} clusters "
                    f"(--hv.galaxy-size), {sorted(voting)} came: this cluster commits nothing and trains "
                    f"the stride again once more come (a fork after --hv.fork-after={ctx.hv.fork_after:g}s; "
                    f"{held})"
                )
            else:
                ended = f" (ended: {sorted(self.ended)})" if self.ended else ""
                ctx.warn(
                    f"outer step {self.id.number}: clusters {present} are no majority of the roster "
                    f"{sorted(roster)}{ended}: this cluster commits nothing, trains the stride again once "
                    "others are back, and takes the majority's state then (a fork after "
                    f"--hv.fork-after={ctx.hv.fork_after:g}s; {held})"
                )
        ctx.state.drop_progress()
        return self._result("held", report, network_wait, galaxy_complete=view.whole)

    def _say_what_is_applied(self, clusters: int, alive: int, alone: str | None) -> None:
        """A warning when the round commits without every live cluster, or this cluster's Δ alone."""
        number = self.id.number
        if alone is not None:
            self.ctx.warn(
                f"outer step {number}: {alone}: this cluster applies its own pseudo-gradient alone (the "
                "next round's hash check re-syncs it)"
            )
        elif clusters < alive:
            retried = f" after {self.id.attempt} retries" if self.id.attempt else ""
            self.ctx.warn(
                f"outer step {number}: proceeding with {clusters} of {alive} live clusters{retried}"
            )

    def _say_who_was_left_out(self, view: RoundView) -> None:
        ctx, number = self.ctx, self.id.number
        if view.rejected:
            ctx.warn(
                f"outer step {number}: left cluster(s) {view.rejected} out of the average: their "
                "pseudo-gradient was not finite, larger than they claimed, or above "
                f"--hv.delta-norm-bound={ctx.hv.delta_norm_bound} times ours"
            )
        if view.stale:
            ctx.warn(
                f"outer step {number}: left cluster(s) {view.stale} out of the average: they started this "
                "round from another θ_outer; they take the galaxy's state"
            )

    def _note_alive(self) -> None:
        ctx = self.ctx
        if self.alive != ctx.alive_before:
            ctx.warn(
                f"outer step {self.id.number}: {self.alive} of {ctx.hv.galaxy_size} clusters alive (were "
                f"{ctx.alive_before}): rounds now wait for these"
            )
            ctx.alive_before = self.alive

    def _record_claims(self, report: RoundReport, view: RoundView) -> None:
        """The averaged clusters' claimed ‖Δ‖ per unit of weight into the guard's history (its bound)."""
        self.ctx.norm_history.record(
            claim / (valid_weight(meta.get("weight")) or 1.0)
            for rank, meta in report.peers.items()
            if rank not in view.rejected
            and rank not in view.stale
            and (claim := valid_claim(meta.get("delta_norm"))) is not None
        )

    def _take(
        self, view: RoundView, report: RoundReport, network_wait: float, appear_within: float | None = None
    ) -> RoundResult:
        """Take the round's result from a cluster that committed it, instead of applying anything of our own.
        When this cluster is in the group the round was committed with (the served state says), that average
        holds our Δ (the same at every attempt of a round): taken at exactly this round, it is this cluster's
        commit too (:meth:`OuterState.adopt_round`, nothing lost); otherwise, or at a later round, a
        re-sync. When nobody serves it in time, our own Δ alone keeps our progress (the next round repairs
        it)."""
        ctx, state, number = self.ctx, self.ctx.state, self.id.number
        self._enter(Phase.TAKEN)
        got = ctx.adoption.download(number, ctx.hv.join_timeout, exact=number, appear_within=appear_within)
        fragment = state.fragment
        if got is None:
            why = "no cluster served the round's state within --hv.join-timeout"
            return self._commit(view, report, network_wait, 1, self.alive, alone=why)
        if got.step == number and ctx.galaxy_rank in got.metadata.get("committed_group", ()):
            ctx.committed.take(got, own_round=True)
            state.land()
            ctx.warn(
                f"outer step {number}: took the round as cluster {got.source} committed it (our Δ is in it)"
            )
            outcome = "adopted"
        else:
            ctx.committed.take(got)
            ctx.warn(f"outer step {number - 1}: took cluster {got.source}'s state at outer step {got.step}")
            ctx.catch_up.catch_up()
            outcome = "resynced"
        # adopted: our Δ is in the round, which its committer checked started from our θ_outer (else it would
        # have left us out of the group it committed with): in sync when that group is every live cluster
        in_sync = outcome == "adopted" and len(state.committed_group) >= self.alive
        return self._result(
            outcome,
            report,
            network_wait,
            fragment=fragment,
            state_source=got.source,
            galaxy_complete=view.whole,
            in_sync=in_sync,
            ledger=ctx.committed.held_entry(),
        )

    @torch.no_grad()
    def sit_out(self) -> RoundResult:
        """Send nothing this round, then adopt the galaxy's θ_outer once the round is applied, when:

        - the galaxy is ahead (:attr:`lead`): this cluster's Δ was taken from an older θ_outer than the
          round's (a late joiner whose download is already old, a side of a healed partition), and averaging
          it would drag every cluster back;
        - this cluster's Δ is not finite, or out of bound (its inner training diverged). Alone, or when no
          peer serves the state in time, it drops its local progress and goes back to its own θ_outer. After
          ``--hv.max-bad-rounds`` such rounds in a row it stops: the divergence is its own, not a passing
          spike."""
        ctx, state, number = self.ctx, self.ctx.state, self.id.number
        bad = self.diverged or self.out_of_bound
        if bad:
            ctx.bad_rounds += 1
            what = "not finite" if self.diverged else "out of bound"
            if ctx.bad_rounds > ctx.hv.max_bad_rounds:
                raise GalaxyError(
                    f"outer step {number}: this cluster's pseudo-gradient was {what} in {ctx.bad_rounds} "
                    "rounds in a row (its training diverges): stopping; lower --lr or --max-grad-norm, or "
                    "resume from an earlier checkpoint"
                )
            detail = (
                ""
                if self.diverged
                else " (above --hv.delta-norm-bound × the galaxy's recent median, or 100 × ‖θ_outer‖)"
            )
            ctx.warn(
                f"outer step {number}: this cluster's pseudo-gradient is {what}{detail}: its training "
                "diverged; it sends nothing and adopts the galaxy's θ_outer "
                f"({ctx.bad_rounds}/{ctx.hv.max_bad_rounds})"
            )
            why, wanted = "this cluster diverged", max(number, self.lead)
        else:
            ctx.warn(
                f"outer step {number}: the galaxy is at outer step {self.lead}: this cluster's "
                "pseudo-gradient comes from an older θ_outer, so it sends nothing and adopts the galaxy's "
                "state"
            )
            why, wanted = "the galaxy was ahead", self.lead
        taken = ctx.catch_up.resync(wanted, why) if not ctx.hv.alone else None
        self._enter(Phase.SAT_OUT if taken is None else Phase.TAKEN)
        if taken is not None and not bad:
            ctx.catch_up.catch_up()
        state.scatter_into_model()
        state.local_at_start = None  # the whole model is θ_outer again: nothing of the fragment's to keep
        return self._result(
            "resynced" if taken is not None else "sat_out",
            state_source=None if taken is None else taken.source,
            ledger=ctx.committed.held_entry() if taken is not None else None,
        )

    def _result(
        self,
        outcome: str,
        report: RoundReport | None = None,
        network_wait: float = 0.0,
        fragment: int | None = None,
        **fields: Any,
    ) -> RoundResult:
        """The round's :class:`RoundResult`, hashes and norms the cluster's (every shard's, combined); a
        ``param_hash`` given is θ_outer's, already gathered (a commit's entry)."""
        ctx, state = self.ctx, self.ctx.state
        if outcome != "held" and ctx.holding_since is not None:
            ctx.warn(
                f"outer step {self.id.number}: {outcome} after holding {ctx.held_rounds} round(s) in "
                f"{time.monotonic() - ctx.holding_since:.0f}s"
            )
            ctx.holding_since = None
        fragment = state.fragment if fragment is None else fragment
        param_hash = fields.pop("param_hash", None) or ctx.committed.cluster_hash()
        if outcome in ("applied", "adopted"):
            fields["fragment_hash"] = combine_hashes(
                ctx.cluster.gather_strings(state.fragment_hash(fragment))
            )
        if report is not None:
            fields.update(report.record_fields())
        fields.setdefault("ledger_dropped", ctx.committed.pop_dropped())
        return RoundResult(
            outcome=outcome,
            outer_step=state.outer_step,
            fragment=fragment,
            attempt=self.id.attempt,
            network_wait_seconds=network_wait,
            galaxy_alive=self.alive,
            pseudo_grad_finite=not self.diverged,
            pseudo_grad_in_bound=not self.out_of_bound,
            pseudo_grad_bound=ctx.cluster.norm(self.bound**2 if self.bound is not None else math.nan),
            pseudo_grad_norm=ctx.cluster.norm(self.local_sq),  # None when not finite (JSON has no NaN)
            param_checksum=ctx.cluster.sum_float(state.sq_norm()),
            param_hash=param_hash,
            committed_work=ctx.committed.work,
            **fields,
        )


def _locked_buffer(ctx: RoundContext, held: contextlib.ExitStack) -> torch.Tensor | None:
    """The averager's buffer, locked until ``held`` closes; ``None`` on every rank when any rank could not
    lock it in time (a round that outlived its timeout still writes there), so no rank skips a collective its
    siblings enter."""
    try:
        buffer = held.enter_context(ctx.averager.buffer())
    except RoundFailed:
        buffer = None
    return buffer if ctx.cluster.all_true(buffer is not None) else None


class Seen(NamedTuple):
    """The galaxy as a round's start reads it (:func:`_membership`)."""

    alive: int
    lead: tuple[int, int]
    """(outer step, committed work)."""
    silent: int
    attempt: int
    ended_unheard: tuple[frozenset[int], frozenset[int]]
    gone: frozenset[int]
    behind: frozenset[int]
    """Live clusters this rank reads as still in an earlier round (``Membership.behind``): on their way."""
    left: frozenset[int] = frozenset()
    """Of ``gone``, the clusters this rank reads as left for good (:attr:`Round.left`)."""
    known: frozenset[int] = frozenset()
    """An elastic galaxy's clusters as this rank knows them (:attr:`Round.known`)."""


def _membership(ctx: RoundContext) -> Seen:
    """(clusters alive, the galaxy's lead (outer step, committed work), other clusters gone silent, the latest
    attempt of the next round a live cluster started, (the clusters that said they ended, those gone without a
    record)), the same on every rank of this cluster; and the clusters this rank reads as gone (ended, silent
    or unheard: what it tells the round's roster) and as behind (the plan's agreement makes them everyone's).

    Alive: the galaxy less the clusters whose record says they are gone (never this one), the largest count
    any rank saw, so that a rank that could not read the DHT in time makes the round wait rather than skip a
    cluster that is there. A cluster with no record at all counts as alive for a while (a galaxy that starts
    together waits for all of it: ``galaxy.averager.NOT_HEARD_SECONDS``). Lead: the highest outer step any
    rank saw in a live cluster's record (of the chain with the most committed work: ``Membership.lead``), with
    that chain's work. Silent: the most gone-by-silence clusters any rank saw (see
    ``Membership.silent``)."""
    view = ctx.averager.membership()
    ctx.fastest_seconds = min(view.step_seconds.values(), default=None)
    known, total = frozenset(), ctx.hv.galaxy_size
    if ctx.hv.elastic:  # its clusters: its chain's roster, every cluster with a record, this one
        roster = roster_of(ctx.committed.ledger.last, ctx.hv.galaxy_size, elastic=True)
        known = frozenset(roster | set(view.reported) | {ctx.galaxy_rank})
        # its first round waits for the clusters it needs, as a fixed galaxy waits for ranks not heard yet
        total = max(len(known), 0 if roster else ctx.hv.galaxy_size)
    ours = known or range(ctx.hv.galaxy_size)
    gone = {rank for rank in view.departed if rank != ctx.galaxy_rank and rank in ours}
    silent = {rank for rank in view.silent if rank != ctx.galaxy_rank and rank in ours}
    alive = -ctx.cluster.min_int(-(total - len(gone)))
    attempt = -ctx.cluster.min_int(-view.attempt_of(ctx.state.outer_step + 1))
    # gone, not silent: a record that says it ended, or no record at all (not started, or unreadable: after a
    # split the DHT may not reach the others' records for a while). Only the first ends a vote (Round.start)
    ended = frozenset(_ranks_by_any_rank(ctx.cluster, sorted(r for r in gone - silent if r in view.reported)))
    unheard = frozenset(_ranks_by_any_rank(ctx.cluster, sorted(gone - silent - set(view.reported))))
    # the lead any rank saw: the furthest by (work, step), agreed as the largest work, then its largest step
    lead_work = -ctx.cluster.min_int(-view.lead_work)
    lead = -ctx.cluster.min_int(-(view.lead if view.lead_work == lead_work else -1))
    silent_count = -ctx.cluster.min_int(-len(silent))
    behind = view.behind(ctx.state.outer_step + 1, ctx.galaxy_rank) - gone
    # left for good: said it ended, or silent longer than a majority may be gone before a side forks. Not
    # silence alone: a side of a 2 | 2 split dropped the other from its roster, and a cut of its lowest rank
    # alone then made that one cluster "half of the roster with the lowest rank", a quorum, while the three
    # others held (chaos soak `intercontinental`, seed 3)
    long_silent = {rank for rank in silent if view.silent_seconds.get(rank, 0.0) > ctx.hv.fork_after}
    left = frozenset((gone - silent) | long_silent)  # (no record at all: as before, never started)
    ended_unheard = (ended, unheard)
    lead_of = (lead, lead_work)
    return Seen(alive, lead_of, silent_count, attempt, ended_unheard, frozenset(gone), behind, left, known)
