"""The shell launchers parse and pass shellcheck; the Dockerfile passes hadolint (tools from the dev extra);
no Python file or function is over its size limit."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SHELL_SCRIPTS = sorted(
    p
    for pattern in ("scripts/**/*.sh", "scripts/**/*.sbatch", "scripts/**/*.pbs")
    for p in REPO.glob(pattern)
)
# The cluster launchers are held to every shellcheck level; other scripts to warnings and errors.
LAUNCHERS = {
    "scripts/cluster_train.sh",
    "scripts/slurm/cluster.sbatch",
    "scripts/slurm/dht.sbatch",
    "scripts/pbs/cluster.pbs",
}


def tool(name: str) -> str:
    """The dev-extra tool next to this interpreter, else on PATH, else skip."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def test_launchers_exist():
    assert LAUNCHERS <= {p.relative_to(REPO).as_posix() for p in SHELL_SCRIPTS}


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_shell_script_parses_and_passes_shellcheck(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    severity = "style" if script.relative_to(REPO).as_posix() in LAUNCHERS else "warning"
    proc = subprocess.run(
        [tool("shellcheck"), "--shell=bash", f"--severity={severity}", str(script)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([tool("hadolint"), str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def docker_daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0


@pytest.mark.slow
def test_docker_image_builds_and_runs():
    if not docker_daemon():
        pytest.skip("no Docker daemon reachable")
    tag = "open-diloco:test"
    subprocess.run(["docker", "build", "-t", tag, str(REPO)], check=True, timeout=1800)
    for args in (["check-config", "configs/demo-2m.toml"], ["--entrypoint", "hivemind-dht", tag, "--help"]):
        cmd = ["docker", "run", "--rm", *(args if args[0] == "--entrypoint" else [tag, *args])]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)


MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
SIZED_TREES = ("open_diloco", "scripts", "tests")
LONGER_FILES = {
    "open_diloco/outer/round.py": (
        "one round from its start to its end, read top to bottom: split, its phases would be spread over "
        "files that restate each other's attributes (the mixins it replaced)"
    ),
}
"""Files allowed over MAX_FILE_LINES, each with its reason (issue 48: a cohesive module beats a class split
across files)."""


def oversized(path: Path) -> list[str]:
    """The file if it is over MAX_FILE_LINES lines, and each def/async def in it (nested ones too) over
    MAX_FUNCTION_LINES, counted from its ``def`` line to its last line."""
    source = path.read_text()
    name = path.relative_to(REPO).as_posix()
    found = []
    if (lines := len(source.splitlines())) > MAX_FILE_LINES and name not in LONGER_FILES:
        found.append(f"{name}: {lines} lines")
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}(): {length} lines")
    return found


def test_no_source_file_over_400_lines_and_no_function_over_80():
    paths = sorted(p for top in SIZED_TREES for p in (REPO / top).rglob("*.py"))
    assert paths, "no Python files found"
    found = [line for path in paths for line in oversized(path)]
    assert not found, (
        f"over {MAX_FILE_LINES} lines a file, {MAX_FUNCTION_LINES} a function; split along a real seam "
        "(a module that owns one thing, a helper named for what it does):\n" + "\n".join(found)
    )
