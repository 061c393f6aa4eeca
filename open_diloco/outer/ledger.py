"""The galaxy's ledger: one entry per committed round, computed identically by every member of the round from
what the round gathered, and chained by θ hashes (entry r's ``before`` is entry r−1's ``after``).

Why a ledger and not the clusters' records: a status record says where a cluster *is* (its outer step, its
θ hash) and is overwritten every heartbeat; nothing said afterwards what a round *was* — who averaged, with
what weights, from which θ to which — so after a split nobody could say what the galaxy trained. The entry
is the round's commit record. Every member computes it from the same inputs (the round's members and their
metadata, the θ hash every member started from, the θ hash every member holds after: bitwise-identical rounds
make them equal), so members agree on it without a coordinator and without another message. Where two
clusters committed different rounds r (a partition, a cluster that applied its Δ alone), their entries
differ: both are kept and shown, never merged.

Where entries live: in memory (the last :data:`KEEP` rounds), in every checkpoint (``ledger.jsonl``), in the
metrics records of the rounds (``ledger``, one entry per committed round), and mirrored in the DHT
(``galaxy/ledger_mirror.py``), which is last-writer-wins without compare-and-swap and so never trusted over
a chain: it only shows what clusters say they committed. A cluster that takes another's state takes its
chain too (:meth:`Ledger.take`), so the chain a cluster holds always ends at the θ it holds.

Pure Python: no torch, no hivemind (``open-diloco ledger`` reads entries without either).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from open_diloco.errors import OpenDilocoError
from open_diloco.outer.deal import Deal

KEEP = 4096
"""Entries a cluster keeps (and checkpoints): at one round a second, over an hour of rounds, longer than the
DHT mirror keeps them (``galaxy/ledger_mirror.py``'s TTL), so the chain outlives its mirror."""

SERVED = 256
"""Entries that travel with a served state (a join, a re-sync, an adopted round): the source's latest, enough
to replace whatever the taker's own chain held since a partition of that many rounds."""


class LedgerBroken(OpenDilocoError):
    """An entry whose content does not match its hash, or a chain that does not continue: the one line
    ``open-diloco ledger --verify`` exits with."""


@dataclass(frozen=True)
class Member:
    """One cluster of a committed round, as the round's gathered metadata named it."""

    rank: int
    """Its galaxy rank."""
    weight: float = 1.0
    """The weight its Δ entered the average with (``--hv.round-steps by-speed``; 1.0 otherwise)."""
    inner_steps: int | None = None
    """The inner steps its Δ holds, as it said (``None``: it did not say)."""


@dataclass(frozen=True)
class LedgerEntry:
    """One committed round. Its :attr:`hash` is over every field, so an altered record is caught."""

    round: int
    """The outer step this round produced (1 for the galaxy's first round)."""
    attempt: int
    """The attempt that committed (0: the first)."""
    fragment: int
    """The fragment the round averaged (``--hv.fragments``; 0 when the whole model syncs)."""
    before: str
    """``param_hash`` of θ_outer (every shard) every member started the round from."""
    after: str
    """``param_hash`` of θ_outer every member holds after the round."""
    members: tuple[Member, ...]
    """The clusters whose Δ is in the average, by galaxy rank."""
    codec: str
    """The wire codec (``--hv.compression``, as ``open-diloco status`` names it)."""
    outer_optimizer: str
    """The outer step's rule and hyperparameters (the same in every member, or the distinct values shown)."""
    alone: bool = False
    """This cluster applied its own Δ alone (nobody averaged or served the round): an entry of one, which the
    galaxy's own entry for the round (if any) contradicts."""
    roster: tuple[int, ...] | None = None
    """The clusters whose majority a round needs from now on (``outer/quorum.py``); ``None`` in entries made
    before the roster existed."""
    fork: bool = False
    """Committed without a quorum, after ``--hv.fork-after`` seconds of holding: a fork of the chain, named by
    its ``before`` (its parent's ``after``)."""
    tokens: int | None = None
    """The tokens this round committed into θ_outer: each member's inner steps behind its Δ times the tokens
    of its inner step, over ``--hv.fragments`` (a fragment's round carries that share of the model);
    ``None`` in entries made before it was counted."""
    work: int | None = None
    """The committed work of the chain up to this entry: the tokens of every round in it, cumulative (the
    parent's ``work``, the most any member held, plus :attr:`tokens`). What decides which of two forks the
    galaxy keeps (``outer/quorum.py``); ``None`` in entries made before it was counted."""
    deal: dict[str, Any] | None = None
    """An elastic galaxy's deal after this round (``outer/deal.py``'s ``Deal`` on the wire): the cursor, the
    pages that came back and the hands of the strides in progress; ``None`` in a fixed galaxy."""
    pages: dict[str, list[list[int]]] | None = None
    """The pages this round committed, by galaxy rank (``[first, last + 1]`` runs): the strides it settled
    (``outer/deal.py``); ``None`` in a fixed galaxy."""

    @functools.cached_property
    def hash(self) -> str:
        """A digest of every field (canonical JSON): equal entries have equal hashes on every machine. Kept
        once computed (an entry never changes): a served tail and a checkpoint's ledger read it per entry."""
        import xxhash

        return xxhash.xxh3_64(json.dumps(self._fields(), sort_keys=True).encode()).hexdigest()

    @functools.cached_property
    def dealt(self) -> Deal | None:
        """:attr:`deal` read, once (a cluster's steps read their pages from it every step)."""
        return None if self.deal is None else Deal.from_wire(self.deal)

    @property
    def ranks(self) -> list[int]:
        return [member.rank for member in self.members]

    def _fields(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "attempt": self.attempt,
            "fragment": self.fragment,
            "before": self.before,
            "after": self.after,
            "members": [
                {"rank": m.rank, "weight": m.weight, "inner_steps": m.inner_steps} for m in self.members
            ],
            "codec": self.codec,
            "outer_optimizer": self.outer_optimizer,
            "alone": self.alone,
            # only when set: an entry from before these fields keeps its hash
            **({"roster": list(self.roster)} if self.roster is not None else {}),
            **({"fork": True} if self.fork else {}),
            **({"tokens": self.tokens} if self.tokens is not None else {}),
            **({"work": self.work} if self.work is not None else {}),
            **({"deal": self.deal} if self.deal is not None else {}),
            **({"pages": self.pages} if self.pages is not None else {}),
        }

    def to_wire(self) -> dict[str, Any]:
        """The entry as JSON-able fields plus its ``hash`` (what records, checkpoints and the DHT hold)."""
        return {**self._fields(), "hash": self.hash}

    @staticmethod
    def from_wire(fields: dict[str, Any], where: str = "a ledger entry") -> LedgerEntry:
        """Read an entry back; raise :class:`LedgerBroken` naming ``where`` when it is malformed or its
        ``hash`` does not match its content (a record altered after it was written)."""
        try:
            entry = LedgerEntry(
                round=int(fields["round"]),
                attempt=int(fields["attempt"]),
                fragment=int(fields["fragment"]),
                before=str(fields["before"]),
                after=str(fields["after"]),
                members=tuple(
                    Member(int(m["rank"]), float(m["weight"]), _optional_int(m.get("inner_steps")))
                    for m in fields["members"]
                ),
                codec=str(fields["codec"]),
                outer_optimizer=str(fields["outer_optimizer"]),
                alone=bool(fields.get("alone", False)),
                roster=None if fields.get("roster") is None else tuple(int(r) for r in fields["roster"]),
                fork=bool(fields.get("fork", False)),
                tokens=_optional_int(fields.get("tokens")),
                work=_optional_int(fields.get("work")),
                deal=fields.get("deal"),
                pages=fields.get("pages"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise LedgerBroken(
                f"{where} is malformed ({type(err).__name__}: {err}): not an open-diloco ledger entry"
            ) from None
        if fields.get("hash") not in (None, entry.hash):
            raise LedgerBroken(
                f"{where} (round {entry.round}) does not match its hash {fields['hash']} (its content hashes "
                f"to {entry.hash}): the record was altered after it was written"
            )
        return entry


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def round_entry(
    *,
    round_no: int,
    attempt: int,
    fragment: int,
    before: str,
    after: str,
    peers: dict[int, dict[str, Any]],
    members: Iterable[int],
    alone: bool = False,
    roster: tuple[int, ...] | None = None,
    fork: bool = False,
) -> LedgerEntry:
    """The entry of a committed round from what every member holds alike: the members (galaxy ranks whose Δ
    is in the average), the metadata each sent with the round (``peers``: weight, inner steps, tokens, the
    work of its chain, codec, outer optimizer), and the θ hashes before and after. A member's value that
    does not agree with the others' (a misconfigured cluster) is shown, not hidden: the field lists every
    distinct value. The work: the most any member's chain held (they started from one θ, so one chain) plus
    the round's tokens."""
    ranks = sorted(members)
    metadata = [peers.get(rank, {}) for rank in ranks]
    tokens = sum(_optional_int(meta.get("tokens")) or 0 for meta in metadata)
    parent_work = max((_optional_int(meta.get("work")) or 0 for meta in metadata), default=0)
    return LedgerEntry(
        round=round_no,
        attempt=attempt,
        fragment=fragment,
        before=before,
        after=after,
        members=tuple(
            Member(rank, float(meta.get("weight") or 1.0), _optional_int(meta.get("inner_steps")))
            for rank, meta in zip(ranks, metadata, strict=True)
        ),
        codec=_agreed(meta.get("codec") for meta in metadata),
        outer_optimizer=_agreed(meta.get("outer_optimizer") for meta in metadata),
        alone=alone,
        roster=roster,
        fork=fork,
        tokens=tokens,
        work=parent_work + tokens,
    )


def _agreed(values: Iterable[Any]) -> str:
    """The one value every member sent, or every distinct one joined by ``|`` (``?``: none said)."""
    distinct = sorted({str(value) for value in values if value is not None})
    return "|".join(distinct) or "?"


@dataclass
class Ledger:
    """The chain one cluster holds: entries of the rounds its θ_outer went through, oldest first, the last
    :data:`KEEP`. The same on every rank of the cluster (every entry is made from values the ranks agreed)."""

    entries: list[LedgerEntry] = field(default_factory=list)

    @property
    def last(self) -> LedgerEntry | None:
        return self.entries[-1] if self.entries else None

    @property
    def work(self) -> int:
        """The committed work of the chain (its last entry's; 0 before the first, or from older entries)."""
        return (self.last.work or 0) if self.last is not None else 0

    def append(self, entry: LedgerEntry) -> str | None:
        """Add this cluster's next committed round; returns a warning line when it does not continue the chain
        (its ``before`` is not the last entry's ``after``: the θ changed outside a round, a defect to report),
        ``None`` when it does. The entry is kept either way: the chain shows the break."""
        broken = None
        if self.last is not None and entry.before != self.last.after:
            broken = (
                f"ledger: round {entry.round} starts from θ {entry.before}, but the last committed round "
                f"({self.last.round}) ended at {self.last.after}: the chain breaks here"
            )
        self.entries.append(entry)
        del self.entries[:-KEEP]
        return broken

    def take(self, served: list[dict[str, Any]] | None) -> Dropped | None:
        """Take the chain that came with another cluster's state: its entries replace this cluster's from
        the first round they cover on. The entries of this cluster's own that the taken chain does not hold
        (rounds it committed on another trajectory: a fork the galaxy did not keep) are dropped from its
        chain and returned, for the record that says so (their metrics records keep them too). Nothing
        served (an older peer): the chain stays, and the next entry shows the break."""
        if not served:
            return None
        taken = [LedgerEntry.from_wire(fields, "a served ledger entry") for fields in served]
        first, kept = taken[0].round, {entry.hash for entry in taken}
        dropped = [entry for entry in self.entries if entry.round >= first and entry.hash not in kept]
        self.entries = [entry for entry in self.entries if entry.round < first] + taken
        del self.entries[:-KEEP]
        return Dropped.of(dropped, taken[-1]) if dropped else None

    def tail(self, count: int = SERVED) -> list[dict[str, Any]]:
        """The latest ``count`` entries on the wire (what a served state carries)."""
        return [entry.to_wire() for entry in self.entries[-count:]]

    def state_dict(self) -> list[dict[str, Any]]:
        return [entry.to_wire() for entry in self.entries]

    def load_state_dict(self, entries: list[dict[str, Any]] | None) -> None:
        where = "a checkpoint's ledger entry"
        self.entries = [LedgerEntry.from_wire(fields, where) for fields in entries or []]


@dataclass(frozen=True)
class Dropped:
    """A run of this cluster's entries that a taken chain replaced: a fork the galaxy did not keep (the
    ``ledger_dropped`` metrics key)."""

    rounds: tuple[int, int]
    """The first and last round dropped."""
    head: str
    """The hash of the last entry dropped."""
    work: int
    """The committed work the dropped chain had reached."""
    kept_head: str
    """The hash of the last entry of the chain taken instead."""
    kept_work: int
    """The committed work of the chain taken instead."""

    @staticmethod
    def of(dropped: list[LedgerEntry], kept: LedgerEntry) -> Dropped:
        return Dropped(
            (dropped[0].round, dropped[-1].round),
            dropped[-1].hash,
            dropped[-1].work or 0,
            kept.hash,
            kept.work or 0,
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "rounds": list(self.rounds),
            "head": self.head,
            "work": self.work,
            "kept_head": self.kept_head,
            "kept_work": self.kept_work,
        }


CHECKPOINT_FILE = "ledger.jsonl"
"""The chain a checkpoint keeps, one entry a line, oldest first: written by rank 0 beside metadata.json (every
rank holds the same chain), read by ``open-diloco ledger`` without torch."""


def write_checkpoint_ledger(directory: Path, entries: list[dict[str, Any]]) -> None:
    (Path(directory) / CHECKPOINT_FILE).write_text("".join(json.dumps(entry) + "\n" for entry in entries))


def read_checkpoint_ledger(directory: Path) -> list[dict[str, Any]]:
    """A checkpoint's ledger entries (``[]``: none kept: a run without a galaxy, or an older version); a line
    that is not JSON is a corrupt checkpoint, said in one line."""
    file = Path(directory) / CHECKPOINT_FILE
    if not file.is_file():
        return []
    try:
        return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    except ValueError:
        raise LedgerBroken(
            f"{file} is not a ledger (a line is not JSON): resume from another checkpoint"
        ) from None
