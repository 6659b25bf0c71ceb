"""The launchers' own rendezvous (shoal/elastic/node_slots.py), in one process against a real store: nodes
take their ranks, a MIN:MAX job forms with the nodes alive (not one killed while it waited), a late node
joins only under --live and only into one of MAX seats, and the node serving the store waits for the
others to end."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from shoal.comm.store import Store
from shoal.elastic import node_slots as node_slots_module
from shoal.elastic.node_slots import NodePlace, NodeSlots
from tests.waiting import wait_until

NOW = timedelta(0)
SHORT = timedelta(seconds=1)
LONG = timedelta(seconds=30)


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setattr(node_slots_module, "_BEAT_S", 0.05)  # a node is known alive within a beat
    return Store.connect("127.0.0.1", 0, world_size=1, is_server=True)


def _client(store: Store) -> Store:
    return Store.connect("127.0.0.1", store.raw.port, world_size=1, is_server=False, timeout=LONG)


@pytest.fixture
def node(store: Store) -> Iterator[Callable[..., NodeSlots]]:
    """Makes a launcher's node slots, beating (as the launcher starts them) until the test ends."""
    made: list[NodeSlots] = []

    def make(name: str, *, min_nodes: int = 1, max_nodes: int = 2, stopping: threading.Event | None = None,
             watch: bool = False) -> NodeSlots:
        slots = NodeSlots(_client(store), name, nproc_per_node=2, min_nodes=min_nodes, max_nodes=max_nodes,
                          stopping=stopping or threading.Event())
        slots.keep_alive(_client(store), watch=watch)
        made.append(slots)
        return slots

    yield make
    for slots in made:
        slots.end()


def _killed_while_waiting(store: Store, name: str) -> None:
    """A launcher that took the next slot and beat once, then was killed: it never withdraws."""
    next(k for k in itertools.count() if store.compare_set(f"slot/{k}", name) == name)
    store.add(f"{name}/beats", 1)


def _beating(store: Store, name: str) -> threading.Event:
    """Beats for launcher `name` as its heartbeat does, until the event returned is set (it is killed)."""
    dead, beats = threading.Event(), _client(store)

    def beat() -> None:
        while not dead.wait(0.05):
            beats.add(f"{name}/beats", 1)

    threading.Thread(target=beat, daemon=True).start()
    return dead


def test_with_a_fixed_node_count_a_rank_is_taken_again_only_once_its_launcher_is_gone(
        node: Callable[..., NodeSlots], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_slots_module, "_SILENT_S", 2.0)
    first = node("a", min_nodes=2, max_nodes=2)
    assert first.place(1, join_timeout=LONG, last_call=NOW, take_late=False) == NodePlace(1, 4, late=False)
    with pytest.raises(RuntimeError, match=r"node rank 1 is held by a running launcher of this job \(a\)"):
        node("b", min_nodes=2, max_nodes=2).place(1, join_timeout=LONG, last_call=NOW, take_late=False)
    first.end()
    # Its launcher ended (or died): the node is started again with the same rank.
    assert node("c", min_nodes=2, max_nodes=2).place(1, join_timeout=LONG, last_call=NOW,
                                                     take_late=False) == NodePlace(1, 4, late=False)


def test_the_job_forms_once_min_nodes_have_arrived_with_the_nodes_present(node: Callable[..., NodeSlots]) -> None:
    with ThreadPoolExecutor(3) as pool:
        places = list(pool.map(lambda name: node(name, min_nodes=3, max_nodes=4).place(
            None, join_timeout=LONG, last_call=SHORT, take_late=True), "abc"))
    assert sorted(places, key=lambda p: p.node_rank) == [NodePlace(r, 6, late=False) for r in range(3)]


def test_a_launcher_killed_while_it_waits_is_left_out_of_the_job(
        store: Store, node: Callable[..., NodeSlots], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_slots_module, "_SILENT_S", 2.0)
    _killed_while_waiting(store, "killed")  # slot 0
    with ThreadPoolExecutor(2) as pool:
        places = list(pool.map(lambda name: node(name, min_nodes=2).place(
            None, join_timeout=LONG, last_call=NOW, take_late=True), "ab"))
    # The two alive are the job, ranked 0 and 1 in slot order; the killed one's slot is in neither.
    assert sorted(places, key=lambda p: p.node_rank) == [NodePlace(0, 4, late=False), NodePlace(1, 4, late=False)]
    assert store.get("formed") == [1, 2]


def test_a_launcher_killed_a_moment_before_the_job_forms_is_left_out(
        store: Store, node: Callable[..., NodeSlots], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_slots_module, "_SILENT_S", 2.0)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(node("a", min_nodes=3, max_nodes=4).place, None, join_timeout=LONG, last_call=NOW,
                            take_late=True)
        wait_until(lambda: store.has("slot/0"), "a has taken slot 0", timeout=10)  # on the pool's thread
        next(k for k in itertools.count() if store.compare_set(f"slot/{k}", "b") == "b")  # slot 1, beating
        dead = _beating(store, "b")
        wait_until(lambda: store.add("b/beats", 0) > 3, "b has beaten", timeout=10, interval=0.01)
        dead.set()  # killed while it waits for a third node, which arrives at once
        places = [first, *(pool.submit(node(name, min_nodes=3, max_nodes=4).place, None, join_timeout=LONG,
                                       last_call=NOW, take_late=True) for name in "cd")]
        assert [p.result(timeout=30) for p in places] == [NodePlace(r, 6, late=False) for r in range(3)]
    assert store.get("formed") == [0, 2, 3]


