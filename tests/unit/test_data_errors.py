"""Every bad data input ends as one line `open-diloco: error: ...` and exit code 2, before any rank waits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from open_diloco.cli import run
from tests.data_corpus import TINY_MODEL, TRAIN_SCRIPT, jsonl_file, offline_env, text_dir, tokenizer_dir

FLAGS = [
    "--path-model",
    str(TINY_MODEL),
    "--no-torch-compile",
    "--max-steps",
    "1",
    "--seq-length",
    "64",
    "--per-device-train-batch-size",
    "1",
    "--total-batch-size",
    "1",
]


def _empty_dir(tmp: Path) -> list[str]:
    (tmp / "empty").mkdir()
    return ["--dataset-path", str(tmp / "empty")]


def _broken_link(tmp: Path) -> list[str]:
    data = text_dir(tmp, 2)
    (data / "gone.py").symlink_to(tmp / "does-not-exist.py")
    return ["--dataset-path", str(data)]


def _corrupt_parquet(tmp: Path) -> list[str]:
    (tmp / "bad.parquet").write_bytes(b"not a parquet file")
    return ["--dataset-path", str(tmp / "bad.parquet")]


def _jsonl_without_field(tmp: Path) -> list[str]:
    return ["--dataset-path", str(jsonl_file(tmp, 2, field="content"))]


def _field_missing_later(tmp: Path) -> list[str]:
    path = tmp / "late.jsonl"
    path.write_text(json.dumps({"text": "ok " * 100}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    return ["--dataset-path", str(path)]


def _too_small(tmp: Path) -> list[str]:
    (tmp / "tiny").mkdir()
    (tmp / "tiny" / "a.txt").write_text("x" * 100)
    return ["--dataset-path", str(tmp / "tiny")]


def _tokenizer_missing(tmp: Path) -> list[str]:
    return ["--dataset-path", str(text_dir(tmp, 2)), "--path-tokenizer", str(tmp / "no-such-tokenizer")]


def _tokenizer_too_big(tmp: Path) -> list[str]:
    return ["--dataset-path", str(text_dir(tmp, 2)), "--path-tokenizer", str(tokenizer_dir(tmp, 3000))]


CASES = {
    "empty_dir": (_empty_dir, "holds no files"),
    "unreadable_file": (_broken_link, "cannot read"),
    "corrupt_parquet": (_corrupt_parquet, "cannot read"),
    "no_text_field": (_jsonl_without_field, "no text field 'text' (found: content, id)"),
    "field_missing_in_a_later_record": (_field_missing_later, "a record has no text field"),
    "corpus_smaller_than_one_sequence_per_rank": (_too_small, "fewer than one per rank"),
    "tokenizer_path_missing": (_tokenizer_missing, "--path-tokenizer"),
    "tokenizer_larger_than_model_vocab": (
        _tokenizer_too_big,
        "has 3000 ids but the model's vocab_size is 2048",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, case: str) -> None:
    make, expected = CASES[case]
    code = run([*FLAGS, "--data-cache-dir", str(tmp_path / "cache"), *make(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("open-diloco: error: ")]
    assert code == 2
    # One error line, last; a corpus found too small only after packing may be preceded by the packing
    # summary.
    assert len(errors) == 1 and lines[-1] == errors[0] and expected in errors[0], lines
    assert all(line.startswith("packed ") for line in lines[:-1]), lines


def test_entry_point_exits_2_with_one_line(tmp_path: Path) -> None:
    args = [*FLAGS, *_empty_dir(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), *args],
        capture_output=True,
        text=True,
        env=offline_env(),
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"open-diloco: error: --dataset-path {tmp_path / 'empty'} holds no files: "
        "point it at a directory or glob with data files"
    ]
