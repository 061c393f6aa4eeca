"""hivemind's own log lines show from WARNING up unless the operator asks for more."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import logging
import open_diloco.galaxy.averager
from hivemind.utils.logging import get_logger
get_logger("hivemind.averaging.averager")
print(logging.getLevelName(logging.getLogger("hivemind").level))
"""


@pytest.mark.parametrize(
    "env, level",
    [({}, "WARN"), ({"LOG_LEVEL": "DEBUG"}, "DEBUG"), ({"HIVEMIND_LOGLEVEL": "INFO"}, "INFO")],
    ids=["default", "LOG_LEVEL=DEBUG", "HIVEMIND_LOGLEVEL"],
)
def test_hivemind_log_level(env, level):
    base = {k: v for k, v in os.environ.items() if k not in ("HIVEMIND_LOGLEVEL", "LOG_LEVEL")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == level


def test_p2pd_closing_its_own_socket_at_shutdown_is_not_logged_as_an_error():
    import logging

    from open_diloco.galaxy.lifecycle import _drop_listener_closed_at_shutdown

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("hivemind.p2p.p2p_daemon", logging.ERROR, "daemon.go", 198, message, None, None)

    closed = "error accepting connection: accept unix /tmp/hivemind-p2pd-x.sock: use of closed network connection"
    assert not _drop_listener_closed_at_shutdown(record(closed))
    assert _drop_listener_closed_at_shutdown(record("error accepting connection: too many open files"))
    assert _drop_listener_closed_at_shutdown(record("failed to dial peer"))
