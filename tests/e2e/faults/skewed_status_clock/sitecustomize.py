"""Fault injection for the e2e tests, on the PYTHONPATH of one cluster only: the clock this cluster's status
board and membership reads use (``open_diloco.galaxy.status.get_dht_time``) runs
``OPEN_DILOCO_TEST_STATUS_SKEW`` seconds off (negative: behind), as on a site off NTP. hivemind's own clock is
left alone: its matchmaking and DHT expiry compare clocks too, at the scale of the matchmaking time, which is
not what this fault looks at."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/e2e/faults
from fault_patch import patch_on_import  # noqa: E402

_TARGET = "open_diloco.galaxy.status"


def _skew(module) -> None:
    skew, real = float(os.environ["OPEN_DILOCO_TEST_STATUS_SKEW"]), module.get_dht_time
    module.get_dht_time = lambda: real() + skew


if os.environ.get("OPEN_DILOCO_TEST_STATUS_SKEW"):
    patch_on_import(_TARGET, _skew)
