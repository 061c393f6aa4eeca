"""Run under torchrun by tests/dist/test_teardown.py: run the script of argv[2] with the flags after it, and
after every exit hook that run registered, write the names of this process's threads still alive to
``<argv[1]>/threads-<rank>.json``.

A process group's backend that is still alive then dies in the interpreter's teardown, where one of its
worker threads can abort the whole process (SIGABRT after a clean run). Exit hooks run last-in first-out,
so this one, registered before the run starts, sees what the run's own hooks left."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
from pathlib import Path


def write_thread_names(out_dir: Path) -> None:
    tasks = sorted(os.listdir("/proc/self/task"), key=int)
    names = [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in tasks]
    (out_dir / f"threads-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(names))


if __name__ == "__main__":
    out_dir, script = Path(sys.argv[1]), sys.argv[2]
    atexit.register(write_thread_names, out_dir)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")
