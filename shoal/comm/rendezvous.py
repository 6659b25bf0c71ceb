"""Rendezvous: turn `init_method`, rank and world size into a shared store every rank has joined,
checking that the ranks agree on the world size and that no rank is claimed twice.

Under a launcher (`shoal run`, torchrun) the store at MASTER_ADDR:MASTER_PORT is the launcher's: it
says so with TORCHELASTIC_USE_AGENT_STORE=True, as torchrun does, and every rank joins it as a client,
so the store outlives any worker. Otherwise rank 0 serves it."""

from __future__ import annotations

import collections
import fcntl
import os
import secrets
import socket
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlparse

import torch.distributed as tdist

from shoal import config
from shoal.comm.replicated_store import ReplicatedStore
from shoal.comm.store import DEFAULT_TIMEOUT, Store
from shoal.comm.transport.auth import is_loopback

T = TypeVar("T")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    rank: int
    world_size: int

    @property
    def serves_store(self) -> bool:
        """Whether this rank runs the store's server: rank 0, unless the launcher runs it."""
        return self.rank == 0 and not _served_by_launcher(self.host, self.port)


def store_address(init_method: str) -> tuple[str, int]:
    """The store's host and port, from `env://` variables or a `tcp://` URL."""
    url = urlparse(init_method)
    if url.scheme == "env":
        return _env(config.MASTER_ADDR), _env(config.MASTER_PORT)
    if url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise ValueError(f"init_method {init_method!r} must look like tcp://host:port")
        return url.hostname, url.port
    raise ValueError(f"init_method {init_method!r}: resolve takes env:// or tcp://host:port")


def world_size_given(init_method: str, world_size: int | None) -> bool:
    """Whether a world size is given: as an argument, or (env://) in WORLD_SIZE."""
    return world_size is not None or (urlparse(init_method).scheme == "env" and config.WORLD_SIZE.get() is not None)


def resolve(init_method: str, rank: int | None, world_size: int | None) -> Endpoint:
    """Read the store address and this rank's place from `env://` variables or a `tcp://` URL."""
    host, port = store_address(init_method)
    if urlparse(init_method).scheme == "env":
        rank = _env(config.RANK) if rank is None else rank
        world_size = _env(config.WORLD_SIZE) if world_size is None else world_size
    elif rank is None or world_size is None:
        raise ValueError("init_method tcp://... needs rank= and world_size= arguments")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1} for world_size {world_size}")
    return Endpoint(host, port, rank, world_size)


def _served_by_launcher(host: str, port: int) -> bool:
    return (config.TORCHELASTIC_USE_AGENT_STORE.get()
            and (host, port) == (config.MASTER_ADDR.get(), config.MASTER_PORT.get()))


def _env(variable: config.Variable[T | None]) -> T:
    value = variable.get()
    if value is None:
        raise ValueError(f"init_method env:// needs the environment variable {variable.name} (the launcher "
                         f"`shoal run` sets it), or pass it as an argument")
    return value


# Store connections of this process by endpoint, shared while anyone uses them: a job that runs a
# process group and RPC on the same MASTER_ADDR:MASTER_PORT needs one server, not two.
_connections: weakref.WeakValueDictionary[tuple[str, int], Store] = weakref.WeakValueDictionary()
_connecting = threading.Lock()
# How often this process has joined each namespace of each endpoint: the n-th join registers under
# NAMESPACE/n/, so a group started again (init, destroy, init) while the store lives on, kept by the
# other user of the connection, never meets the claims of its earlier incarnation. Every rank
# starts and stops its groups in the same order, so all of them count alike.
_joins: collections.Counter[tuple[Hashable, str]] = collections.Counter()


def _forget_in_child() -> None:
    """A forked child connects to stores anew: its parent's connections are the parent's to use."""
    global _connections, _connecting, _joins
    _connections, _connecting, _joins = weakref.WeakValueDictionary(), threading.Lock(), collections.Counter()


os.register_at_fork(after_in_child=_forget_in_child)


def join(endpoint: Endpoint, timeout: timedelta, namespace: str = "shoal/") -> Store:
    """Connect to the store (or serve it, see the module's doc) and register under `namespace`; every rank leaves
    having seen all others. Joins under different namespaces share one connection."""
    return join_store(connection(endpoint, timeout), (endpoint.host, endpoint.port), endpoint.rank,
                      endpoint.world_size, timeout, namespace)


