"""The README stays a guide and the docs stay connected: README length, every relative link (and its #anchor)
resolves, the repository paths the docs name exist, and the README's quick-start commands name files that
exist and flags the trainer accepts. Fast: no network, no processes (running the quick-start torchrun itself
takes about a minute on 2 cores; tests/dist runs the same trainer)."""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").rglob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 300

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
# repository paths named in the docs (in code spans or prose): scripts/..., open_diloco/..., tests/...
REPO_PATH = re.compile(r"(?<![\w./-])((?:scripts|open_diloco|tests|configs/models)/[\w./-]*[\w/])")


def ids(pages: list[Path]) -> list[str]:
    return [p.relative_to(REPO).as_posix() for p in pages]


def prose(text: str) -> str:
    """Text outside fenced code blocks, with inline code spans removed (their brackets are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def section(text: str, title: str) -> str:
    """The body of the `## title` section of a markdown text."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no section '## {title}'"
    return match.group(1)


def commands(block_text: str) -> list[list[str]]:
    """The shell commands of the ```bash blocks in a text: continuation lines joined, comments dropped."""
    found = []
    for block in re.findall(r"^```bash\n(.*?)^```", block_text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


def test_readme_is_a_guide_not_a_report():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/"
    )


@pytest.mark.parametrize("page", PAGES, ids=ids(PAGES))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(
                f"{target} (no {resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else resolved})"
            )
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def exists(path: str) -> bool:
    """A path of the repository, or a module's attribute written as one
    (`tests/e2e/galaxy_harness.Galaxy`)."""
    path = path.rstrip("/")
    return (REPO / path).exists() or (REPO / re.sub(r"\.\w+$", ".py", path)).is_file()


@pytest.mark.parametrize("page", PAGES, ids=ids(PAGES))
def test_repository_paths_named_exist(page):
    text = FENCE.sub(
        lambda m: "\n".join(ln.split("#")[0] for ln in m.group(0).splitlines()), page.read_text()
    )
    missing = sorted({p for p in REPO_PATH.findall(text) if not exists(p)})
    assert not missing, f"{page.relative_to(REPO)} names paths that do not exist: {missing}"


def test_the_two_commands_are_the_ci_command_and_the_demo():
    two = commands(section(README.read_text(), "The two commands"))
    assert two == [["bash", "scripts/demo.sh"], ["bash", "scripts/test.sh"]]
    assert all((REPO / words[1]).is_file() for words in two)
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def executable(name: str) -> bool:
    return (Path(sys.executable).parent / name).exists() or shutil.which(name) is not None


def quick_start_commands() -> list[tuple[str, list[str]]]:
    text = README.read_text()
    return [
        (title, words)
        for title in ("Quick start: one cluster", "Quick start: a galaxy")
        for words in commands(section(text, title))
    ]


def test_quick_start_blocks_name_files_that_exist():
    cwd = REPO / "open_diloco"  # the quick start runs from inside open_diloco/, as it says
    assert "inside `open_diloco/`" in section(README.read_text(), "Quick start: one cluster")
    seen_scripts = 0
    for title, words in quick_start_commands():
        assert executable(words[0]), f"{title}: {words[0]} is not installed next to {sys.executable}"
        for i, word in enumerate(words):
            if word.endswith(".py"):
                assert (cwd / word).is_file(), f"{title}: {word} does not exist in open_diloco/"
                seen_scripts += 1
            if word == "--path-model":
                model = cwd / words[i + 1]
                assert (model / "config.json").is_file(), (
                    f"{title}: --path-model {words[i + 1]} has no config.json"
                )
    assert seen_scripts >= 3


def trainer_flags(words: list[str]) -> list[str] | None:
    """The flags a quick-start torchrun line gives the trainer; None when the line elides some (`...`)."""
    if words[0] != "torchrun" or "..." in words:
        return None
    flags = words[[w.endswith(".py") for w in words].index(True) + 1 :]
    # the README's placeholder for the PeerID hivemind-dht prints: any well-formed one parses the same way
    return [w.replace("/p2p/Qm...", "/p2p/QmagjJLRAPuA3dYGRvKJLdZahHz66hHyTkNKHgg3vXnhK3") for w in flags]


def test_quick_start_trainer_flags_parse(monkeypatch):
    from open_diloco.cli import parse
    from open_diloco.cli.train import train

    monkeypatch.chdir(REPO / "open_diloco")
    parsed = 0
    for title, words in quick_start_commands():
        flags = trainer_flags(words)
        if flags is None:
            continue
        command, bound = parse(flags)
        assert command is train, f"{title}: {flags} is not a training command"
        config = bound.arguments["config"]
        assert config.path_model.joinpath("config.json").is_file(), f"{title}: {config.path_model}"
        parsed += 1
    assert parsed == 2, "expected the one-cluster and the first galaxy torchrun line"


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's module layout matches the tree: every module of the package is named there (as
    `name`, `package/name` or name.py), so a new module comes with its line and a removed one is noticed."""
    text = (REPO / "docs" / "architecture.md").read_text()
    package = REPO / "open_diloco"
    unnamed = []
    for path in sorted(package.rglob("*.py")):
        if path.name.startswith("__"):
            continue
        relative = path.relative_to(package).with_suffix("").as_posix()
        names = (f"`{path.stem}`", f"`{relative}`", f"{path.stem}.py")
        if not any(name in text for name in names):
            unnamed.append(relative)
    assert not unnamed, f"docs/architecture.md does not name these modules: {unnamed}"
