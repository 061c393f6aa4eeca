"""Reading a running cluster's jsonl metrics: only whole lines count."""

from __future__ import annotations

import json

from open_diloco.local_galaxy import read_metrics
from open_diloco.metrics import JsonlMetrics


def test_a_half_written_last_line_is_left_for_the_next_read(tmp_path):
    path = tmp_path / "cluster0.jsonl"
    metrics = JsonlMetrics(path, {"run_name": "cluster0"})
    for step in (1, 2):
        metrics.log({"step": step, "loss": 2.0 / step})
    metrics.close()
    whole = path.read_text()
    third = json.dumps({"time": 0.0, "step": 3, "loss": 0.5}) + "\n"
    path.write_text(whole + third[:30])  # what a read saw while the trainer wrote (a WAN test, 2026-11-29)
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text(whole + third)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
