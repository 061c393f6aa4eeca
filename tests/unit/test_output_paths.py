"""Paths a run or a command writes are checked before any work: one line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest

from open_diloco.cli import run
from open_diloco.output_paths import ensure_appendable_file, ensure_empty_output_dir, ensure_writable_dir

TRAIN = [
    "--fake-data",
    "--path-model",
    "tests/models/llama-2m-fresh",
    "--no-torch-compile",
    "--max-steps",
    "1",
]


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("open-diloco: error: "), lines
    return lines[0]


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("keep me")
    return path


def test_writable_dir_is_created_and_left_clean(tmp_path):
    target = tmp_path / "a" / "b"
    assert ensure_writable_dir(target, "--ckpt.path") == target
    assert target.is_dir() and list(target.iterdir()) == []


def test_a_file_where_a_directory_belongs_is_refused(a_file):
    with pytest.raises(ValueError, match=f"--ckpt.path {a_file} is a file, not a directory"):
        ensure_writable_dir(a_file, "--ckpt.path")
    with pytest.raises(ValueError, match=r"cannot be written \(Not a directory\)"):
        ensure_writable_dir(a_file / "sub", "--ckpt.path")


def test_appendable_file_keeps_what_is_there(tmp_path, a_file):
    ensure_appendable_file(a_file, "--metrics-path")
    assert a_file.read_text() == "keep me"
    with pytest.raises(ValueError, match=f"--metrics-path {tmp_path} is a directory"):
        ensure_appendable_file(tmp_path, "--metrics-path")
    with pytest.raises(ValueError, match="its directory .* is a file"):
        ensure_appendable_file(a_file / "m.jsonl", "--metrics-path")


def test_output_dir_must_be_empty_unless_forced(tmp_path, a_file):
    ensure_empty_output_dir(tmp_path / "new", "OUT-DIR", force=False)
    with pytest.raises(ValueError, match="is not empty: choose a new directory, or pass --force"):
        ensure_empty_output_dir(tmp_path, "OUT-DIR", force=False)
    ensure_empty_output_dir(tmp_path, "OUT-DIR", force=True)
    assert a_file.read_text() == "keep me"


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--metric-logger-type", "jsonl", "--metrics-path", "{file}/m.jsonl"],
            "--metrics-path {file}/m.jsonl: its directory",
        ),
        (["--metric-logger-type", "jsonl", "--metrics-path", "{tmp}"], "--metrics-path {tmp} is a directory"),
        (["--ckpt.interval", "1", "--ckpt.path", "{file}"], "--ckpt.path {file} is a file, not a directory"),
        (["--ckpt.interval", "1", "--ckpt.path", "{file}/ckpt"], "--ckpt.path {file}/ckpt cannot be written"),
    ],
)
def test_training_outputs_that_cannot_be_written_stop_it_before_it_starts(
    tmp_path, a_file, flags, message, capsys
):
    fill = {"file": a_file, "tmp": tmp_path}
    assert run([*TRAIN, *(f.format(**fill) for f in flags)]) == 2
    assert message.format(**fill) in one_error_line(capsys)
    assert a_file.read_text() == "keep me"


def test_a_data_cache_that_cannot_be_written_is_one_line(tmp_path, a_file, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello world " * 50)
    argv = [
        "--dataset-path",
        str(tmp_path / "docs"),
        "--data-cache-dir",
        str(a_file / "cache"),
        "--no-torch-compile",
    ]
    assert run(argv) == 2
    assert f"--data-cache-dir {a_file}/cache cannot be written" in one_error_line(capsys)


def test_prepare_data_into_an_unwritable_place_is_one_line(tmp_path, a_file, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello")
    assert run(["prepare-data", str(tmp_path / "docs"), str(a_file / "packed")]) == 2
    assert f"OUTPUT {a_file}/packed: its directory {a_file} is a file" in one_error_line(capsys)


def test_export_never_writes_into_a_non_empty_directory_unless_forced(tmp_path, a_file, capsys):
    checkpoint = tmp_path / "step_00000001"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(b"")
    (checkpoint / "metadata.json").write_text(json.dumps({"format": 1}))
    assert run(["export", str(checkpoint), str(tmp_path)]) == 2
    assert f"OUT-DIR {tmp_path} is not empty: choose a new directory, or pass --force" in one_error_line(
        capsys
    )
    assert run(["export", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "does not exist: check CHECKPOINT-PATH" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()
    assert a_file.read_text() == "keep me"