def test_a_node_that_arrives_after_the_job_formed_is_late(node: Callable[..., NodeSlots]) -> None:
    assert node("a").place(None, join_timeout=LONG, last_call=NOW, take_late=True) == NodePlace(0, 2, False)
    with pytest.raises(RuntimeError, match="formed with 1 nodes before this one arrived, and without --live"):
        node("b").place(None, join_timeout=LONG, last_call=NOW, take_late=False)
    # Its workers join; its slot (2: the refused node kept 1) stands in for a rank until they are admitted.
    assert node("c").place(None, join_timeout=LONG, last_call=NOW, take_late=True) == NodePlace(2, 6, True)


def test_too_few_nodes_time_out_with_the_counts(node: Callable[..., NodeSlots]) -> None:
    with pytest.raises(TimeoutError, match="only 1 of the 2 nodes the job needs"):
        node("a", min_nodes=2).place(None, join_timeout=SHORT, last_call=NOW, take_late=True)


def test_a_launcher_that_stops_waiting_withdraws_and_the_job_forms_without_it(
        node: Callable[..., NodeSlots]) -> None:
    stopping = threading.Event()
    threading.Timer(0.3, stopping.set).start()
    with pytest.raises(InterruptedError, match="stopped while waiting"):
        node("a", min_nodes=2, stopping=stopping).place(None, join_timeout=LONG, last_call=NOW, take_late=True)
    with ThreadPoolExecutor(2) as pool:
        places = list(pool.map(lambda name: node(name, min_nodes=2).place(
            None, join_timeout=LONG, last_call=NOW, take_late=True), "bc"))
    assert sorted(places, key=lambda p: p.node_rank) == [NodePlace(0, 4, late=False), NodePlace(1, 4, late=False)]


def test_a_late_node_waits_while_max_nodes_run_and_starts_when_one_ends(node: Callable[..., NodeSlots]) -> None:
    running = [node(name, min_nodes=2) for name in "ab"]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda slots: slots.place(None, join_timeout=LONG, last_call=NOW, take_late=True), running))
    with pytest.raises(TimeoutError, match="at most 2 nodes"):
        node("c", min_nodes=2).place(None, join_timeout=SHORT, last_call=NOW, take_late=True)
    threading.Timer(0.5, running[1].end).start()
    started = time.monotonic()
    assert node("d", min_nodes=2).place(None, join_timeout=LONG, last_call=NOW, take_late=True).late
    assert time.monotonic() - started >= 0.5


def test_two_late_nodes_never_both_take_the_last_seat(node: Callable[..., NodeSlots]) -> None:
    node("a").place(None, join_timeout=LONG, last_call=NOW, take_late=True)  # the job: 1 node of at most 2
    late = [node(name) for name in "bc"]
    arrived = threading.Barrier(2)

    def place(slots: NodeSlots) -> NodePlace | None:
        arrived.wait()
        try:
            return slots.place(None, join_timeout=SHORT, last_call=NOW, take_late=True)
        except TimeoutError:
            return None

    with ThreadPoolExecutor(2) as pool:
        places = list(pool.map(place, late))
    assert sum(p is not None for p in places) == 1, places


def test_a_late_node_takes_the_seat_of_a_node_killed_while_it_ran(
        store: Store, node: Callable[..., NodeSlots], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_slots_module, "_SILENT_S", 2.0)
    killed = NodeSlots(_client(store), "b", nproc_per_node=2, min_nodes=1, max_nodes=2, stopping=threading.Event())
    dead = _beating(store, "b")
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda slots: slots.place(None, join_timeout=LONG, last_call=NOW, take_late=True),
                      [node("a"), killed]))
    with pytest.raises(TimeoutError, match="at most 2 nodes"):
        node("c").place(None, join_timeout=SHORT, last_call=NOW, take_late=True)
    dead.set()  # its launcher is killed: no end, no more beats
    assert node("d").place(None, join_timeout=LONG, last_call=NOW, take_late=True).late
    assert store.get("seat/1") == "d"


def test_the_node_serving_the_store_waits_until_the_others_have_ended_or_fallen_silent(
        store: Store, node: Callable[..., NodeSlots], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_slots_module, "_SILENT_S", 2.0)
    host, other = node("a", min_nodes=3, max_nodes=3, watch=True), node("b", min_nodes=3, max_nodes=3)
    killed = NodeSlots(_client(store), "c", nproc_per_node=2, min_nodes=3, max_nodes=3, stopping=threading.Event())
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda item: item[1].place(item[0], join_timeout=LONG, last_call=NOW, take_late=False),
                      enumerate((host, other, killed))))
    store.add(f"{killed.me}/beats", 1)  # it beat once, then its launcher was killed: no end, no more beats
    host.end()
    waited = threading.Thread(target=host.await_others)
    waited.start()
    waited.join(timeout=3)
    assert waited.is_alive()  # the other node still runs, and beats
    other.end()
    waited.join(timeout=10)
    assert not waited.is_alive()
