"""Who may take part in this cluster's rounds: the membership half of the galaxy guard.

Each rank's DHT node and averager speak libp2p under one PeerID, the hash of a private key. libp2p's secure
channel proves, on every connection, that the caller holds the key behind its PeerID, so a list of PeerIDs is
an authenticated allowlist with no secret to share between organisations: each keeps its own key files
(``--hv.identity-path``, made once with ``open-diloco identity``) and publishes only its PeerIDs; a cluster is
struck off by deleting its lines. (A galaxy secret would be one line of config, but anyone holding it could
pose as any member, and revoking one organisation means handing every other a new secret.)

The averager checks it on every averager RPC, both ways: incoming join requests, parts to aggregate and state
downloads from a peer not on the list are refused; outgoing, this peer never asks a stranger to lead its
group, never sends it a part and never downloads its state; and a group with a stranger in it is not averaged.
A refused peer is logged once, with its PeerID. The DHT itself stays open (the stock ``hivemind-dht``
bootstrap does not know the list): docs/security.md ("Threat model") says what that leaves.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon import P2P

from open_diloco.errors import ConfigError

log = logging.getLogger("open_diloco.galaxy")


class Allowlist:
    """The PeerIDs (base58) this peer deals with; see the module docstring."""

    def __init__(self, peers: frozenset[str], source: str):
        self.peers, self.source = peers, source
        self._refused: set[str] = set()

    @classmethod
    def load(cls, path: Path) -> Allowlist:
        """One PeerID per line; ``#`` starts a comment; blank lines are skipped. A bad line is a
        ConfigError."""
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError(
                f"--hv.allowlist {str(path)!r}: cannot read it ({err.strerror}); give a file of PeerIDs, one "
                "per line (`open-diloco identity` prints a cluster's)"
            ) from None
        peers = set()
        for number, line in enumerate(text.splitlines(), start=1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            if not _is_peer_id(entry):
                raise ConfigError(
                    f"--hv.allowlist {str(path)!r} line {number}: {entry!r} is not a PeerID; each line holds "
                    "one, as `open-diloco identity` prints them"
                )
            peers.add(entry)
        if not peers:
            raise ConfigError(f"--hv.allowlist {str(path)!r} lists no PeerID: every peer would be refused")
        return cls(frozenset(peers), str(path))

    def admits(self, peer: PeerID | str) -> bool:
        return (peer.to_base58() if isinstance(peer, PeerID) else peer) in self.peers

    def refuse(self, peer: PeerID, what: str) -> None:
        """Log the first refusal of ``peer`` (a stranger that keeps knocking is named once, not every
        round)."""
        name = peer.to_base58()
        if name not in self._refused:
            self._refused.add(name)
            log.warning("refused %s: peer %s is not on --hv.allowlist %s", what, name, self.source)


def _is_peer_id(text: str) -> bool:
    try:
        return len(PeerID.from_base58(text).to_bytes()) > 2
    except Exception:
        return False


class RefusedStub:
    """What this peer gets instead of a stub for a stranger: every RPC answers with an empty stream, which
    hivemind already treats as a peer that has nothing for us (no leader, no state, a failed reducer)."""

    def __getattr__(self, method: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            return _nothing()

        return call


async def _nothing() -> AsyncIterator[Any]:
    return
    yield


def rank_key_file(identity_dir: Path, rank: int) -> Path:
    """The key file of one rank (the cluster's global rank: one shard, one PeerID) in a cluster's identity
    directory."""
    return Path(identity_dir) / f"rank{rank}.key"


def ensure_identity(identity_dir: Path, rank: int) -> str:
    """Make ``rank``'s key file if it does not exist yet (private: 0400 in a 0700 directory) and return its
    PeerID. Each rank makes only its own, so ranks starting together never race for a file."""
    identity_dir = Path(identity_dir)
    key_file = rank_key_file(identity_dir, rank)
    try:
        identity_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not key_file.exists():
            P2P.generate_identity(str(key_file))
        return PeerID.from_identity(key_file.read_bytes()).to_base58()
    except OSError as err:
        raise ConfigError(
            f"--hv.identity-path {str(identity_dir)!r}: {err.strerror or err}; give a directory this user "
            "may write"
        ) from None
    except Exception as err:  # a file that is no libp2p private key
        raise ConfigError(
            f"--hv.identity-path {str(identity_dir)!r}: {key_file.name} is not a libp2p private key "
            f"({err!r}); move it away and start again to make a new one"
        ) from None
