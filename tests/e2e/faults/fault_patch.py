"""What every fault here does: patch one module of the package the moment it is first imported, in this
process and in the processes later forked from it (hivemind's DHT and averager), before anything binds its
names. Imported by each fault's ``sitecustomize``, which puts this directory on ``sys.path`` first."""

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, patch: Callable[[ModuleType], None]):
        self.target, self.patch = target, patch

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def patch_on_import(target: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` once module ``target`` has been executed, at its first import."""
    sys.meta_path.insert(0, _PatchOnImport(target, patch))
