"""The trainer's garbage collection schedule: none inside steps, a full one every N steps, Python's own back
after the run."""

import gc
import multiprocessing
import weakref

from open_diloco.gc_schedule import GcSchedule


class Node:
    pass


def cyclic_garbage() -> weakref.ref:
    """An object only a reference cycle keeps alive: freed by the cyclic collector, never by refcounts."""
    node = Node()
    node.self = node
    return weakref.ref(node)


def test_collects_only_at_its_interval_and_gives_python_its_collector_back():
    assert gc.isenabled()
    schedule = GcSchedule(3)
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        garbage = cyclic_garbage()
        for _ in range(2000):  # allocations that would trigger automatic collections
            cyclic_garbage()
        schedule.collect_if_due(1)
        schedule.collect_if_due(2)
        assert garbage() is not None, "collected between scheduled steps"
        schedule.collect_if_due(3)
        assert garbage() is None, "not collected at the scheduled step"
    finally:
        schedule.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_interval_zero_leaves_python_automatic_collection_alone():
    schedule = GcSchedule(0)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    garbage = cyclic_garbage()
    gc.collect()
    assert garbage() is None
    schedule.collect_if_due(50)
    schedule.close()
    assert gc.isenabled()


def _report_collector(queue) -> None:
    queue.put(gc.isenabled())


def test_a_process_forked_under_the_schedule_collects_garbage_automatically():
    """hivemind's DHT and averager processes and the loader's workers are forked while the schedule has
    automatic collection off; they run event loops or read data, not steps, so they turn it back on."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    schedule = GcSchedule(50)
    try:
        assert not gc.isenabled()
        child = ctx.Process(target=_report_collector, args=(queue,))
        child.start()
        in_child = queue.get(timeout=30)
        child.join(10)
    finally:
        schedule.close()
    assert in_child is True
