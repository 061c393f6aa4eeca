"""Throughput and error of the pseudo-gradient codecs (``open_diloco.outer.codecs``), one thread.

Per codec: encode, decode and round_trip_ (what the outer loop runs) in millions of fp32 values per second,
the encoding's size against fp32, and the relative L2 error on a pseudo-gradient (``--delta FILE``: a tensor,
or a dict of tensors, saved with torch.save; default: a heavy-tailed synthetic one). Then the sparse rules'
own work per round, in millions of the shard's values per second: picking the values (``select``;
``magnitude`` ranks the block scores) and packing them for the wire (``to_wire_``: gather, int2 round trip,
and for ``magnitude`` this cluster's block scores).

    python scripts/bench/codecs.py --numel 4000000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from open_diloco.outer.codecs import CODECS, build_compressor  # noqa: E402


def best_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--delta", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    if args.delta:
        loaded = torch.load(args.delta)
        deltas = loaded if isinstance(loaded, dict) else {"delta": loaded}
    else:
        deltas = {
            "synthetic": torch.randn(args.numel, generator=generator)
            * torch.rand(args.numel, generator=generator) ** 4
        }
    values = torch.randn(args.numel, generator=generator)
    print(
        f"{'codec':<6} {'fp32/bytes':>10} {'encode M/s':>10} {'decode M/s':>10} {'round trip M/s':>14}  "
        "rel. L2 error"
    )
    for name, make in CODECS.items():
        codec = make()
        blob = codec.encode(values)
        encode = best_seconds(lambda codec=codec: codec.encode(values), args.repeats)
        decode = best_seconds(lambda codec=codec, blob=blob: codec.decode(blob), args.repeats)
        rounded = values.clone()
        round_trip = best_seconds(
            lambda codec=codec, rounded=rounded: codec.round_trip_(rounded), args.repeats
        )
        errors = []
        for label, delta in deltas.items():
            q = delta.clone()
            codec.round_trip_(q)
            errors.append(f"{label} {float((q - delta).norm() / delta.norm()):.4f}")
        mvals = args.numel / 1e6
        print(
            f"{name:<6} {4 * args.numel / blob.numel():10.2f} {mvals / encode:10.1f} {mvals / decode:10.1f} "
            f"{mvals / round_trip:14.1f}  {', '.join(errors)}"
        )
    print(f"\n{'sparse rule':<22} {'select M/s':>10} {'to_wire_ M/s':>12}")
    for rule, density in (("random", 1 / 16), ("magnitude", 0.1)):
        compressor = build_compressor("sparse", density, rule)
        sparse = compressor.sparse
        blocks = sparse.score_blocks(args.numel)
        scores = 2.0 ** -torch.randint(0, 40, (blocks,), generator=generator).float() if blocks else None
        selection = sparse.select(args.numel, 3, scores)
        select = best_seconds(
            lambda sparse=sparse, scores=scores: sparse.select(args.numel, 3, scores), args.repeats
        )
        wire, own_scores = values.clone(), torch.zeros(blocks)

        def pack(compressor=compressor, selection=selection, wire=wire, own_scores=own_scores, blocks=blocks):
            wire.copy_(values)
            compressor.to_wire_(wire, None, selection, own_scores if blocks else None)

        to_wire = best_seconds(pack, args.repeats)
        mvals = args.numel / 1e6
        print(f"{rule + f' {density:g}':<22} {mvals / select:10.1f} {mvals / to_wire:12.1f}")


if __name__ == "__main__":
    main()
