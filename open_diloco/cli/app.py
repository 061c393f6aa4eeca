"""The ``open-diloco`` app: its help panels, parsing argv (with ``--config FILE``) to a command, running it,
and turning every user error into one line.

Every user error — an unknown flag, a bad value, a config check — ends as one line on stderr naming the
problem and the fix, and exit code 2, on every rank, before any rank waits on another. The commands live in
their own modules and are registered with :data:`app` by ``open_diloco/cli/__init__.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import cyclopts
import pydantic
from cyclopts import Parameter

from open_diloco import version_line
from open_diloco.cli.config_files import config_file_provider, split_config_flag
from open_diloco.config import Config
from open_diloco.errors import ConfigError, OpenDilocoError

EXIT_USAGE = 2

# Help panels for the training flags, in the order of Config's sections (config/run.py). The grouping is
# presentation only, so it lives here rather than on every field of Config; a unit test checks every field has
# a panel.
FLAG_PANELS: dict[str, tuple[str, ...]] = {
    "Model": ("path_model", "seq_length"),
    "Batch and optimizer": (
        "per_device_train_batch_size",
        "total_batch_size",
        "lr",
        "warmup_steps",
        "total_steps",
        "min_lr_ratio",
        "weight_decay",
        "adam_betas",
        "max_grad_norm",
        "max_steps",
        "seed",
    ),
    "Data": (
        "fake_data",
        "dataset_path",
        "dataset_text_field",
        "path_tokenizer",
        "data_cache_dir",
        "num_workers",
        "eval_interval",
        "eval_samples",
    ),
    "Performance": (
        "precision",
        "torch_compile",
        "activation_checkpointing",
        "gc_interval",
        "device",
        "backend",
        "dry_run",
    ),
    "Logging": ("metric_logger_type", "metrics_path", "project", "run_name", "log_interval", "sample_log"),
    "Galaxy (--hv.*; any of them turns DiLoCo on)": ("hv",),
    "Checkpoints (--ckpt.*)": ("ckpt",),
}


def _put_flags_in_panels() -> None:
    """Attach each Config field's help panel the way cyclopts reads it (a Parameter in the field's metadata);
    a nested model's panel covers all its flags."""
    for panel_name, field_names in FLAG_PANELS.items():
        panel = cyclopts.Group.create_ordered(panel_name)
        for name in field_names:
            Config.model_fields[name].metadata.append(Parameter(group=panel))


_put_flags_in_panels()

app = cyclopts.App(
    name="open-diloco",
    help="Decentralized multi-cluster LLM training: DiLoCo over hivemind, FSDP2 inside each cluster.\n\n"
    "Flags may also come from a file: --config FILE (TOML, YAML or JSON; keys are the flag names, `hv` and "
    "`ckpt` as tables). Flags on the command line override the file.",
    # Markdown reflows the field docstrings' continuation lines (plaintext kept their indentation).
    help_format="markdown",
    # cyclopts offers `--empty-FLAG` for every list or tuple flag; ours have no use for it.
    default_parameter=Parameter(negative_iterable=()),
    version=version_line,
    version_flags=["--version"],
    version_format="plaintext",
)


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


def _command_names() -> list[str]:
    return sorted(name for name in app if not name.startswith("-"))


def describe_unused_tokens(err: cyclopts.UnusedCliTokensError) -> str:
    """One line for words left over after parsing: a value without its flag, or a misspelt command."""
    word = err.unused_tokens[0] if err.unused_tokens else ""
    if err.command_chain:
        command = " ".join(err.command_chain)
        return (
            f"unexpected argument {word!r} after {command}: see open-diloco {command} --help for its "
            "arguments"
        )
    return (
        f"unexpected argument {word!r}: training takes only --flags, each value after its flag "
        f"(e.g. --path-model DIR); the commands are {', '.join(_command_names())}"
    )


def describe_error(err: ConfigError | pydantic.ValidationError | cyclopts.CycloptsError) -> str:
    """One line for a user error from any layer: our checks, pydantic, cyclopts' flag parsing."""
    if isinstance(err, ConfigError):
        return str(err)
    if isinstance(err, pydantic.ValidationError):
        return describe_validation_error(err)
    cause = err.__cause__
    while cause is not None and not isinstance(cause, (pydantic.ValidationError, ConfigError)):
        cause = cause.__cause__
    if isinstance(cause, (pydantic.ValidationError, ConfigError)):
        return describe_error(cause)
    if isinstance(err, cyclopts.UnusedCliTokensError):
        return describe_unused_tokens(err)
    token = getattr(err, "token", None)
    if isinstance(err, cyclopts.UnknownOptionError) and token is not None and token.source not in ("", "cli"):
        key = token.keyword.strip("[]").replace("][", ".")
        return (
            f"config file {token.source}: unknown key {key!r}: keys are the flag names without `--` "
            "(see --help), `hv` and `ckpt` as tables"
        )
    return " ".join(str(err).split()) + " (see --help)"


def parse(argv: Sequence[str]) -> tuple[Any, Any]:
    """Resolve argv to ``(command, bound arguments)``; ``--config FILE`` values sit under the flags."""
    config_path, rest = split_config_flag(list(argv))
    app.config = [config_file_provider(config_path)] if config_path is not None else []
    # a console per call: cyclopts keeps the first one it makes, and with it the terminal width (COLUMNS) of
    # that moment
    from rich.console import Console

    command, bound, _ = app.parse_args(rest, console=Console(), exit_on_error=False, print_error=False)
    if config_path is not None and not is_training(command):
        raise ConfigError(
            "--config belongs to training: check-config takes the file as its argument, "
            "preflight after its `--`"
        )
    return command, bound


def is_training(command: Any) -> bool:
    """``command`` (what :func:`parse` returned) is training, the app's default command."""
    return command is app.default_command


def run(argv: Sequence[str]) -> int:
    """Parse and run; return the exit code."""
    try:
        command, bound = parse(argv)
        command(*bound.args, **bound.kwargs)
    except (ConfigError, pydantic.ValidationError, cyclopts.CycloptsError) as err:
        return _fail(describe_error(err))
    except OpenDilocoError as err:  # the galaxy cannot go on: one line, not a traceback
        return _fail(str(err), err.exit_code)
    except KeyboardInterrupt:
        print("open-diloco: interrupted", file=sys.stderr)
        return 130
    return 0


def _fail(message: str, exit_code: int = EXIT_USAGE) -> int:
    print(f"open-diloco: error: {message}", file=sys.stderr, flush=True)
    return exit_code


def main() -> None:
    """Console-script entry point (`open-diloco`)."""
    sys.exit(run(sys.argv[1:]))
