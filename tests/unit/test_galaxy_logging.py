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
        return logging.LogRecord(
            "hivemind.p2p.p2p_daemon", logging.ERROR, "daemon.go", 198, message, None, None
        )

    closed = (
        "error accepting connection: accept unix /tmp/hivemind-p2pd-x.sock: use of closed network connection"
    )
    assert not _drop_listener_closed_at_shutdown(record(closed))
    assert _drop_listener_closed_at_shutdown(record("error accepting connection: too many open files"))
    assert _drop_listener_closed_at_shutdown(record("failed to dial peer"))


def test_a_failed_state_download_is_one_warning_line():
    # hivemind logs it with logger.exception: an ERROR and a traceback for a routine retry (a peer not yet
    # listening)
    import logging

    from open_diloco.galaxy.canonical_averager import one_line_download_failures

    def record(func: str) -> logging.LogRecord:
        try:
            raise ConnectionError("failed to dial: all dials failed\n  * [/ip4/10.0.0.2/tcp/1] dial backoff")
        except ConnectionError as err:
            return logging.LogRecord(
                "hivemind.averaging.averager",
                logging.ERROR,
                __file__,
                1,
                "Failed to download state from peer - %r",
                (err,),
                sys.exc_info(),
                func=func,
            )

    download = record("_load_state_from_peers")
    assert one_line_download_failures(download) is True
    line = logging.Formatter("[%(levelname)s] %(message)s").format(download)
    assert download.levelno == logging.WARNING and "\n" not in line and "dial backoff" in line, line
    other = record("_step")  # any other exception keeps its level and traceback
    assert one_line_download_failures(other) is True and other.levelno == logging.ERROR and other.exc_info
