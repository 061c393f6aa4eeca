"""``open-diloco export CHECKPOINT OUT_DIR``: a checkpoint as a transformers model directory."""

from __future__ import annotations

from pathlib import Path

from open_diloco.output_paths import ensure_empty_output_dir


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

    # a bad checkpoint fails before OUT_DIR is made
    read_metadata(checkpoint_path, checked_by="CHECKPOINT-PATH")
    ensure_empty_output_dir(out_dir, "OUT-DIR", force)
    print(f"exported {checkpoint_path} to {export_pretrained(checkpoint_path, out_dir)}")
