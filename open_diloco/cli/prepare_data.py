"""``open-diloco prepare-data DATASET OUTPUT``: tokenize and pack a corpus once, for ``--dataset-path``."""

from __future__ import annotations

from pathlib import Path

from open_diloco.errors import ConfigError
from open_diloco.output_paths import ensure_writable_dir


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
