"""Fault injection for the e2e tests, on the PYTHONPATH of one cluster only: with
``OPEN_DILOCO_TEST_DROP_STATE_PARTS`` set, this cluster pins its state for a striped download as any holder
does, then answers every part empty (a holder that fails while it serves). Applied when
``open_diloco.galaxy.state_pins`` is first imported (the averager process is forked after that and inherits
it); nothing else changes."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/e2e/faults
from fault_patch import patch_on_import  # noqa: E402

_TARGET = "open_diloco.galaxy.state_pins"


def _drop_parts(module) -> None:
    module.Pin.part = lambda self, index, start, end: None


if os.environ.get("OPEN_DILOCO_TEST_DROP_STATE_PARTS"):
    patch_on_import(_TARGET, _drop_parts)
