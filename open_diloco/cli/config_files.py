"""Config files (``--config FILE``): TOML, YAML or JSON whose keys are the flag names, read by cyclopts as a
source of flags under the command line's.

We parse each file once ourselves before cyclopts does, so that a syntax error names the file and the line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import cyclopts

from open_diloco.errors import ConfigError

_CONFIG_PROVIDERS = {
    ".toml": cyclopts.config.Toml,
    ".yaml": cyclopts.config.Yaml,
    ".yml": cyclopts.config.Yaml,
    ".json": cyclopts.config.Json,
}


def config_file_provider(path: Path) -> Any:
    """A cyclopts provider that fills flags missing from the command line from a config file.

    Keys are flag names (``lr``, ``per_device_train_batch_size`` or ``per-device-train-batch-size``), with
    ``[hv]`` and ``[ckpt]`` tables for the groups; an unknown key is an error like an unknown flag."""
    path = Path(path)
    if not path.is_file():
        problem = "is not a file" if path.exists() else "does not exist"
        raise ConfigError(f"config file {path} {problem}: check the path")
    provider = _CONFIG_PROVIDERS.get(path.suffix)
    if provider is None:
        raise ConfigError(f"config file {path} has an unknown type: use .toml, .yaml, .yml or .json")
    check_config_syntax(path)
    return provider(path, must_exist=True)


def check_config_syntax(path: Path) -> None:
    """Parse the file once ourselves, so that a syntax error names the file and the line: cyclopts reports
    the parser's message alone (a YAML error without its line, no file name for any format)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read ({err}): check the file") from None
    kind = {".toml": "TOML", ".json": "JSON"}.get(path.suffix, "YAML")
    line, problem = {"TOML": _toml_syntax_error, "JSON": _json_syntax_error, "YAML": _yaml_syntax_error}[
        kind
    ](text)
    if problem is not None:
        where = f", line {line}" if line is not None else ""
        raise ConfigError(f"config file {path}{where}: {problem}: fix the {kind} syntax")


def _toml_syntax_error(text: str) -> tuple[int | None, str | None]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: cyclopts reads TOML with tomli there
        import tomli as tomllib
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:  # before Python 3.14 the line is only in the message
        found = re.search(r" \(at line (\d+), column \d+\)", str(err))
        if found:
            return int(found[1]), str(err)[: found.start()]
        return text.count("\n") + 1, str(err).replace(" (at end of document)", " at the end of the file")
    return None, None


def _json_syntax_error(text: str) -> tuple[int | None, str | None]:
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        return err.lineno, err.msg
    return None, None


def _yaml_syntax_error(text: str) -> tuple[int | None, str | None]:
    import yaml

    try:
        yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        return (mark.line + 1 if mark is not None else None), problem
    return None, None


def split_config_flag(argv: list[str]) -> tuple[Path | None, list[str]]:
    """Take ``--config PATH`` (or ``--config=PATH``) out of argv, up to a ``--``: what follows that belongs
    to ``preflight``, which reads the trainer's ``--config`` itself."""
    rest: list[str] = []
    config_path: Path | None = None
    args = iter(argv)
    for arg in args:
        if arg == "--":
            rest += [arg, *args]
        elif arg == "--config":
            value = next(args, None)
            if value is None:
                raise ConfigError("--config needs a file path: --config configs/NAME.toml")
            config_path = Path(value)
        elif arg.startswith("--config="):
            config_path = Path(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return config_path, rest
