"""Command line: parse flags (and an optional config file) into a :class:`Config` and run a command.

Every user error — an unknown flag, a bad value, a config check — ends as one line on stderr naming the
problem and the fix, and exit code 2, on every rank, before any rank waits on another.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import cyclopts
import pydantic
from cyclopts import Parameter, validators

from open_diloco.config import Config
from open_diloco.errors import ConfigError, OpenDilocoError
from open_diloco.output_paths import ensure_empty_output_dir, ensure_writable_dir

EXIT_USAGE = 2

# Help panels for the training flags, in the order of config.py's sections. The grouping is presentation
# only, so it lives here rather than on every field of Config; a unit test checks every field has a panel.
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
        "eval_steps",
    ),
    "Performance": ("precision", "torch_compile", "activation_checkpointing", "device", "backend"),
    "Logging": ("metric_logger_type", "metrics_path", "project", "run_name", "log_interval"),
    "Galaxy (--hv.*; any of them turns DiLoCo on)": ("hv",),
    "Checkpoints (--ckpt.*)": ("ckpt",),
}


def version_line() -> str:
    """``open-diloco VERSION (torch X, hivemind Y)``: what a bug report needs, read from package metadata so
    that neither torch nor hivemind is imported."""
    return f"open-diloco {_own_version()} (torch {_installed('torch')}, hivemind {_installed('hivemind')})"


def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _own_version() -> str:
    """The installed package's version; from a source checkout that is not installed, pyproject.toml's."""
    try:
        return importlib.metadata.version("open_diloco")
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if not pyproject.is_file():
        return "unknown"
    # A regex rather than tomllib, which Python 3.10 lacks; the first `version =` is [project]'s.
    found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
    return found.group(1) if found else "unknown"


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


@app.default
def train(*, config: Config | None = None) -> None:
    """Train one cluster (run under torchrun for several ranks)."""
    # `config` is keyword-only so that its fields are flags only: as positionals, a stray word (`open-diloco
    # foo --fake-data`) would silently become --path-model.
    from open_diloco.trainer import train as run_training  # heavy imports only when training

    run_training(config if config is not None else Config())


@app.command(name="check-config")
def check_config(path: Path) -> None:
    """Validate a config file (TOML, YAML or JSON) and print the resolved configuration."""
    _, bound = parse(["--config", str(path)])
    config = bound.arguments.get("config") or Config()
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
    ensure_writable_dir(output.parent, f"OUTPUT {output}: its directory")
    tokenizer = load_tokenizer(path_tokenizer)
    source = find_source(dataset_path, dataset_text_field)
    corpus = pack_corpus(source, dataset_text_field, tokenizer, output)
    print(f"wrote {output} ({corpus.dtype} tokens, tokenizer {corpus.tokenizer}): pass it as --dataset-path")


@app.command(name="export")
def export(checkpoint_path: Path, out_dir: Path, *, force: bool = False) -> None:
    """Write a checkpoint as a transformers model directory (config.json + model.safetensors).

    Parameters
    ----------
    checkpoint_path
        A checkpoint directory (`step_<N>` under --ckpt.path).
    out_dir
        Directory to write; absent or empty unless --force.
    force
        Write into OUT-DIR even if it holds files (same-named files are replaced).
    """
    from open_diloco.checkpoint import export_pretrained, read_metadata

    read_metadata(
        checkpoint_path, checked_by="CHECKPOINT-PATH"
    )  # a bad checkpoint fails before OUT_DIR is made
    ensure_empty_output_dir(out_dir, "OUT-DIR", force)
    print(f"exported {checkpoint_path} to {export_pretrained(checkpoint_path, out_dir)}")


@app.command(name="preflight")
def preflight(
    *trainer_args: str,
    num_nodes: Annotated[int, Parameter(validator=validators.Number(gte=1))] = 1,
    node_rank: Annotated[int, Parameter(validator=validators.Number(gte=0))] = 0,
    master_addr: str = "127.0.0.1",
    master_port: Annotated[int, Parameter(validator=validators.Number(gte=1, lte=65535))] = 29500,
    nproc_per_node: Annotated[int, Parameter(validator=validators.Number(gte=1))] = 1,
    timeout: Annotated[float, Parameter(validator=validators.Number(gt=0))] = 5.0,
    master_wait: Annotated[float, Parameter(validator=validators.Number(gte=0))] = 60.0,
) -> None:
    """Check that this node can launch its part of a cluster: one PASS/FAIL line per check, exit 1 on a failure.

    Usage: open-diloco preflight [OPTIONS] -- TRAINER_FLAGS, where TRAINER_FLAGS are the flags torchrun will
    give the trainer (e.g. --config configs/demo-2m.toml --hv.initial-peers ...). scripts/cluster_train.sh
    runs this before it starts torchrun.

    Parameters
    ----------
    trainer_args
        The trainer's flags, after `--`.
    num_nodes
        Nodes in this cluster. [range: ≥ 1]
    node_rank
        This node's rank (0 hosts the rendezvous; the others must reach it). [range: 0 ≤ x < num-nodes]
    master_addr
        Host of node_rank 0.
    master_port
        Rendezvous port on master_addr. [range: 1 ≤ x ≤ 65535]
    nproc_per_node
        Ranks this node will start. [range: ≥ 1]
    timeout
        Seconds each network check may take. [range: > 0]
    master_wait
        Seconds a node_rank > 0 waits for the master to listen (nodes start together and node 0 runs its own
        preflight first). [range: ≥ 0]
    """
    from open_diloco.preflight import EXIT_FAILED, Launch, build_checks, run_checks

    if node_rank >= num_nodes:
        raise ConfigError(
            f"--node-rank {node_rank} is not below --num-nodes {num_nodes}: use 0..{num_nodes - 1}"
        )
    launch = Launch(num_nodes, node_rank, master_addr, master_port, nproc_per_node)

    def load_config() -> Config:
        try:
            command, bound = parse(trainer_args)
        except (pydantic.ValidationError, cyclopts.CycloptsError) as err:
            raise ConfigError(describe_error(err)) from None
        if command is not train:
            raise ConfigError(
                f"expected the trainer's flags after `--`, got the subcommand {trainer_args[0]!r}"
            )
        return bound.arguments.get("config") or Config()

    if not run_checks(
        build_checks(load_config, launch, timeout, master_wait), lambda line: print(line, flush=True)
    ):
        sys.exit(EXIT_FAILED)


@app.command(name="identity")
def identity(
    path: Path,
    /,
    *,
    ranks: Annotated[int, Parameter(validator=validators.Number(gte=1))] = 1,
) -> None:
    """Make a cluster's key files (those missing) and print its PeerIDs as --hv.allowlist lines.

    Run it once per cluster, keep PATH private (it holds the private keys) and pass it to that cluster's
    ranks as --hv.identity-path; send the printed lines to the other clusters for their --hv.allowlist files.

    Parameters
    ----------
    path
        The cluster's identity directory (--hv.identity-path); made if missing.
    ranks
        How many ranks the cluster runs (its torchrun world size): one key, one PeerID per rank. [range: ≥ 1]
    """
    from open_diloco.galaxy.allowlist import ensure_identity

    for rank in range(ranks):
        print(f"{ensure_identity(path, rank)}  # {path} rank {rank}")


@app.command(name="status")
def status(
    *,
    initial_peers: Annotated[list[str], Parameter(consume_multiple=True, negative=())],
    run_id: str = "open_diloco",
    watch: bool = False,
    interval: Annotated[float, Parameter(validator=validators.Number(gt=0))] = 5.0,
    json_output: Annotated[bool, Parameter(name="--json")] = False,
    timeout: Annotated[float, Parameter(validator=validators.Number(gt=0))] = 10.0,
    galaxy_size: Annotated[int | None, Parameter(validator=validators.Number(gte=1))] = None,
) -> None:
    """Show every cluster of a galaxy: steps, θ_outer hash, round times, and who is behind, silent or split.

    Joins the DHT as a client (it never takes part in a round) and reads the record each cluster's rank 0
    refreshes there every --hv.heartbeat-interval and after every round. Exit 1 when no cluster of the run
    has a record.

    Parameters
    ----------
    initial_peers
        Multiaddr(s) of a DHT peer of the galaxy (the line `hivemind-dht` printed).
    run_id
        The galaxy's --hv.run-id.
    watch
        Refresh every --interval seconds until Ctrl+C.
    interval
        Seconds between refreshes with --watch. [range: > 0]
    json_output
        Print a JSON array, one object per cluster (keys: open_diloco/status_view.py JSON_KEYS), instead of
        the table; with --watch, one array per line.
    timeout
        Seconds to join the DHT and to read it. [range: > 0]
    galaxy_size
        The galaxy's --hv.galaxy-size, to show how many clusters are missing. [range: ≥ 1]
    """
    import time

    from open_diloco.addresses import peer_address

    for maddr in initial_peers:
        peer_address(maddr, "--initial-peers")
    from rich.console import Console

    from open_diloco.galaxy.status import StatusReader
    from open_diloco.status_view import as_json_rows, build_table, judge

    try:
        reader = StatusReader(initial_peers, run_id, timeout)
    except ConfigError:
        raise ConfigError(
            f"no DHT peer answered at --initial-peers {' '.join(initial_peers)} within {timeout}s: check the "
            "address (the line hivemind-dht printed) and that the galaxy's DHT runs"
        ) from None
    console = Console() if sys.stdout.isatty() else Console(width=200)  # a log or a pipe: cut no column
    with reader:
        while True:
            rows = judge(reader.read())
            if json_output:
                print(json.dumps(as_json_rows(rows)), flush=True)
            elif rows:
                if watch:
                    console.clear()
                console.print(build_table(rows, run_id, galaxy_size))
            if not watch:
                break
            time.sleep(interval)
    if not rows:
        raise StatusEmpty(
            f"no cluster of run {run_id!r} has a status record in this DHT: check --run-id (the galaxy's "
            "--hv.run-id) and that its clusters have started"
        )


class StatusEmpty(OpenDilocoError):
    """``open-diloco status`` found nobody: exit 1, as a monitoring script expects of an empty galaxy."""


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


def _split_config_flag(argv: list[str]) -> tuple[Path | None, list[str]]:
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
        return f"unexpected argument {word!r} after {command}: see open-diloco {command} --help for its arguments"
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
    config_path, rest = _split_config_flag(list(argv))
    app.config = [config_file_provider(config_path)] if config_path is not None else []
    command, bound, _ = app.parse_args(rest, exit_on_error=False, print_error=False)
    if config_path is not None and command is not train:
        raise ConfigError(
            "--config belongs to training: check-config takes the file as its argument, "
            "preflight after its `--`"
        )
    return command, bound


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
