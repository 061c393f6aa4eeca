"""The command line's shape: keyword-only training flags, readable grouped help, --version (no training)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import open_diloco
from open_diloco.cli import FLAG_PANELS, parse, run
from open_diloco.config import Config


@pytest.fixture
def help_text(capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "300")  # wide enough that no help sentence wraps
    assert run(["--help"]) == 0
    return capsys.readouterr().out


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("open-diloco: error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    "argv", [["foo", "--fake-data"], ["--fake-data", "foo"], ["--fake-data", "--lr", "1", "2"]]
)
def test_a_stray_word_is_refused_not_taken_as_a_flag_value(argv, capsys):
    assert run(argv) == 2
    stray = next(arg for arg in reversed(argv) if not arg.startswith("-") and arg != "1")
    line = one_error_line(capsys)
    assert f"unexpected argument {stray!r}" in line and "--path-model DIR" in line and "check-config" in line


def test_a_stray_word_after_a_command_names_that_command(capsys):
    assert run(["export", "ckpt", "out", "extra"]) == 2
    assert "unexpected argument 'extra' after export: see open-diloco export --help" in one_error_line(capsys)


@pytest.mark.parametrize(
    "argv, name, arguments",
    [
        (["check-config", "run.toml"], "check_config", {"path": "run.toml"}),
        (
            ["prepare-data", "data/*.txt", "packed"],
            "prepare_data",
            {"dataset_path": "data/*.txt", "output": "packed"},
        ),
        (["export", "ckpt/step_10", "hf"], "export", {"checkpoint_path": "ckpt/step_10", "out_dir": "hf"}),
        (
            ["preflight", "--", "--fake-data", "--lr", "0.1"],
            "preflight",
            {"trainer_args": ("--fake-data", "--lr", "0.1")},
        ),
    ],
)
def test_commands_keep_their_positionals(argv, name, arguments):
    command, bound = parse(argv)
    assert command.__name__ == name
    assert {key: bound.arguments[key] for key in arguments} == {
        key: value if isinstance(value, tuple) else Path(value) if key != "dataset_path" else value
        for key, value in arguments.items()
    }


def test_help_has_no_empty_flags(help_text):
    assert "--adam-betas" in help_text and "--empty-" not in help_text
    assert run(["--fake-data", "--empty-adam-betas"]) == 2


def test_help_groups_flags_in_panels(help_text):
    panels = re.findall(r"^╭─ (.+?) ─", help_text, re.MULTILINE)
    assert panels == ["Commands", *FLAG_PANELS], panels
    assert "Parameters" not in panels  # no flag left in cyclopts' catch-all panel


def test_every_config_field_has_one_panel():
    grouped = [name for names in FLAG_PANELS.values() for name in names]
    assert sorted(grouped) == sorted(Config.model_fields), (
        "add the new Config field to cli/app.py FLAG_PANELS"
    )


def test_help_reflows_field_docstrings(help_text):
    # HvConfig.initial_peers' docstring continues on an indented line; the indentation must not show.
    assert "Empty: this cluster starts its own DHT (fine for a galaxy of one" in help_text


def test_version_prints_one_line(capsys):
    assert run(["--version"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and re.fullmatch(r"open-diloco \S+ \(torch \S+, hivemind \S+\)", out[0]), out
    assert f"hivemind {importlib.metadata.version('hivemind')}" in out[0]


def test_version_from_a_source_checkout_reads_pyproject(monkeypatch):
    real_version = importlib.metadata.version

    def not_installed(package):
        if package == "open_diloco":
            raise importlib.metadata.PackageNotFoundError(package)
        return real_version(package)

    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(open_diloco.__file__).parent.parent / "pyproject.toml").read_text())
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert open_diloco.own_version() == pyproject["project"]["version"]
    monkeypatch.setattr(open_diloco, "__version__", open_diloco.own_version())
    assert open_diloco.version_line().startswith(f"open-diloco {pyproject['project']['version']} (torch ")


def test_help_follows_the_terminal_width_of_each_call(capsys, monkeypatch):
    # cyclopts kept the console of its first call, and that call's COLUMNS: under pytest-xdist a test that set
    # 80 made a later one's help wrap at 80 (2026-11-27)
    monkeypatch.setenv("COLUMNS", "80")
    assert run(["--help"]) == 0
    assert max(map(len, capsys.readouterr().out.splitlines())) <= 80
    monkeypatch.setenv("COLUMNS", "300")
    assert run(["--help"]) == 0
    assert max(map(len, capsys.readouterr().out.splitlines())) > 200


@pytest.mark.parametrize(
    "env, refused", [({"RANK": "0", "WORLD_SIZE": "2"}, True), ({"WORLD_SIZE": "2"}, False)]
)
def test_the_batch_is_checked_against_torchruns_world_before_the_trainer_loads(monkeypatch, env, refused):
    # under torchrun (RANK and WORLD_SIZE) a batch the ranks cannot split fails before the heavy imports; a
    # WORLD_SIZE left in a shell without RANK is not torchrun's (world.launcher_env): one process, no refusal
    from open_diloco.cli.train import train
    from open_diloco.errors import ConfigError

    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "PBS_JOBID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    config = Config(
        path_model=Path("tests/models/llama-1m-fresh"),
        fake_data=True,
        total_batch_size=4,
        per_device_train_batch_size=4,
    )
    loaded = []
    monkeypatch.setattr("open_diloco.trainer.train", loaded.append)
    if refused:
        with pytest.raises(ConfigError, match="not divisible by --per-device-train-batch-size 4 x 2 ranks"):
            train(config=config)
        assert not loaded
    else:
        train(config=config)
        assert loaded == [config]
