"""Faults a running lab takes from outside, by run id: cut an endpoint's link (a partition) or change the loss
on it (a burst). The chaos soak (scripts/chaos/) injects them while its galaxy trains; they work by hand too:

    python -m scripts.wan.control link RUN_ID c1 down     # nothing in or out of cluster 1 ... `up` heals it
    python -m scripts.wan.control loss RUN_ID c1 5        # 5 % of packets lost both ways on cluster 1's link
    python -m scripts.wan.control loss RUN_ID c1 off      # back to the profile's loss
    python -m scripts.wan.control split RUN_ID c0,c1,dht c2,c3  # a split: nothing between the two sides
    python -m scripts.wan.control split RUN_ID off        # one galaxy again

A link is the endpoint's veth port on the lab's bridge (what ``Lab.set_link`` takes down); loss is read by the
endpoint's forwarder from ``/run/open_diloco-wan/RUN_ID/ENDPOINT.control`` (scripts/wan/forwarder.py polls
it), so neither needs the process that holds the lab. A split is a table of nftables' bridge family in the
bridge's namespace, dropping every frame from one side's ports to the other's (each side keeps its own links,
unlike a link taken down). Needs root, as the lab does; a split needs ``nft`` (installed when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from scripts.wan.namespaces import PREFIX, RUNTIME, LabError, require_root, run
from scripts.wan.nat import ensure_nft


def _endpoint(name: str) -> str:
    """``cluster1`` or ``c1`` → ``c1``; ``dht`` as is."""
    name = name.replace("cluster", "c")
    if name != "dht" and not (name.startswith("c") and name[1:].isdigit()):
        raise LabError(f"no endpoint {name!r}: dht, c0, c1 ... (or cluster0, cluster1 ...)")
    return name


def set_link(run_id: str, endpoint: str, up: bool) -> None:
    """Take ``endpoint``'s link in lab ``run_id`` down (a partition) or bring it back up."""
    run("ip", "-n", f"{PREFIX}{run_id}-br", "link", "set", _endpoint(endpoint), "up" if up else "down")


SPLIT_TABLE = "odw_split"


def set_split(run_id: str, sides: tuple[list[str], list[str]] | None) -> None:
    """Split lab ``run_id``'s bridge in two ``sides`` (endpoints each): no frame crosses between them, while
    each side's endpoints still reach each other. ``None``: one lab again (no error when it was not split)."""
    a, b = ({_endpoint(name) for name in side} for side in sides or ((), ()))
    if sides is not None and (not a or not b or a & b):  # checked before the split in place is undone
        raise LabError(f"a split needs two disjoint sides of endpoints, not {sorted(a)} and {sorted(b)}")
    ensure_nft()
    netns = f"{PREFIX}{run_id}-br"
    run("ip", "netns", "exec", netns, "nft", "delete", "table", "bridge", SPLIT_TABLE, check=False)
    if sides is None:
        return
    ports = [", ".join(f'"{name}"' for name in sorted(side)) for side in (a, b)]
    rules = "\n".join(
        [
            f"table bridge {SPLIT_TABLE} {{",
            "  chain forward {",
            "    type filter hook forward priority 0; policy accept;",
            f"    iifname {{ {ports[0]} }} oifname {{ {ports[1]} }} drop",
            f"    iifname {{ {ports[1]} }} oifname {{ {ports[0]} }} drop",
            "  }",
            "}",
            "",
        ]
    )
    with tempfile.NamedTemporaryFile("w", suffix=".nft") as file:
        file.write(rules)
        file.flush()
        run("ip", "netns", "exec", netns, "nft", "-f", file.name)


def control_file(run_id: str, endpoint: str) -> Path:
    """Where the forwarder of ``endpoint`` in lab ``run_id`` reads its loss (the lab passes it the same
    path)."""
    return RUNTIME / run_id / f"{_endpoint(endpoint)}.control"


def set_loss(run_id: str, endpoint: str, loss_pct: float | None) -> None:
    """Lose ``loss_pct`` % of the packets sent and received on ``endpoint``'s link; None: the profile's
    loss."""
    path = control_file(run_id, endpoint)
    if not path.parent.is_dir():
        raise LabError(f"no lab {run_id} here ({path.parent} is missing)")
    if loss_pct is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"loss_pct": loss_pct, "loss_in_pct": loss_pct}))
    os.replace(tmp, path)  # the forwarder never reads half a file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.wan.control", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    link = sub.add_parser("link", help="take an endpoint's link down or up")
    loss = sub.add_parser(
        "loss", help="set the loss on an endpoint's link (%% both ways; `off`: the profile's)"
    )
    split = sub.add_parser("split", help="split the lab in two sides (`off`: one lab again)")
    for cmd in (link, loss):
        cmd.add_argument("run_id")
        cmd.add_argument("endpoint")
    link.add_argument("state", choices=("up", "down"))
    loss.add_argument("pct")
    split.add_argument("run_id")
    split.add_argument("side", help="comma-separated endpoints (c0,c1,dht), or off")
    split.add_argument("other", nargs="?", help="the other side's endpoints")
    args = parser.parse_args(argv)
    try:
        require_root()
        if args.cmd == "link":
            set_link(args.run_id, args.endpoint, args.state == "up")
        elif args.cmd == "loss":
            set_loss(args.run_id, args.endpoint, None if args.pct == "off" else float(args.pct))
        elif args.side == "off":
            set_split(args.run_id, None)
        else:
            if not args.other:
                raise LabError("split: name both sides (c0,c1,dht c2,c3), or `off`")
            set_split(args.run_id, (args.side.split(","), args.other.split(",")))
    except (LabError, ValueError) as err:
        print(f"control: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
