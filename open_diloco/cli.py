"""Command line: parse flags (and an optional config file) into a :class:`Config` and run a command.

Every user error — an unknown flag, a bad value, a config check — ends as one line on stderr naming the
problem and the fix, and exit code 2, on every rank, before any rank waits on another.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cyclopts
import pydantic

from open_diloco.config import Config, ConfigError

EXIT_USAGE = 2

app = cyclopts.App(
    name="open-diloco",
    help="Decentralized multi-cluster LLM training: DiLoCo over hivemind, FSDP2 inside each cluster.\n\n"
    "Flags may also come from a file: --config FILE (TOML, YAML or JSON; keys are the flag names with "
    "underscores, `hv` and `ckpt` as tables). Flags on the command line override the file.",
    help_format="plaintext",
    version_flags=[],
)


@app.default
def train(config: Config | None = None) -> None:
    """Train one cluster (run under torchrun for several ranks)."""
    from open_diloco.trainer import train as run_training  # heavy imports only when training

    run_training(config if config is not None else Config())


@app.command(name="check-config")
def check_config(path: Path) -> None:
    """Validate a config file and print the resolved configuration."""
    config = Config.model_validate(load_config_file(path))
    print(json.dumps(config.model_dump(mode="json"), indent=2))


@app.command(name="prepare-data")
def prepare_data(
    dataset_path: str,
    output: Path,
    *,
    path_tokenizer: Path | None = None,
    dataset_text_field: str = "text",
) -> None:
    """Tokenize and pack a corpus once into OUTPUT (tokens.bin + index.json); pass OUTPUT as --dataset-path.

    Parameters
    ----------
    dataset_path
        A directory or glob of text files, .jsonl/.parquet files, or a `save_to_disk` dataset.
    output
        Directory to write; must not exist yet.
    path_tokenizer
        A local tokenizer directory. Unset: the built-in byte-level tokenizer.
    dataset_text_field
        Field holding the text in JSONL, parquet and `datasets` data.
    """
    from open_diloco.corpus import find_source, pack_corpus
    from open_diloco.tokenizer import load_tokenizer

    if output.exists():
        raise ConfigError(f"{output} already exists: choose a new output directory")
    tokenizer = load_tokenizer(path_tokenizer)
    source = find_source(dataset_path, dataset_text_field)
    corpus = pack_corpus(source, dataset_text_field, tokenizer, output)
    print(f"wrote {output} ({corpus.dtype} tokens, tokenizer {corpus.tokenizer}): pass it as --dataset-path")


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML, YAML or JSON config file into a dict keyed like :class:`Config`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist: check the path")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path} has an unknown type: use .toml, .yaml, .yml or .json")
    except ConfigError:
        raise
    except Exception as err:  # each parser has its own error type; all mean "not parseable"
        raise ConfigError(f"config file {path} does not parse ({str(err).splitlines()[0]}): fix its syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of settings at the top level")
    return {key.replace("-", "_"): value for key, value in data.items()}


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def _split_config_flag(argv: list[str]) -> tuple[Path | None, list[str]]:
    """Take ``--config PATH`` (or ``--config=PATH``) out of argv."""
    rest: list[str] = []
    config_path: Path | None = None
    args = iter(argv)
    for arg in args:
        if arg == "--config":
            value = next(args, None)
            if value is None:
                raise ConfigError("--config needs a file path: --config configs/NAME.toml")
            config_path = Path(value)
        elif arg.startswith("--config="):
            config_path = Path(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    return config_path, rest


def describe_validation_error(err: pydantic.ValidationError) -> str:
    """One line for the first problem pydantic found, in flag spelling."""
    first = err.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):
        return str(cause)
    flag = "--" + ".".join(str(part).replace("_", "-") for part in first["loc"] if not isinstance(part, int))
    given = first.get("input")
    given_text = f" (got {given!r})" if given is not None and not isinstance(given, dict) else ""
    return f"{flag}: {first['msg']}{given_text}: see --help for accepted values"


def run(argv: Sequence[str]) -> int:
    """Parse and run; return the exit code."""
    try:
        config_path, rest = _split_config_flag(list(argv))
        command, bound, _ = app.parse_args(rest, exit_on_error=False, print_error=False)
        if command is train and config_path is not None:
            from_flags = bound.arguments.get("config")
            flag_values = from_flags.model_dump(exclude_unset=True) if from_flags is not None else {}
            merged = _deep_merge(load_config_file(config_path), flag_values)
            bound.arguments["config"] = Config.model_validate(merged)
        command(*bound.args, **bound.kwargs)
    except ConfigError as err:
        return _fail(str(err))
    except pydantic.ValidationError as err:
        return _fail(describe_validation_error(err))
    except cyclopts.CycloptsError as err:
        cause = err.__cause__
        while cause is not None and not isinstance(cause, (pydantic.ValidationError, ConfigError)):
            cause = cause.__cause__
        if isinstance(cause, pydantic.ValidationError):
            return _fail(describe_validation_error(cause))
        if isinstance(cause, ConfigError):
            return _fail(str(cause))
        message = " ".join(str(err).split())
        return _fail(f"{message} (see --help)")
    except KeyboardInterrupt:
        print("open-diloco: interrupted", file=sys.stderr)
        return 130
    return 0


def _fail(message: str) -> int:
    print(f"open-diloco: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def main() -> None:
    """Console-script entry point (`open-diloco`)."""
    sys.exit(run(sys.argv[1:]))
