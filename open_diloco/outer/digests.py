"""Digests of a flat buffer's exact bytes: the hashes clusters compare to know they hold the same θ_outer, and
the fp64 sum of squares behind the rounds' norms. Both are deterministic: equal bytes give equal digests."""

from __future__ import annotations

import torch


def fingerprint_bytes(*buffers: torch.Tensor) -> str:
    """A short hash of tensors' exact bytes, in order: two clusters agree on it iff their tensors are bitwise
    equal (one tensor: the same digest as hashing its bytes at once)."""
    import xxhash

    digest = xxhash.xxh3_128()
    for buffer in buffers:
        digest.update(buffer.detach().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def combine_hashes(hashes: list[str]) -> str:
    """One hash of the whole model from its shards' hashes, in shard order."""
    import xxhash

    return xxhash.xxh3_64("".join(hashes).encode()).hexdigest()


def sum_of_squares(buffer: torch.Tensor, chunk: int = 1 << 18) -> float:
    """Σ x² in fp64, a chunk at a time: ``buffer.double().square().sum()`` without materialising an fp64 copy
    of the whole buffer (far faster than one fp64 copy of the shard). Deterministic: equal bytes give equal
    sums."""
    return sum(square_sum(piece) for piece in buffer.reshape(-1).split(chunk))


def square_sum(piece: torch.Tensor) -> float:
    """Σ x² of one piece in fp64, at once: the unit :func:`sum_of_squares` adds up a chunk at a time."""
    return float(piece.double().square().sum())