def client(host: str, port: int, timeout: timedelta) -> Store:
    """This process's connection to the store at host:port, as a client (a worker that joins a group
    that is running never serves its store)."""
    return connection(Endpoint(host, port, rank=-1, world_size=1), timeout)


def connection(endpoint: Endpoint, timeout: timedelta) -> Store:
    """This process's connection to the store at `endpoint`, shared by every user (served here where the
    module's doc says so)."""
    with _connecting:
        base = _connections.get((endpoint.host, endpoint.port))
        if base is None:
            base = Store.connect(endpoint.host, endpoint.port, world_size=endpoint.world_size,
                                 is_server=endpoint.serves_store, timeout=timeout)
            _connections[(endpoint.host, endpoint.port)] = base
        return base


def join_store(base: Store, key: Hashable | None, rank: int, world_size: int, timeout: timedelta,
               namespace: str = "shoal/") -> Store:
    """Register this rank under `namespace` of a store it has already reached, and wait for every other rank:
    the part of `join` that any store serves. `key` names the store for this process's count of joins; for a
    store a script hands over (None), each rank counts its joins in the store itself instead."""
    if key is None:
        incarnation = base.add(f"{namespace}joins/{rank}", 1) - 1
    else:
        with _connecting:
            incarnation = _joins[key, namespace]
            _joins[key, namespace] += 1
    store = base.scoped(f"{namespace}{incarnation}/")
    if store.add(f"claims/{rank}", 1) > 1:
        raise ValueError(f"rank {rank} was claimed by two processes; every process needs its own RANK")
    # Rank 0 may serve the store and leaves as soon as it sees a mismatch, so every other rank reads
    # rank 0's entry before it writes its own: its last call then is one rank 0 waits for.
    first = world_size if rank == 0 else store.get("joined/0", timeout=timeout)
    store.set(f"joined/{rank}", world_size)
    if first != world_size:
        raise ValueError(f"world size mismatch: rank 0 has world_size={first} but rank {rank} "
                         f"has world_size={world_size}")
    keys = [f"joined/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout=timeout)
    except TimeoutError:
        missing = [r for r in range(world_size) if not store.raw.check([store.prefix + keys[r]])]
        raise TimeoutError(f"rank {rank}: ranks {missing} did not join within "
                           f"{timeout.total_seconds():g}s (world_size={world_size})") from None
    for r in range(1, world_size):
        theirs = store.get(f"joined/{r}", timeout=timeout)
        if theirs != world_size:
            raise ValueError(f"world size mismatch: rank {rank} has world_size={world_size} "
                             f"but rank {r} has world_size={theirs}")
    return store


def store_host(store: tdist.Store) -> str:
    """The host of the TCPStore under torch's prefixes, toward which ranks listen (`listen_addresses`; loopback
    for a store in files or in memory)."""
    while isinstance(store, tdist.PrefixStore):
        store = store.underlying_store
    return store.host if isinstance(store, (tdist.TCPStore, ReplicatedStore)) else "127.0.0.1"


def listen_addresses(store_host: str) -> list[str]:
    """The addresses a rank listens on and publishes to its peers: those of the interfaces SHOAL_SOCKET_IFNAME
    names, else that of the interface that reaches the store, which its peers reach it by too. A store on
    loopback means every rank is on this host: they stay on loopback, whatever the variable says (it may be set
    for a whole cluster)."""
    names = config.SHOAL_SOCKET_IFNAME.get()
    if names is None or is_loopback(store_host):
        return [local_address_towards(store_host)]
    addresses = [interface_address(name) for name in names]
    for name, address in zip(names, addresses, strict=True):
        if is_loopback(address):
            raise ValueError(f"SHOAL_SOCKET_IFNAME={name!r} is a loopback interface, which ranks on other hosts "
                             f"cannot reach (the store is at {store_host})")
        if (same := [other for other, a in zip(names, addresses, strict=True) if a == address]) != [name]:
            raise ValueError(f"SHOAL_SOCKET_IFNAME names {', '.join(same)}, which have one address, {address}: "
                             f"name one interface on each network")
    return addresses


_SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address
_LISTED_INTERFACES = 20  # a container host may have hundreds (a veth per container)


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name`; ValueError naming this host's interfaces where it has no
    such interface, or naming the interface where it has no IPv4 address."""
    if not sys.platform.startswith("linux"):
        raise ValueError(f"SHOAL_SOCKET_IFNAME={name!r}: naming an interface works on Linux only")
    names = [interface for _, interface in socket.if_nameindex()]
    if name not in names:
        listed = ", ".join(names[:_LISTED_INTERFACES]) + (", ..." if len(names) > _LISTED_INTERFACES else "")
        raise ValueError(f"SHOAL_SOCKET_IFNAME={name!r}: this host has no network interface of that name (it has "
                         f"{listed}; names exactly as these, separated by commas)")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", os.fsencode(name)))
        except OSError as exc:
            raise ValueError(f"SHOAL_SOCKET_IFNAME={name!r}: the interface has no IPv4 address ({exc.strerror})") \
                from None
    return socket.inet_ntoa(answer[20:24])  # after the name (16 bytes), the address's family and port


def local_address_towards(host: str) -> str:
    """The address of the interface this machine uses to reach `host` (no packet is sent)."""
    if is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


def job_secret(store: Store, rank: int, bind_host: str, timeout: timedelta) -> tuple[bytes, bytes]:
    """The job secret (SHOAL_SECRET) and a per-group session id that binds handshakes to this group.

    Without SHOAL_SECRET, a group confined to loopback draws a secret through the store (only local
    processes can reach it); a group on a real network refuses to start rather than run unauthenticated.
    """
    if rank == 0:
        store.set("session", secrets.token_hex(16))
    session = store.get("session", timeout=timeout).encode()
    secret = config.SHOAL_SECRET.get()
    if secret:
        return secret.encode(), session
    if not is_loopback(bind_host):
        raise ValueError(f"SHOAL_SECRET is not set and this process group would listen on {bind_host}, "
                         f"which is not loopback; set SHOAL_SECRET to the same random string on every "
                         f"rank (`shoal run` does this for you)")
    if rank == 0:
        store.set("loopback-secret", secrets.token_hex(32))
    return store.get("loopback-secret", timeout=timeout).encode(), session


# torch's rendezvous handlers by URL scheme: `init_method` URLs of other schemes than env://, tcp:// and
# file:// reach their store through these, as in torch.
_handlers: dict[str, Callable[..., Iterator[tuple[tdist.Store, int, int]]]] = {}
# Connections `rendezvous` has handed out as torch's stores: kept, so that a later join of the same
# endpoint in this process shares the connection (and the server, where this process serves it).
_lent: list[Store] = []


def register_rendezvous_handler(scheme: str, handler: Callable[..., Iterator[tuple[tdist.Store, int, int]]]) -> None:
    """Let `init_method` URLs of `scheme` reach their store through `handler(url, **kwargs)`, an iterator
    of (store, rank, world_size), as torch's handlers are: rank and world size come in the URL's query."""
    if scheme in _handlers or scheme in ("env", "tcp", "file"):
        raise RuntimeError(f"rendezvous handler for {scheme}:// is already registered")
    _handlers[scheme] = handler


def rendezvous(url: str, rank: int = -1, world_size: int = -1, **kwargs: Any) -> Iterator[tuple[tdist.Store, int, int]]:
    """torch's `rendezvous`: (store, rank, world_size) for `url`. Rank and world size given here go into the
    URL's query (`?rank=0&world_size=2`), which must not name them too; env:// reads what neither gives from
    the environment."""
    parsed = urlparse(url)
    query = dict(pair.split("=", 1) for pair in parsed.query.split("&") if "=" in pair)
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value != -1:
            if name in query:
                raise ValueError(f"rendezvous: {name} is given both in {url!r} and as an argument")
            query[name] = str(value)
    url = parsed._replace(query="&".join(f"{k}={v}" for k, v in query.items())).geturl()
    rank, world_size = int(query.get("rank", -1)), int(query.get("world_size", -1))
    if parsed.scheme in _handlers:
        yield from _handlers[parsed.scheme](url, **kwargs)
        return
    if parsed.scheme == "file":
        if world_size < 1 or rank < 0:
            raise ValueError(f"init_method {url!r} needs rank= and world_size= (arguments or query)")
        yield tdist.FileStore(parsed.path, world_size), rank, world_size
        return
    endpoint = resolve(url.split("?", 1)[0], None if rank == -1 else rank, None if world_size == -1 else world_size)
    store = connection(endpoint, kwargs.get("timeout", DEFAULT_TIMEOUT))
    _lent.append(store)
    yield store.raw, endpoint.rank, endpoint.world_size
