"""The chaos soak: a galaxy over the WAN lab under a seeded schedule of faults, judged against issue 34.

    python -m scripts.chaos.soak              # the target: 4 clusters x 2 ranks, `home`, 500 syncs, 20 faults
    python -m scripts.chaos.soak --clusters 3 --ranks 2 --steps 150 --faults 8 --seed 1
    python -m scripts.chaos.soak --quick      # 2 x 1 on 127.0.0.1, one lost average, ~2 minutes
    python -m scripts.chaos.soak --no-faults --profile intercontinental   # the re-sync share with no fault
    python -m scripts.chaos.soak ... -- --hv.averaging-timeout 60         # trainer flags replace the soak's
    python -m scripts.chaos.soak --rejudge outputs/chaos/DIR             # judge a finished soak again

Streams at τ = H/P (``--hv.fragments P --hv.sync-delay H/P``), the setting the README recommends for WANs.
Writes ``summary.json``, ``summary.md`` (printed), ``events.log`` (every fault's start and end) and the
clusters' logs and metrics to ``--out``; exits 1 when a target fails, 2 when the soak could not run. The WAN
lab needs root.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from scripts.chaos import judge, report
from scripts.chaos.galaxy import REPO, python_default
from scripts.chaos.plan import (
    DURATION_S,
    ELASTIC_KINDS,
    KINDS,
    NEEDS_LAB,
    SPLIT_MIN_CLUSTERS,
    Fault,
    schedule,
)
from scripts.chaos.run import Soak, SoakConfig, with_overrides

TARGET = dict(
    clusters=4, ranks=2, profile="home", steps=1000, local_steps=4, fragments=2, faults=20, timeout=4 * 3600
)
QUICK = dict(
    clusters=2,
    ranks=1,
    profile="none",
    steps=40,
    local_steps=4,
    fragments=2,
    faults=1,
    kinds="lost_average",
    timeout=300,
)
QUICK_TRAINER = ["--hv.averaging-timeout", "30", "--hv.join-timeout", "20"]  # a lost round waits less


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(
        prog="python -m scripts.chaos.soak",
        description=__doc__.split("\n\n")[0],
        epilog="Trainer flags after `--` replace the soak's defaults.",
    )
    p.add_argument("--clusters", type=int, help=f"clusters in the galaxy (default {TARGET['clusters']})")
    p.add_argument("--ranks", type=int, help=f"ranks per cluster (default {TARGET['ranks']})")
    p.add_argument(
        "--profile",
        help="WAN lab profile (scripts/wan/profiles.toml), or `none`: 127.0.0.1, no lab "
        f"(default {TARGET['profile']})",
    )
    p.add_argument("--steps", type=int, help=f"inner steps per cluster (default {TARGET['steps']})")
    p.add_argument("--local-steps", type=int, help=f"H (default {TARGET['local_steps']})")
    p.add_argument("--fragments", type=int, help=f"P; τ = H/P (default {TARGET['fragments']})")
    p.add_argument("--faults", type=int, help=f"faults in the schedule (default {TARGET['faults']})")
    p.add_argument(
        "--kinds",
        help=f"comma-separated fault kinds to draw from (default: all of {','.join(KINDS)}; "
        "the lab's only with a profile)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    p.add_argument(
        "--timeout", type=float, help="global wall-clock limit in seconds: past it the soak is a hang"
    )
    p.add_argument("--out", type=Path, help="output directory (default outputs/chaos/<time>); must be empty")
    p.add_argument("--no-faults", action="store_true", help="no faults: the re-sync share of a clean run")
    p.add_argument(
        "--elastic",
        action="store_true",
        help="clusters without --hv.world-rank (ids; the late joiner joins without a rank), the data dealt "
        "by the ledger and audited from the samples read, and one cluster leaving for good (`leave`)",
    )
    p.add_argument(
        "--partition-seconds",
        type=float,
        help=f"how long each partition lasts (default {DURATION_S['partition']:g}); one longer than a "
        "cluster's remaining run shows the final-round rule",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 clusters x 1 rank on 127.0.0.1, 40 steps, one lost average (~2 minutes)",
    )
    p.add_argument(
        "--trainer-root",
        type=Path,
        default=REPO,
        help="repository the trainers run from (a git worktree of older code: the before soak)",
    )
    p.add_argument("--python", default=python_default(), help="interpreter of the trainers, DHT and lab")
    p.add_argument(
        "--rejudge", type=Path, metavar="DIR", help="judge a finished soak in DIR again, run nothing"
    )
    args = p.parse_args(own)
    preset = QUICK if args.quick else TARGET
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.quick:
        extra = with_overrides(QUICK_TRAINER, extra)
    return args, extra


def build_config(args: argparse.Namespace, extra: list[str]) -> SoakConfig:
    profile = None if args.profile in (None, "none") else args.profile
    allowed = ELASTIC_KINDS if args.elastic else KINDS
    kinds = [k.strip() for k in (args.kinds or ",".join(allowed)).split(",") if k.strip()]
    unknown = set(kinds) - set(allowed)
    if unknown:
        raise SystemExit(f"soak: unknown fault kinds {sorted(unknown)}: choose from {', '.join(allowed)}")
    if profile is None:
        kinds = [k for k in kinds if k not in NEEDS_LAB]
    if args.clusters < SPLIT_MIN_CLUSTERS:
        kinds = [k for k in kinds if k != "split"]
    if args.local_steps % args.fragments:
        raise SystemExit(f"soak: --fragments {args.fragments} must divide --local-steps {args.local_steps}")
    if profile and os.geteuid() != 0:
        raise SystemExit("soak: the WAN lab needs root; run as root or with --profile none")
    out = args.out or REPO / "outputs" / "chaos" / time.strftime("%Y%m%d-%H%M%S")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"soak: {out} is not empty: metrics would append to an earlier soak's")
    out.mkdir(parents=True, exist_ok=True)
    return SoakConfig(
        clusters=args.clusters,
        ranks=args.ranks,
        profile=profile,
        steps=args.steps,
        local_steps=args.local_steps,
        fragments=args.fragments,
        faults=0 if args.no_faults else args.faults,
        kinds=kinds,
        seed=args.seed,
        timeout=args.timeout,
        out=out.resolve(),
        trainer_root=args.trainer_root.resolve(),
        python=args.python,
        extra=extra,
        durations={} if args.partition_seconds is None else {"partition": args.partition_seconds},
        elastic=args.elastic,
    )


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parse(argv)
    if args.rejudge:
        return rejudge(args.rejudge)
    cfg = build_config(args, extra)
    events = (cfg.out / "events.log").open("a")
    started = time.time()

    def say(text: str) -> None:
        line = f"[soak +{time.time() - started:7.1f}s] {text}"
        print(line, flush=True)
        events.write(f"{time.time():.3f} {line}\n")
        events.flush()

    faults = schedule(
        cfg.faults, cfg.kinds, cfg.clusters, cfg.ranks, cfg.total_syncs, cfg.seed, cfg.durations
    )
    cfg.genesis = cfg.clusters - sum(f.kind == "late_join" for f in faults)  # (an elastic first round's)
    setting = (
        f"{cfg.clusters} clusters x {cfg.ranks} ranks, {cfg.profile or 'no WAN lab (127.0.0.1)'}, "
        f"{cfg.steps} steps, H={cfg.local_steps}, P={cfg.fragments}, tau={cfg.stride}, "
        f"{len(faults)} faults (seed {cfg.seed})"
        + (", elastic (no ranks; data dealt by the ledger)" if cfg.elastic else "")
        + (f", trainer flags {' '.join(extra)}" if extra else "")
    )
    say(f"soak in {cfg.out}: {setting}")
    for fault in faults:
        say(f"plan   {fault.describe()}")
    if len(faults) < cfg.faults:
        say(
            f"only {len(faults)} of {cfg.faults} faults fit the kinds allowed here "
            f"({', '.join(cfg.kinds) or 'none'})"
        )
    signal.signal(
        signal.SIGTERM, _interrupt
    )  # a stopped soak still ends what it started (Soak.run's finally)
    try:
        soak_run = Soak(cfg, faults, say).run()
    except KeyboardInterrupt:
        say("interrupted: everything the soak started was ended")
        return 130
    except RuntimeError as err:
        say(f"the soak could not run: {err}")
        return 2
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "command": "python -m scripts.chaos.soak " + shlex.join(argv),
        "setting": setting,
        "started": soak_run.started,
        "seconds": soak_run.finished - soak_run.started,
        "package_file": soak_run.package_file,
        "lab": soak_run.lab,
        "hung": soak_run.hung,
        "left_running": soak_run.left_running,
        "load_average_per_minute": soak_run.loads,
        "cpus": os.cpu_count(),
        "launches": [launch.to_json() for launch in soak_run.launches],
    }
    passed = finish(cfg.out, summary, faults, [tail.syncs for tail in soak_run.tails])
    say(f"summary in {cfg.out / 'summary.md'}: {'PASSED' if passed else 'FAILED'}")
    return 0 if passed else 1


def finish(out: Path, summary: dict, faults: list[Fault], syncs: list[list[dict]]) -> bool:
    """Judge, write summary.json and summary.md, print the markdown; True if every target passed."""
    verdict = judge.judge(faults, syncs, summary["launches"], out, summary["hung"], summary["left_running"])
    summary.update(verdict, passed=all(t["passed"] for t in verdict["acceptance"]))
    print(report.write(out, summary))
    return summary["passed"]


def rejudge(out: Path) -> int:
    """Judge a finished soak again from its files: after a change to the analysis, an old soak read by
    today's rules (its summary.json and summary.md are rewritten)."""
    summary = json.loads((out / "summary.json").read_text())
    names = {f.name for f in dataclasses.fields(Fault)}
    faults = [Fault(**{k: v for k, v in row.items() if k in names}) for row in summary["faults"]]
    passed = finish(out, summary, faults, judge.all_syncs(out, len(summary["clusters"])))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
