"""Failures are reported, never hung on: a killed rank, mismatched calls, a silent peer, intruders on
the transport, a busy port, an unreachable store, a wrong world size or a rank claimed twice."""

from __future__ import annotations

import os
import secrets
import signal
import socket
from datetime import timedelta

import pytest
import torch

import shoal
import shoal.distributed as dist
from shoal.comm import rendezvous
from shoal.comm.store import Store
from shoal.comm.transport import auth
from shoal.comm.transport.mesh import Transport
from shoal.ports import free_port
from tests.ranks import run_ranks


def _killed_mid_collective(rank: int, world: int) -> tuple[str, int | None, str]:
    tensor = torch.ones(4_000_000)
    dist.all_reduce(torch.ones(4))  # everyone is connected and in step
    if rank == 1:
        dist.all_reduce(tensor, async_op=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(tensor)
    except shoal.PeerFailure as exc:
        first = (type(exc).__name__, exc.rank)
    try:
        dist.all_reduce(torch.ones(4))
        raise AssertionError("a collective on a group that lost a rank succeeded")
    except shoal.GroupBrokenError as exc:
        outcome = (*first, type(exc).__name__)
    # Stay until the other survivor has seen the failure too, or its first error could name us. Rank 0
    # serves the store, so rank 2's last store call is a set: rank 0 cannot leave while rank 2 still waits.
    store = dist.default_group().store
    if rank == 0:
        store.set("survived/0", True)
        store.wait(["survived/2"], timeout=timedelta(seconds=30))
    else:
        store.wait(["survived/0"], timeout=timedelta(seconds=30))
        store.set("survived/2", True)
    return outcome


def test_killed_rank_raises_peer_failure_on_every_survivor() -> None:
    # The group timeout (120 s) is far beyond the test's (60 s): only the dropped connection can
    # explain a PeerFailure in time.
    out = run_ranks(_killed_mid_collective, 3, timeout=60, group_timeout=120, expect={1: "dies"})
    assert out == {0: ("PeerFailure", 1, "GroupBrokenError"), 2: ("PeerFailure", 1, "GroupBrokenError")}


def _mismatched(rank: int, world: int, numel: int) -> list[str]:
    errors = []
    bad_numel = numel + 1 if rank == world - 1 else numel
    for tensor in (torch.ones(bad_numel), torch.ones(numel, dtype=torch.float64 if rank == 0 else torch.float32)):
        try:
            dist.all_reduce(tensor)
            errors.append("no error")
        except shoal.CollectiveMismatchError as exc:
            errors.append(str(exc))
    survivor = torch.full((numel,), float(rank))
    dist.all_reduce(survivor)  # a mismatch is reported on every rank alike; the group stays usable
    assert torch.equal(survivor, torch.full((numel,), float(sum(range(world)))))
    return errors


@pytest.mark.parametrize("numel", [10, 300_000])
def test_mismatched_shapes_and_dtypes_raise_on_every_rank(numel: int) -> None:
    out = run_ranks(_mismatched, 3, numel, timeout=60, group_timeout=60)
    for rank, errors in out.items():
        assert len(errors) == 2 and "no error" not in errors, (rank, errors)
        assert "numel=" in errors[0] and "rank" in errors[0], errors[0]
        assert "float64" in errors[1] and "float32" in errors[1], errors[1]


def _silent_peer(rank: int, world: int) -> str:
    if rank == 0:
        # A short deadline for this collective only: the rendezvous kept the long one, as ranks that
        # finish importing torch seconds apart need.
        dist.default_group().timeout = timedelta(seconds=2)
        with pytest.raises(TimeoutError, match="nothing from rank 1"):
            dist.all_reduce(torch.ones(8))
        return "timed out"
    # Stay alive, so rank 0 sees silence rather than a crash, until rank 0 gives up and leaves.
    with pytest.raises(shoal.PeerFailure, match="left the group"):
        dist.irecv(torch.ones(1), src=0, tag=99).wait(timeout=timedelta(seconds=30))
    return "waited"


def test_alive_but_silent_peer_raises_timeout() -> None:
    assert run_ranks(_silent_peer, 2, timeout=60) == {0: "timed out", 1: "waited"}


def _dropped(sock: socket.socket) -> bool:
    """Whether the other end closed the connection (a reset counts: it closed with our bytes unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _intruders(rank: int, world: int) -> float:
    if rank == 0:
        host, port = dist.default_group().transport.address
        with socket.create_connection((host, port), timeout=10) as garbage:
            garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + secrets.token_bytes(64))
            assert _dropped(garbage), "garbage greeting was not rejected"
        with socket.create_connection((host, port), timeout=10) as forger:
            forger.sendall(auth._HELLO.pack(auth._MAGIC, 1, 0, secrets.token_bytes(32)))
            forger.recv(64)  # the listener's challenge
            forger.sendall(secrets.token_bytes(32))  # a proof made without the secret
            assert _dropped(forger), "a forged proof was accepted"
        with socket.create_connection((host, port), timeout=10) as wrong_secret, pytest.raises(
                auth.AuthenticationError):
            auth.client_handshake(wrong_secret, b"not the secret", b"session", my_rank=1, peer_rank=0)
    tensor = torch.full((1000,), float(rank + 1))
    dist.all_reduce(tensor)
    return tensor[0].item()


def test_unauthenticated_connections_are_rejected_and_the_group_keeps_working() -> None:
    assert run_ranks(_intruders, 2, timeout=60) == {0: 3.0, 1: 3.0}


def test_a_forged_proof_is_refused_before_any_byte_after_it_is_read() -> None:
    listener, intruder = socket.socketpair()
    with listener, intruder:
        # Everything at once: greeting, a proof made without the secret, then what would be payload.
        payload = b"cos\nsystem\n(S'echo pwned'\ntR."
        intruder.sendall(auth._HELLO.pack(auth._MAGIC, 1, 0, secrets.token_bytes(32)) + secrets.token_bytes(32)
                         + payload)
        with pytest.raises(auth.AuthenticationError, match="failed the secret check"):
            auth.server_handshake(listener, b"the secret", b"session", my_rank=0, world_size=2,
                                  admit=lambda rank: None)
        listener.settimeout(5)
        assert listener.recv(len(payload) + 1) == payload  # still unread: nothing past the proof was


def test_a_forger_claiming_a_rank_first_does_not_take_its_place() -> None:
    secret, session = b"the secret", b"session"
    t0, t1 = (Transport(rank, 2, secret=secret, session=session, hosts=["127.0.0.1"],
                        stall_timeout=timedelta(seconds=10)) for rank in range(2))
    try:
        with socket.create_connection(t0.address, timeout=10) as forger:  # before rank 1 dials
            forger.sendall(auth._HELLO.pack(auth._MAGIC, 1, 0, secrets.token_bytes(32)))
            forger.recv(64)  # the listener's challenge
            forger.sendall(secrets.token_bytes(32))
            assert _dropped(forger), "a forged proof was accepted"
        t1.connect_mesh({0: t0.address}, timedelta(seconds=10))  # refused if the forger held rank 1
        t0.connect_mesh({}, timedelta(seconds=10))
    finally:
        t1.close()
        t0.close()


def test_busy_port_is_reported() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(OSError, match="already in use"):
            dist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                    timeout=timedelta(seconds=5))
    assert not dist.is_initialized()


def test_unreachable_store_is_reported_within_the_timeout() -> None:
    with pytest.raises(TimeoutError, match="unreachable"):
        dist.init_process_group("shoal", f"tcp://127.0.0.1:{free_port()}", rank=1, world_size=2,
                                timeout=timedelta(seconds=2))


def test_network_group_without_secret_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHOAL_SECRET", raising=False)
    store = Store.connect("127.0.0.1", 0, world_size=1, is_server=True, timeout=timedelta(seconds=5))
    with pytest.raises(ValueError, match="SHOAL_SECRET"):
        rendezvous.job_secret(store, 0, "10.1.2.3", timedelta(seconds=5))


def test_bad_arguments_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="rank 3 is outside"):
        rendezvous.resolve("tcp://127.0.0.1:1234", 3, 2)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        rendezvous.resolve("env://", None, None)
    with pytest.raises(ValueError, match="unknown backend"):
        dist.init_process_group("mpi", "tcp://127.0.0.1:1234", rank=0, world_size=1)


def test_rank_0_leaves_the_store_to_a_launcher_that_serves_it_at_that_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert rendezvous.resolve("env://", 0, 2).serves_store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert not rendezvous.resolve("env://", 0, 2).serves_store
    assert not rendezvous.resolve("tcp://127.0.0.1:1234", 0, 2).serves_store  # the same address
    assert rendezvous.resolve("tcp://127.0.0.1:1235", 0, 2).serves_store  # a store of the script's own
    assert not rendezvous.resolve("env://", 1, 2).serves_store


def _join(index: int, world: int, port: int, claims: list[tuple[int, int]], linger: bool) -> str:
    rank, world_size = claims[index]
    try:
        dist.init_process_group("shoal", f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=10))
    except (ValueError, TimeoutError) as exc:
        if linger:
            Store.connect("127.0.0.1", port, world_size=2, is_server=False,
                          timeout=timedelta(seconds=10)).set("refused", index)
        return f"{type(exc).__name__}: {exc}"
    if linger:  # rank 0 serves the store: it stays up until the refused process and rank 1 are done with it
        store = dist.default_group().store.raw
        store.wait(["refused"], timedelta(seconds=30))
        if rank == 0:
            store.wait(["released"], timedelta(seconds=30))
        else:
            store.set("released", b"1")
    return "joined"


def test_ranks_disagreeing_on_world_size_are_told() -> None:
    out = run_ranks(_join, 2, [(0, 2), (1, 3)], False, backend=None, timeout=60)
    assert all("world size mismatch" in msg for msg in out.values()), out


def test_rank_claimed_twice_is_told() -> None:
    out = run_ranks(_join, 3, [(0, 2), (1, 2), (1, 2)], True, backend=None, timeout=60)
    assert sum("claimed by two processes" in msg for msg in out.values()) == 1, out
