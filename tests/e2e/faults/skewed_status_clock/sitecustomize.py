"""Fault injection for the e2e tests, on the PYTHONPATH of one cluster only: the clock this cluster's status
board and membership reads use (``open_diloco.galaxy.status.get_dht_time``) runs
``OPEN_DILOCO_TEST_STATUS_SKEW`` seconds off (negative: behind), as on a site off NTP. hivemind's own clock is
left alone: its matchmaking and DHT expiry compare clocks too, at the scale of the matchmaking time, which is
not what this fault looks at."""

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "open_diloco.galaxy.status"


def _skew(module) -> None:
    skew, real = float(os.environ["OPEN_DILOCO_TEST_STATUS_SKEW"]), module.get_dht_time
    module.get_dht_time = lambda: real() + skew


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _skew(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("OPEN_DILOCO_TEST_STATUS_SKEW"):
    sys.meta_path.insert(0, _PatchOnImport())
