"""Fault injection for the e2e tests, on the PYTHONPATH of one cluster only: with
``OPEN_DILOCO_TEST_DROP_STATE_PARTS`` set, this cluster pins its state for a striped download as any holder
does, then answers every part empty (a holder that fails while it serves). Applied when
``open_diloco.galaxy.state_pins`` is first imported (the averager process is forked after that and inherits
it); nothing else changes."""

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "open_diloco.galaxy.state_pins"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.Pin.part = lambda self, index, start, end: None

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("OPEN_DILOCO_TEST_DROP_STATE_PARTS"):
    sys.meta_path.insert(0, _PatchOnImport())
