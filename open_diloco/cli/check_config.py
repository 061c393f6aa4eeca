"""``open-diloco check-config FILE``: validate a config file and print the configuration it resolves to."""

from __future__ import annotations

import json
from pathlib import Path

from open_diloco.cli.app import parse
from open_diloco.config import Config


def check_config(path: Path) -> None:
    """Validate a config file (TOML, YAML or JSON) and print the resolved configuration."""
    _, bound = parse(["--config", str(path)])
    config = bound.arguments.get("config") or Config()
    print(json.dumps(config.model_dump(mode="json"), indent=2))
