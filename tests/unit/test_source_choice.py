"""Which cluster a download takes the galaxy's state from (``outer/adoption.py``): the exact round first, then
the most committed work and the furthest step, ties to the lowest rank; and a source that fails gives way to a
cluster holding the very same state, never to another state."""

from __future__ import annotations

from open_diloco.outer.adoption import StateAdoption, choose_source
from open_diloco.outer.protocols import Membership
from tests.support.thread_cluster import ThreadCluster
from tests.unit.test_round_protocol import ShardPeer, _served


def test_the_source_is_the_exact_round_first_then_the_most_advanced_then_the_lowest_rank():
    view = Membership(steps={0: 9, 1: 4, 2: 5, 3: 5}, sources={0: "a", 1: "b", 2: "c", 3: "d"})
    assert choose_source(view, own_rank=0, at_least=4, exact=4) == (1, 4)
    assert choose_source(view, own_rank=0, at_least=4) == (2, 5)
    assert (
        choose_source(view, own_rank=0, at_least=6) is None
    )  # only this cluster's own (old) record is ahead


def test_a_source_that_fails_gives_way_to_a_cluster_holding_the_same_state_never_to_another_state():
    # the `intercontinental` soak (2026-12-03): cluster 1 was killed right after committing a round; its
    # record lived on until --hv.member-expiry, and as the lowest rank it won every try of two clusters that
    # sat out 60 s dialling it, while cluster 2 served the same round
    meta, tensors = _served([0.5, 0.25], step=3, group=[1, 2])

    class DeadOne(ShardPeer):
        other_hash = "h"

        def membership(self):
            reported = {1: (3, "h", True), 2: (3, self.other_hash, True)}
            return Membership(lead=3, steps={1: 3, 2: 3}, sources={1: "1", 2: "2"}, reported=reported)

        def download_state(self, timeout, source=None, holders=None):
            self.sources_asked.append(source)
            return None if source == "1" else (dict(meta), [tensor.clone() for tensor in tensors])

    peers = [DeadOne(2, [], {}), DeadOne(2, [], {})]
    got = ThreadCluster(2).run(lambda rank, comm: StateAdoption(peers[rank], comm, 0, print).download(3, 5.0))
    assert [d.source for d in got] == [2, 2] and peers[0].sources_asked == ["1", "2"], peers[0].sources_asked
    # cluster 2's chain as heavy and as far, but another θ: a fork, never taken because 1 cannot be dialled
    peers = [DeadOne(2, [], {}), DeadOne(2, [], {})]
    for peer in peers:
        peer.other_hash = "fork"
    got = ThreadCluster(2).run(lambda rank, comm: StateAdoption(peers[rank], comm, 0, print).download(3, 1.2))
    assert got == [None, None] and set(peers[0].sources_asked) == {"1"}
