"""A client of the job's replicated store, as a `torch.distributed.Store` (so torch's process groups can
use it too). It talks to the primary; when the primary is lost it finds the replica that took over and
sends the request in flight again, numbered as before, so a change the lost primary had already made
is not made twice. It follows replicas only forward in their terms: a replica that took over without
the changes this client has seen is refused.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from shoal.backoff import attempts
from shoal.comm.replicated_store import wire

_CONNECT_S = 1.0
_REPLY_S = 10.0  # longer than any answer takes (a primary waits at most a second for each follower)
_FAILOVER_S = 30.0  # how long a request looks for a primary before it fails


class ReplicatedStore(tdist.Store):
    """Reach the store through `seeds` ("host:port" of any replicas). Waits for keys end after `timeout`;
    the first connection is waited for up to `timeout` too, or until `stop` is set (InterruptedError)."""

    def __init__(self, seeds: list[str], *, timeout: timedelta = timedelta(seconds=300),
                 stop: threading.Event | None = None) -> None:
        super().__init__()
        self._known = list(dict.fromkeys(seeds))
        self._timeout = timeout
        self._stop = stop
        self._made_in = os.getpid()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._client, self._seq = secrets.token_hex(8), 0
        self._term, self._term_address, self._store_id = -1, "", None
        with self._lock:
            self._connect(time.monotonic() + timeout.total_seconds())

    @property
    def host(self) -> str:
        """The primary's host, as TCPStore's `host`: the interface that reaches it is the one peers can reach."""
        return wire.split_address(self._term_address)[0]

    # ---- torch's Store ---------------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._call({"op": "set", "key": key, "value": wire.pack(_bytes(value))})

    def get(self, key: str) -> bytes:
        while True:
            self.wait([key])
            value = self._call({"op": "get", "key": key})
            if value is not None:  # else deleted since: wait for it again
                return wire.unpack(value)

    def add(self, key: str, amount: int) -> int:
        return self._call({"op": "add", "key": key, "amount": amount})

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return wire.unpack(self._call({"op": "compare_set", "key": key, "expected": wire.pack(_bytes(expected)),
                                       "desired": wire.pack(_bytes(desired))}))

    def delete_key(self, key: str) -> bool:
        return self._call({"op": "delete", "key": key})

    def check(self, keys: list[str]) -> bool:
        return self._call({"op": "check", "keys": list(keys)})

    def num_keys(self) -> int:
        return self._call({"op": "num_keys"})

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Until every key is set; RuntimeError naming the timeout (as TCPStore's) after `timeout`."""
        timeout = self._timeout if timeout is None else timeout
        for _ in attempts(time.monotonic() + timeout.total_seconds(), first=0.001, limit=0.05, factor=1.5):
            if self.check(keys):
                return
        raise RuntimeError(f"wait timeout after {timeout.total_seconds():g}s for keys {list(keys)}")

    # ---- reaching the primary --------------------------------------------------------------------------

    def _call(self, request: dict[str, Any]) -> Any:
        if os.getpid() != self._made_in:  # a forked child: the connection is the parent's
            self._made_in, self._lock, self._sock = os.getpid(), threading.Lock(), None
            self._client = secrets.token_hex(8)
        with self._lock:
            self._seq += 1
            request = dict(request, client=self._client, seq=self._seq)
            deadline = None
            while True:
                if self._sock is None:
                    if deadline is not None and time.monotonic() > deadline:
                        raise ConnectionError(f"the job's store did not answer {request['op']} within "
                                              f"{_FAILOVER_S:g}s (its replicas: {self._known})")
                    deadline = deadline or time.monotonic() + _FAILOVER_S
                    self._connect(deadline)
                try:
                    reply = wire.call(self._sock, request)
                except (OSError, ValueError):
                    self._drop()
                    continue
                self._learn(reply)
                if "error" in reply:  # it is not the primary any more
                    self._drop()
                    continue
                return reply["result"]

    def _connect(self, deadline: float) -> None:
        refused: list[str] = []
        for _ in attempts(deadline, first=0.02, limit=0.2):
            if self._stop is not None and self._stop.is_set():
                raise InterruptedError(f"stopped while looking for the job's store at {self._known}")
            for address in list(self._known):
                try:
                    sock = socket.create_connection(wire.split_address(address), timeout=_CONNECT_S)
                except OSError:
                    continue
                try:
                    sock.settimeout(_REPLY_S)
                    reply = wire.call(sock, {"op": "hello"})
                except (OSError, ValueError):
                    sock.close()
                    continue
                self._learn(reply)
                if reply["primary"] and self._follows_on(address, reply["term"], reply["store"]):
                    self._sock, self._term, self._term_address = sock, reply["term"], address
                    self._store_id = reply["store"]
                    return
                if reply["primary"]:
                    refused.append(f"{address} (term {reply['term']}, store {reply['store']})")
                sock.close()
        if refused:
            raise ConnectionError(f"the job's store lost changes: replicas {sorted(set(refused))} took over without "
                                  f"those this client saw from {self._term_address} in term {self._term} of store "
                                  f"{self._store_id}")
        raise ConnectionError(f"no replica of the job's store answers as its primary (tried {self._known}); "
                              f"check MASTER_ADDR/MASTER_PORT and that a launcher of the job is running")

    def _follows_on(self, address: str, term: int, store: str) -> bool:
        if self._store_id is not None and store != self._store_id:
            return False  # a new, empty store on a lost replica's address
        return term > self._term or (term == self._term and address == self._term_address)

    def _learn(self, reply: dict[str, Any]) -> None:
        self._known = list(dict.fromkeys([*reply.get("replicas", []), *self._known]))

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
