"""Who a cluster is in an elastic galaxy (started without ``--hv.world-rank``): an id kept in its checkpoint
directory, and the galaxy rank that id stands for.

Why the rank is a function of the id and not handed out: a rank handed out needs someone to hand it out, or
clusters racing to claim one in a DHT that has no compare-and-swap (``../shared/design.md``, known traps).
A rank derived from the id needs neither: every path that keys a cluster by its rank (the status records'
subkeys, the ledger's members and rosters, the quorum, the fake-data stream) works unchanged, and a cluster
joins the roster with the first ledger entry it is a member of (``outer/quorum.py``: ``next_roster``). Two
ids with one rank (31 bits: about 1 in 10⁶ for a galaxy of 50) meet the duplicate-rank check, which stops the
second with one line; a new id then fixes it.

The id is kept in ``--ckpt.path``/``cluster_id`` so that a restart (torchrun's, or by hand) is the same
cluster; every rank of the cluster reads the same file (a multi-node cluster shares ``--ckpt.path``, as its
checkpoints need). The first rank to start writes it, atomically: a rank that loses the race reads the
winner's.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from open_diloco.config import Config
from open_diloco.errors import ConfigError

ID_FILE = "cluster_id"
RANK_BITS = 31


def rank_of(cluster_id: str) -> int:
    """The galaxy rank an id stands for: the same on every machine."""
    digest = hashlib.blake2b(cluster_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << RANK_BITS) - 1)


def kept_cluster_id(directory: Path) -> str:
    """The id kept in ``directory`` (made and kept there if none is)."""
    path = Path(directory) / ID_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            draft = path.with_name(f".{ID_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
            draft.write_text(secrets.token_hex(6) + "\n")
            try:
                os.link(draft, path)  # atomic: fails if another rank made it first
            except FileExistsError:
                pass
            finally:
                draft.unlink()
        cluster_id = path.read_text().strip()
    except OSError as err:
        raise ConfigError(
            f"cannot keep this cluster's id in {path} ({err.strerror}): make --ckpt.path writable, or give "
            "--hv.cluster-id"
        ) from None
    if not cluster_id:
        raise ConfigError(f"{path} is empty: delete it (a new id is made) or give --hv.cluster-id")
    return cluster_id


def resolve_galaxy_rank(config: Config) -> Config:
    """``config`` as the trainer runs it: an unranked cluster (``HvConfig.unranked``, or one given
    ``--hv.cluster-id``) gets its id (kept in ``--ckpt.path``) and the galaxy rank of that id; any other
    config comes back as it is."""
    hv = config.hv
    if hv is None or not (hv.unranked or hv.elastic):
        return config
    cluster_id = hv.cluster_id or kept_cluster_id(config.ckpt.path)
    update = {"world_rank": rank_of(cluster_id), "cluster_id": cluster_id}
    return config.model_copy(update={"hv": hv.model_copy(update=update)})
