"""Rendezvous key-value store: torch's TCPStore, holding JSON values only (never pickle)."""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from shoal import config
from shoal.backoff import attempts
from shoal.comm.replicated_store import ReplicatedStore

DEFAULT_TIMEOUT = timedelta(seconds=300)


class Store:
    """JSON view over a `torch.distributed.TCPStore`, with every key under one prefix.

    The prefix scopes a job attempt (or a process group) so that keys left by an earlier
    attempt on the same server are never read by a later one.
    """

    def __init__(self, tcp_store: tdist.Store, prefix: str = "", *, parent: Store | None = None) -> None:
        self.raw = tcp_store
        self.prefix = prefix
        self._parent = parent  # keeps the shared connection (and its server, where we run it) alive while we are

    def scoped(self, prefix: str) -> Store:
        """A view of the same server with every key under `prefix` (after ours)."""
        return Store(self.raw, self.prefix + prefix, parent=self)

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        *,
        world_size: int,
        is_server: bool,
        timeout: timedelta = DEFAULT_TIMEOUT,
        prefix: str = "",
        stop: threading.Event | None = None,
    ) -> Store:
        """Start the store server (the launcher, or rank 0 without one) or connect to it, failing clearly
        within `timeout`; a client waiting for the server gives up (InterruptedError) once `stop` is set.
        The launcher's store under `shoal run --live` is replicated: its clients follow its primary."""
        replicas = config.SHOAL_STORE_REPLICAS.get()
        if replicas and not is_server and (host, port) == (config.MASTER_ADDR.get(), config.MASTER_PORT.get()):
            return cls(ReplicatedStore([*replicas, f"{host}:{port}"], timeout=timeout, stop=stop), prefix)
        if is_server:
            try:
                tcp = tdist.TCPStore(host, port, world_size, True, timeout=timeout,
                                     wait_for_workers=False)
            except RuntimeError as exc:
                if "EADDRINUSE" in str(exc) or "already in use" in str(exc):
                    raise OSError(
                        f"rendezvous port {host}:{port} is already in use; pick another "
                        f"MASTER_PORT or stop the process holding it"
                    ) from None
                raise
        else:
            # TCPStore retries for up to three times its timeout; probe first so an
            # unreachable endpoint is reported once, within the caller's deadline.
            _wait_until_reachable(host, port, timeout, stop)
            tcp = tdist.TCPStore(host, port, world_size, False, timeout=timeout)
        return cls(tcp, prefix)

    def set(self, key: str, value: Any) -> None:
        self.raw.set(self.prefix + key, json.dumps(value).encode())

    def get(self, key: str, *, timeout: timedelta = DEFAULT_TIMEOUT) -> Any:
        """The value under `key`, waiting for it to appear; TimeoutError after `timeout`."""
        self.wait([key], timeout=timeout)
        return json.loads(self.raw.get(self.prefix + key).decode())

    def wait(self, keys: list[str], *, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        full = [self.prefix + k for k in keys]
        try:
            self.raw.wait(full, timeout)
        except RuntimeError as exc:
            if "timeout" in str(exc).lower():
                raise TimeoutError(
                    f"rendezvous keys {keys} did not appear within {timeout.total_seconds():g}s"
                ) from None
            raise

    def has(self, key: str) -> bool:
        """Whether `key` is set, without waiting (a timed-out wait makes c10d log a warning)."""
        return self.raw.check([self.prefix + key])

    def add(self, key: str, amount: int) -> int:
        return int(self.raw.add(self.prefix + key, amount))

    def compare_set(self, key: str, desired: Any) -> Any:
        """Set `key` to `desired` unless it is set already; either way, its value now: the first writer wins."""
        return json.loads(self.raw.compare_set(self.prefix + key, "", json.dumps(desired)).decode())

    def replace(self, key: str, expected: Any, desired: Any) -> Any:
        """Set `key` to `desired` if it holds `expected`; either way, its value now."""
        return json.loads(self.raw.compare_set(self.prefix + key, json.dumps(expected), json.dumps(desired)).decode())


def _wait_until_reachable(host: str, port: int, timeout: timedelta, stop: threading.Event | None) -> None:
    deadline = time.monotonic() + timeout.total_seconds()
    error: OSError | None = None
    for _ in attempts(deadline):
        if stop is not None and stop.is_set():
            raise InterruptedError(f"stopped while waiting for the rendezvous store at {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            error = exc
    raise TimeoutError(f"rendezvous store at {host}:{port} is unreachable after {timeout.total_seconds():g}s "
                       f"({error}); check MASTER_ADDR/MASTER_PORT and that rank 0 (or the launcher) is running")
