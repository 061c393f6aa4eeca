"""``open-diloco [FLAGS]``: train one cluster (the app's default command)."""

from __future__ import annotations

from open_diloco.config import Config, check_against_world


def train(*, config: Config | None = None) -> None:
    """Train one cluster (run under torchrun for several ranks)."""
    # `config` is keyword-only so that its fields are flags only: as positionals, a stray word (`open-diloco
    # foo --fake-data`) would silently become --path-model.
    from open_diloco.cluster_id import resolve_galaxy_rank

    config = config if config is not None else Config()
    if config.dry_run:
        from open_diloco.dry_run import dry_run

        dry_run(config)
        return
    # before the trainer's imports (seconds of CPU on every rank): a batch the launched ranks cannot split
    # fails at once, against the same world the trainer will see
    from open_diloco.world import launcher_env

    check_against_world(config, int(launcher_env()["world_size"]))
    config = resolve_galaxy_rank(config)  # an elastic cluster's id (a dry run joins nothing: it keeps none)
    from open_diloco.trainer import train as run_training  # heavy imports only when training

    run_training(config)
