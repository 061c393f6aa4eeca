"""``open-diloco report``'s page in a real browser: headless Chromium (Debian's ``chromium``, installed when
missing, as the WAN lab installs nftables) renders the report of the committed 3-cluster partition fixture;
the test reads the DOM after scripts ran (not pixels) and Chromium's console log.

Without Chromium and no way to install it the test skips, except under CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from open_diloco.cli.app import run
from tests.conftest import REPO

FIXTURE = REPO / "tests" / "fixtures" / "report"
CUT_OFF = "2"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
]
CONSOLE = re.compile(r"^\[[^\]]*:CONSOLE[^\]]*\] (.*)$", re.M)
"""A console message in Chromium's log (``--enable-logging=stderr``). Chromium logs every console message at
level INFO whatever its level (``console.error`` and uncaught exceptions included), so the test asks for no
console message at all: the report's page logs none."""


def ensure_chromium() -> str | None:
    """The chromium binary, installed from Debian's packages when missing (root, apt-get); None when that
    fails."""
    found = shutil.which("chromium")
    if found or not shutil.which("apt-get") or os.geteuid() != 0:
        return found
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    # a fresh image may have no package lists yet: then fetch them and try again
    for commands in (
        [["apt-get", "install", "-y", "-q", "chromium"]],
        [["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "chromium"]],
    ):
        for command in commands:
            subprocess.run(command, capture_output=True, timeout=600, env=env)
        if shutil.which("chromium"):
            break
    return shutil.which("chromium")


@pytest.fixture(scope="module")
def chromium() -> str:
    binary = ensure_chromium()
    if binary is None:
        reason = "no chromium, and apt-get could not install it (Debian: apt-get install chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


def render(chromium: str, page: Path) -> tuple[str, str]:
    """The DOM of ``page`` after its scripts ran, and what Chromium logged."""
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [chromium, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, done.stderr


def test_the_cut_off_cluster_shows_in_the_browser(chromium, tmp_path):
    page = tmp_path / "report.html"
    assert run(["report", str(FIXTURE), "--output", str(page)]) == 0
    dom, log = render(chromium, page)
    assert CONSOLE.findall(log) == []
    cells = {
        (m["cluster"], int(m["round"])): (m["outcome"], m["galaxy"])
        for m in re.finditer(
            r'data-cluster="(?P<cluster>\d+)" data-round="(?P<round>\d+)" data-outcome="(?P<outcome>\w+)" '
            r'data-galaxy="(?P<galaxy>\w+)"',
            dom,
        )
    }
    assert len(cells) == 3 * 24
    # while cut off, cluster 2 trained on a state of its own: absent from the galaxy's rounds 7-12
    assert all(cells[(CUT_OFF, r)][1] == "apart" for r in range(7, 13)), cells
    # the heal: the others skipped the rounds it ran ahead by, then re-synced, and all rounds after are whole
    assert [cells[(c, r)] for c in "01" for r in (13, 14)] == [("absent", "absent")] * 4
    assert cells[("0", 15)][0] == cells[("1", 15)][0] == "resynced"
    assert all(cells[(c, r)] == ("applied", "with") for c in "012" for r in range(16, 25))
    assert "healed at round 16" in dom


def test_a_console_error_would_be_seen(chromium, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text('<html><body><script>console.error("boom"); missingFunction();</script></body></html>')
    _, log = render(chromium, page)
    messages = CONSOLE.findall(log)
    assert any("boom" in m for m in messages) and any("missingFunction" in m for m in messages), log[-3000:]
