"""The launchers' own rendezvous (shoal/elastic/node_slots.py), in one process against a real store: nodes
take their ranks, a MIN:MAX job forms with the nodes present, a late node joins only under --live and
only while fewer than MAX run, and the node serving the store waits for the others to end."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from shoal.comm.store import Store
from shoal.elastic import node_slots as node_slots_module
from shoal.elastic.node_slots import NodePlace, NodeSlots

NOW = timedelta(0)
SHORT = timedelta(seconds=1)
LONG = timedelta(seconds=30)


@pytest.fixture
def store() -> Store:
    return Store.connect("127.0.0.1", 0, world_size=1, is_server=True)


def _client(store: Store) -> Store:
    return Store.connect("127.0.0.1", store.raw.port, world_size=1, is_server=False, timeout=LONG)


def _node(store: Store, name: str, *, min_nodes: int = 1, max_nodes: int = 2,
          stopping: threading.Event | None = None) -> NodeSlots:
    return NodeSlots(store, name, nproc_per_node=2, min_nodes=min_nodes, max_nodes=max_nodes,
                 stopping=stopping or threading.Event())


def test_with_a_fixed_node_count_a_rank_is_taken_again_only_once_its_launcher_is_gone(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_slots_module, "_BEAT_S", 0.05)
    monkeypatch.setattr(node_slots_module, "_SILENT_S", 1.0)
    first = _node(store, "a", min_nodes=2, max_nodes=2)
    assert first.place(1, join_timeout=LONG, last_call=NOW, take_late=False) == NodePlace(1, 4, late=False)
    first.keep_alive(_client(store), watch=False)
    try:
        with pytest.raises(RuntimeError, match=r"node rank 1 is held by a running launcher of this job \(a\)"):
            _node(store, "b", min_nodes=2, max_nodes=2).place(1, join_timeout=LONG, last_call=NOW, take_late=False)
    finally:
        first.end()
    # Its launcher ended (or died): the node is started again with the same rank.
    assert _node(store, "c", min_nodes=2, max_nodes=2).place(1, join_timeout=LONG, last_call=NOW,
                                                              take_late=False) == NodePlace(1, 4, late=False)


def test_the_job_forms_once_min_nodes_have_arrived_with_the_nodes_present(store: Store) -> None:
    with ThreadPoolExecutor(3) as pool:
        places = list(pool.map(lambda name: _node(_client(store), name, min_nodes=3, max_nodes=4).place(
            None, join_timeout=LONG, last_call=SHORT, take_late=True), "abc"))
    assert sorted(places, key=lambda p: p.node_rank) == [NodePlace(r, 6, late=False) for r in range(3)]


def test_a_node_that_arrives_after_the_job_formed_is_late(store: Store) -> None:
    assert _node(store, "a").place(None, join_timeout=LONG, last_call=NOW, take_late=True) == NodePlace(0, 2, False)
    with pytest.raises(RuntimeError, match="formed with 1 nodes before this one arrived, and without --live"):
        _node(store, "b").place(None, join_timeout=LONG, last_call=NOW, take_late=False)
    # Its workers join; its slot (2: the refused node kept 1) stands in for a rank until they are admitted.
    assert _node(store, "c").place(None, join_timeout=LONG, last_call=NOW, take_late=True) == NodePlace(2, 6, True)


def test_too_few_nodes_time_out_with_the_counts(store: Store) -> None:
    with pytest.raises(TimeoutError, match="only 1 of the 2 nodes the job needs"):
        _node(store, "a", min_nodes=2).place(None, join_timeout=SHORT, last_call=NOW, take_late=True)


def test_a_launcher_that_stops_waiting_withdraws_and_the_job_forms_without_it(store: Store) -> None:
    stopping = threading.Event()
    threading.Timer(0.3, stopping.set).start()
    with pytest.raises(InterruptedError, match="stopped while waiting"):
        _node(store, "a", min_nodes=2, stopping=stopping).place(None, join_timeout=LONG, last_call=NOW,
                                                                take_late=True)
    with ThreadPoolExecutor(2) as pool:
        places = list(pool.map(lambda name: _node(_client(store), name, min_nodes=2).place(
            None, join_timeout=LONG, last_call=NOW, take_late=True), "bc"))
    assert sorted(places, key=lambda p: p.node_rank) == [NodePlace(0, 4, late=False), NodePlace(1, 4, late=False)]


def test_a_late_node_waits_while_max_nodes_run_and_starts_when_one_ends(store: Store) -> None:
    running = [_node(store, name, min_nodes=2) for name in "ab"]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda node: node.place(None, join_timeout=LONG, last_call=NOW, take_late=True), running))
    for node in running:
        node.keep_alive(_client(store), watch=False)
    try:
        with pytest.raises(TimeoutError, match="at most 2 nodes"):
            _node(store, "c", min_nodes=2).place(None, join_timeout=SHORT, last_call=NOW, take_late=True)
        threading.Timer(0.5, running[1].end).start()
        started = time.monotonic()
        assert _node(store, "d", min_nodes=2).place(None, join_timeout=LONG, last_call=NOW, take_late=True).late
        assert time.monotonic() - started >= 0.5
    finally:
        running[0].end()


def test_the_node_serving_the_store_waits_until_the_others_have_ended_or_fallen_silent(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_slots_module, "_BEAT_S", 0.05)
    monkeypatch.setattr(node_slots_module, "_SILENT_S", 2.0)
    host, other, killed = (_node(store, name, min_nodes=3, max_nodes=3) for name in "abc")
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda item: item[1].place(item[0], join_timeout=LONG, last_call=NOW, take_late=False),
                      enumerate((host, other, killed))))
    host.keep_alive(_client(store), watch=True)
    other.keep_alive(_client(store), watch=False)
    store.add(f"{killed.me}/beats", 1)  # it beat once, then its launcher was killed: no end, no more beats
    host.end()
    waited = threading.Thread(target=host.await_others)
    waited.start()
    waited.join(timeout=3)
    assert waited.is_alive()  # the other node still runs, and beats
    other.end()
    waited.join(timeout=10)
    assert not waited.is_alive()
