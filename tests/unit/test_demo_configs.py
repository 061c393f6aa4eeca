"""configs/demo-2m.toml and configs/demo-2m.yaml are the same run, and every shipped config validates."""

from __future__ import annotations

import json

import pytest

from open_diloco.cli import run
from tests.conftest import REPO

CONFIGS = sorted(p for ext in ("toml", "yaml", "yml", "json") for p in (REPO / "configs").glob(f"*.{ext}"))


def resolved(capsys, path) -> dict:
    assert run(["check-config", str(path)]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_demo_toml_and_yaml_are_the_same_config(capsys):
    toml, yaml = (
        resolved(capsys, REPO / "configs/demo-2m.toml"),
        resolved(capsys, REPO / "configs/demo-2m.yaml"),
    )
    assert toml == yaml
    assert (
        toml["fake_data"]
        and toml["path_model"] == "tests/models/llama-2m-fresh"
        and not toml["torch_compile"]
    )
    assert (REPO / toml["path_model"] / "config.json").is_file()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(capsys, path):
    resolved(capsys, path)
