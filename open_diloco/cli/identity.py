"""``open-diloco identity PATH --ranks N``: a cluster's key files and the PeerIDs other clusters allow."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from cyclopts import Parameter, validators


def identity(
    path: Path,
    /,
    *,
    ranks: Annotated[int, Parameter(validator=validators.Number(gte=1))] = 1,
) -> None:
    """Make a cluster's key files (those missing) and print its PeerIDs as --hv.allowlist lines.

    Run it once per cluster, keep PATH private (it holds the private keys) and pass it to that cluster's
    ranks as --hv.identity-path; send the printed lines to the other clusters for their --hv.allowlist files.

    Parameters
    ----------
    path
        The cluster's identity directory (--hv.identity-path); made if missing.
    ranks
        How many ranks the cluster runs (its torchrun world size): one key, one PeerID per rank. [range: ≥ 1]
    """
    from open_diloco.galaxy.allowlist import ensure_identity

    for rank in range(ranks):
        print(f"{ensure_identity(path, rank)}  # {path} rank {rank}")
