"""open_diloco: DiLoCo over hivemind across clusters, FSDP2 inside each.

The version lives here, at the root every module may import, so that whoever reports it (``open-diloco
--version``, the status record a cluster publishes) needs neither the CLI nor the trainer.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path


def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def own_version() -> str:
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


__version__ = own_version()


def version_line() -> str:
    """``open-diloco VERSION (torch X, hivemind Y)``: what a bug report needs, read from package metadata so
    that neither torch nor hivemind is imported."""
    return f"open-diloco {__version__} (torch {_installed('torch')}, hivemind {_installed('hivemind')})"
