"""The hivemind privates open_diloco overrides or reads are still there, shaped as we expect.

open_diloco/galaxy/ subclasses DecentralizedAverager and AllReduceRunner for a canonical all-reduce, and reads
their private attributes (see the module docstring there and design.md). pyproject pins hivemind to a minor;
this test tells, on a new hivemind, exactly which of those privates moved, before an e2e run fails obscurely.
"""

from __future__ import annotations

import hashlib
import inspect

import pytest
import torch

_sharing_strategy = torch.multiprocessing.get_sharing_strategy()
hivemind = pytest.importorskip("hivemind")
# Importing hivemind switches torch's tensor sharing strategy process-wide; leave the other tests torch's own.
torch.multiprocessing.set_sharing_strategy(_sharing_strategy)

from hivemind.averaging import DecentralizedAverager, matchmaking  # noqa: E402
from hivemind.averaging.allreduce import AllReduceRunner  # noqa: E402
from hivemind.averaging.key_manager import GroupKeyManager  # noqa: E402
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer  # noqa: E402
from hivemind.p2p import P2P  # noqa: E402
from hivemind.p2p.servicer import ServicerBase, StubBase  # noqa: E402


def changed(name: str) -> str:
    return f"hivemind {hivemind.__version__} changed {name}: re-check open_diloco's overrides"


# (class, method, parameter names) of every method open_diloco/galaxy/ overrides or calls with keywords.
SIGNATURES = [
    (
        DecentralizedAverager,
        "_run_allreduce_inplace_",
        ["self", "tensors", "group_info", "group_id", "kwargs"],
    ),
    (DecentralizedAverager, "_aggregate_with_group", ["self", "group_info", "min_vector_size", "kwargs"]),
    (DecentralizedAverager, "get_current_state", ["self"]),
    # the round and the attempt ride in the group bits (galaxy/round_wait.py: round_key_bits)
    (DecentralizedAverager, "set_group_bits", ["self", "group_bits", "wait"]),
    (DecentralizedAverager, "run", ["self"]),
    # PacedGroupKeyManager (galaxy/paced_matchmaking.py) paces matchmaking's reads of the group key
    (GroupKeyManager, "get_averagers", ["self", "group_key", "only_active"]),
    (hivemind.DHT, "run", ["self"]),
    (AllReduceRunner, "_accumulate_parts_streaming", ["self", "stream", "sender_index"]),
    (AllReduceRunner, "_communicate_with_peer", ["self", "peer_id"]),
    (AllReduceRunner, "rpc_aggregate_part", ["self", "stream", "context"]),
    (AllReduceRunner, "_get_peer_stub", ["self", "peer"]),
    (AllReduceRunner, "_ban_sender", ["self", "peer_id"]),
    (
        AllReduceRunner,
        "__init__",
        [
            "self",
            "p2p",
            "servicer_type",
            "prefix",
            "group_id",
            "tensors",
            "weight",
            "ordered_peer_ids",
            "peer_fractions",
            "modes",
            "sender_timeout",
            "reducer_timeout",
            "kwargs",
        ],
    ),
    (TensorPartContainer, "register_processed_part", ["self", "peer_index", "part_index", "part"]),
    (TensorPartContainer, "iterate_output_tensors", ["self"]),
    (TensorPartContainer, "finalize", ["self"]),
    (
        TensorPartContainer,
        "__init__",
        [
            "self",
            "tensors",
            "peer_fractions",
            "compression",
            "part_size_bytes",
            "tensor_infos",
            "return_deltas",
            "prefetch",
        ],
    ),
    (TensorPartReducer, "accumulate_part", ["self", "sender_index", "part_index", "tensor_part", "weight"]),
    # CountingStub (galaxy/span_streams.py) drives a reducer's stream itself
    (P2P, "call_binary_stream_handler", ["self", "peer_id", "handler_name"]),
    (P2P, "send_protobuf", ["protobuf", "writer"]),
    (P2P, "receive_protobuf", ["input_protobuf_type", "reader"]),
    (ServicerBase, "_get_handle_name", ["namespace", "method_name"]),
]


@pytest.mark.parametrize(
    "cls, method, parameters", SIGNATURES, ids=[f"{cls.__name__}.{method}" for cls, method, _ in SIGNATURES]
)
def test_overridden_methods_keep_their_signature(cls, method, parameters):
    name = f"{cls.__name__}.{method}"
    assert callable(getattr(cls, method, None)), changed(name)
    assert list(inspect.signature(getattr(cls, method)).parameters) == parameters, changed(name)


