"""Command line: parse flags (and an optional config file) into a :class:`~open_diloco.config.Config` and run
a command. ``app.py`` holds the app, parsing and the one-line errors, ``config_files.py`` the ``--config``
files, and each command has a module of its own; this file registers them, in the order ``--help`` lists them.

Commands import what they run inside their body: ``open-diloco --help`` loads neither torch nor hivemind.
"""

from __future__ import annotations

from open_diloco.cli import (
    audit_data,
    check_config,
    export,
    identity,
    ledger,
    preflight,
    prepare_data,
    report,
    status,
    train,
)
from open_diloco.cli.app import FLAG_PANELS, app, main, parse, run

app.default(train.train)
app.command(check_config.check_config, name="check-config")
app.command(prepare_data.prepare_data, name="prepare-data")
app.command(export.export, name="export")
app.command(preflight.preflight, name="preflight")
app.command(identity.identity, name="identity")
app.command(status.status, name="status")
app.command(report.report, name="report")
app.command(ledger.ledger, name="ledger")
app.command(audit_data.audit_data, name="audit-data")

__all__ = ["FLAG_PANELS", "app", "main", "parse", "run"]
