"""The replicated store (shoal.comm.replicated_store), its replicas in this process on 127.0.0.1: every change
a client has seen is held by every replica; when the primary is lost the next replica takes over with all
of it, a change sent again is not made twice, waits go on, and torch's own process groups run over it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist

from shoal.comm.replicated_store import ReplicatedStore, StoreReplica, client, wire
from shoal.comm.store import Store
from tests.waiting import wait_until


@pytest.fixture
def replicas() -> Iterator[list[StoreReplica]]:
    """A primary and two followers, in that order."""
    made = [StoreReplica("127.0.0.1", 0)]
    made += [StoreReplica("127.0.0.1", 0, follow=made[0].address, join_timeout=10) for _ in range(2)]
    yield made
    for replica in made:
        replica.close()


def _raw(replica: StoreReplica, request: dict) -> dict:
    host, port = wire.split_address(replica.address)
    with socket.create_connection((host, port), timeout=5) as sock:
        return wire.call(sock, request)


def test_a_follower_takes_over_with_every_change_and_clients_follow_it(replicas: list[StoreReplica]) -> None:
    primary, first, second = replicas
    assert primary.replicas == first.replicas == second.replicas == [r.address for r in replicas]
    store = Store(ReplicatedStore([second.address], timeout=timedelta(seconds=10)))  # a follower leads to the primary
    store.set("model", {"layers": 3})
    assert store.add("count", 5) == 5
    assert store.compare_set("leader", "a") == "a" and store.compare_set("leader", "b") == "a"
    store.raw.set("binary", bytes(range(256)))
    primary.close()
    assert store.get("model") == {"layers": 3} and store.get("leader") == "a"
    assert store.raw.get("binary") == bytes(range(256))
    assert store.add("count", 1) == 6
    assert first.is_primary and not second.is_primary and first.replicas == [first.address, second.address]
    wait_until(lambda: second.replicas == first.replicas, "the second follower follows the first", timeout=10)
    first.close()
    assert store.add("count", 1) == 7 and second.is_primary and second.replicas == [second.address]
    assert store.raw.num_keys() == 4 and store.raw.delete_key("binary") and not store.has("binary")


def test_a_change_sent_again_after_its_primary_was_lost_is_made_once(replicas: list[StoreReplica]) -> None:
    change = {"op": "add", "key": "reduced", "amount": 1, "client": "c1", "seq": 1}
    assert _raw(replicas[0], change)["result"] == 1
    replicas[0].close()  # as if the reply had been lost with it: the client sends the change again
    store = ReplicatedStore([replicas[1].address], timeout=timedelta(seconds=10))
    assert _raw(replicas[1], change)["result"] == 1
    assert store.add("reduced", 0) == 1


def test_a_follower_refuses_clients_and_names_the_replicas(replicas: list[StoreReplica]) -> None:
    reply = _raw(replicas[1], {"op": "set", "key": "k", "value": wire.pack(b"v"), "client": "c", "seq": 1})
    assert reply["error"] == "not the primary" and reply["replicas"][0] == replicas[0].address


def test_a_follower_that_joins_late_holds_what_came_before(replicas: list[StoreReplica]) -> None:
    store = ReplicatedStore([replicas[0].address], timeout=timedelta(seconds=10))
    store.set("early", b"1")
    late = StoreReplica("127.0.0.1", 0, follow=replicas[2].address, join_timeout=10)  # found through a follower
    try:
        assert late.replicas[-1] == late.address
        store.set("later", b"2")  # each answer names the replicas: the client learns of the late one
        for replica in replicas:
            replica.close()
        assert store.get("early") == b"1" and store.get("later") == b"2" and late.is_primary
    finally:
        late.close()


def test_a_wait_goes_on_across_a_take_over(replicas: list[StoreReplica]) -> None:
    waiter = ReplicatedStore([replicas[0].address], timeout=timedelta(seconds=20))
    writer = ReplicatedStore([replicas[0].address], timeout=timedelta(seconds=20))
    waited: list[BaseException | None] = []

    def wait() -> None:
        try:
            waiter.wait(["ready"])
            waited.append(None)
        except BaseException as exc:
            waited.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    replicas[0].close()
    writer.set("ready", b"1")
    thread.join(timeout=20)
    assert waited == [None]
    with pytest.raises(RuntimeError, match="timeout"):
        waiter.wait(["never"], timedelta(seconds=0.2))


def test_a_client_refuses_a_primary_without_the_changes_it_saw(replicas: list[StoreReplica],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "_FAILOVER_S", 1.0)
    stranger = StoreReplica("127.0.0.1", 0)  # another primary of the same term, with none of the changes
    try:
        store = ReplicatedStore([replicas[0].address, stranger.address], timeout=timedelta(seconds=10))
        store.set("seen", b"1")
        for replica in replicas:
            replica.close()
        with pytest.raises(ConnectionError, match="lost changes"):
            store.get("seen")
    finally:
        stranger.close()


def test_a_follower_with_nothing_to_follow_fails_within_its_join_timeout() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{unused.getsockname()[1]}"
        with pytest.raises(TimeoutError, match="took this one"):
            StoreReplica("127.0.0.1", 0, follow=nowhere, join_timeout=0.5)


def test_torch_gloo_groups_rendezvous_through_it(replicas: list[StoreReplica]) -> None:
    results: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        store = ReplicatedStore([replicas[0].address], timeout=timedelta(seconds=20))
        group = tdist.ProcessGroupGloo(tdist.PrefixStore("gloo/", store), r, 2, timedelta(seconds=20))
        tensor = torch.full((3,), float(r + 1))
        group.allreduce([tensor]).wait()
        results[r] = tensor

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert all(torch.equal(results[r], torch.full((3,), 3.0)) for r in range(2)), results