# (class, attributes its __init__ must set) that open_diloco/galaxy/ reads or writes.
ATTRIBUTES = [
    (
        DecentralizedAverager,
        ["_parent_pid", "lock_averaged_tensors", "_averaged_tensors", "_running_groups", "prefix"],
    ),
    (hivemind.DHT, ["_parent_pid"]),
    (
        AllReduceRunner,
        [
            "peer_id",
            "tensor_part_container",
            "tensor_part_reducer",
            "parts_for_local_averaging",
            "ordered_peer_ids",
            "sender_peer_ids",
            "banned_senders",
            "reducer_timeout",
            "modes",
            "weight",
        ],
    ),
    (
        TensorPartContainer,
        [
            "return_deltas",
            "failed_size",
            "compression",
            "prefetch",
            "local_tensors",
            "peer_fractions",
            "part_size_bytes",
            "tensor_infos",
            "finished",
            "group_size",
            "num_parts_by_peer",
            "_input_parts_by_peer",
            "_outputs_registered_by_peer",
            "_output_part_available",
            "_outputs_consumed",
        ],
    ),
    (TensorPartReducer, ["num_parts"]),
    (AllReduceRunner, ["_servicer_type"]),
    (StubBase, ["_p2p", "_peer", "_namespace"]),
]


@pytest.mark.parametrize("cls, attributes", ATTRIBUTES, ids=[cls.__name__ for cls, _ in ATTRIBUTES])
def test_attributes_we_use_are_still_set_in_init(cls, attributes):
    source = inspect.getsource(cls.__init__)
    for attribute in attributes:
        assert f"self.{attribute}" in source, changed(f"{cls.__name__}.{attribute}")


def test_parent_pid_is_the_creating_process():
    # become_galaxy_child (galaxy/lifecycle.py) watches this pid from the forked child: it must be the
    # creator's.
    for cls in (DecentralizedAverager, hivemind.DHT):
        assert "self._parent_pid = os.getpid()" in inspect.getsource(cls.__init__), changed(
            f"{cls.__name__}._parent_pid"
        )


def test_matchmaking_builds_its_key_manager_by_the_module_name_we_replace():
    # CanonicalAverager.run sets matchmaking.GroupKeyManager to PacedGroupKeyManager in the averager's process
    source = inspect.getsource(matchmaking.Matchmaking.__init__)
    assert "self.group_key_manager = GroupKeyManager(" in source, changed("Matchmaking's GroupKeyManager")
    assert "await key_manager.get_averagers(" in inspect.getsource(
        matchmaking.PotentialLeaders._update_queue_periodically
    ), changed("PotentialLeaders._update_queue_periodically")


def test_a_triggered_update_makes_the_search_read_its_key_again():
    # galaxy/paced_matchmaking.refresh_leaders sets update_triggered while a shard looks: the queue's updater
    # must wait on it, and pop_next_leader must take the update's result
    leaders = matchmaking.PotentialLeaders
    assert "self.update_triggered" in inspect.getsource(leaders.__init__), changed("update_triggered")
    updater = inspect.getsource(leaders._update_queue_periodically)
    assert "self.update_triggered.wait()" in updater and "self.update_finished.set()" in updater, changed(
        "PotentialLeaders._update_queue_periodically"
    )
    assert "self.update_finished.wait()" in inspect.getsource(leaders.pop_next_leader), changed(
        "PotentialLeaders.pop_next_leader"
    )
    assert "self.potential_leaders = PotentialLeaders(" in inspect.getsource(
        matchmaking.Matchmaking.__init__
    ), changed("Matchmaking.__init__")


def test_matchmaking_reads_its_floor_each_time_a_window_ends():
    # galaxy/paced_matchmaking.py lowers min_group_size mid-round: hivemind must read it when a window ends
    for where in (
        matchmaking.Matchmaking._request_join_potential_leaders,
        matchmaking.Matchmaking.rpc_join_group,
    ):
        assert "len(self.current_followers) + 1 >= self.min_group_size" in inspect.getsource(where), changed(
            f"Matchmaking.{where.__name__}'s floor"
        )


def test_return_deltas_is_a_container_option():
    parameters = inspect.signature(TensorPartContainer.__init__).parameters
    assert "return_deltas" in parameters, changed("TensorPartContainer(return_deltas=...)")


# galaxy/allreduce.py re-implements these bodies (copy semantics instead of add; results written in place);
# any upstream edit to them may need porting. The fingerprints are of hivemind 1.1.12's source.
COPIED_BODIES = {
    "AllReduceRunner._accumulate_parts_streaming": (
        AllReduceRunner._accumulate_parts_streaming,
        "6c5a3c726606",
    ),
    "DecentralizedAverager._run_allreduce_inplace_": (
        DecentralizedAverager._run_allreduce_inplace_,
        "914d57cffc7d",
    ),
    "TensorPartContainer.register_processed_part": (
        TensorPartContainer.register_processed_part,
        "ff5ebad6141c",
    ),
    "TensorPartContainer.iterate_output_tensors": (
        TensorPartContainer.iterate_output_tensors,
        "3bc3c7e743c4",
    ),
    "P2P._iterate_protobuf_stream_handler": (
        P2P._iterate_protobuf_stream_handler,
        "132d50ef5ecd",
    ),  # CountingStub
}


def test_the_end_of_a_stream_is_still_an_empty_rpc_error():
    from hivemind.proto.p2pd_pb2 import RPCError

    assert P2P.END_OF_STREAM == RPCError(), changed("P2P.END_OF_STREAM")


@pytest.mark.parametrize("name", COPIED_BODIES)
def test_bodies_we_copied_are_unchanged(name):
    function, fingerprint = COPIED_BODIES[name]
    assert hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:12] == fingerprint, changed(name)
