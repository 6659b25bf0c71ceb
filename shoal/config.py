"""Every environment variable shoal reads, declared once: its name, default, type, check and a line of doc.

A variable is read when it is needed (`SHOAL_HEAL_TIMEOUT.get()`), so a test or a launcher may set it for
one process (the flight recorder's capacity is needed when shoal.observe.flight is first imported); a
value that fails its check raises ValueError naming the variable. This module imports nothing of
shoal's, so every layer may read its settings here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable: `get()` is its value, or `default` where it is unset or empty."""

    name: str
    default: T
    parse: Callable[[str], T]
    """Turns the text into the value; raises ValueError (with what was expected) on bad text."""
    doc: str
    """One line for users: what it sets, and who sets it when a user normally does not."""
    user: bool = True
    """Whether a user sets it (the README lists these); False for those the launcher sets for its workers."""

    def get(self) -> T:
        text = os.environ.get(self.name)
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(f"{self.name}={text!r}: {exc}") from None


def _float_seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("expected a number of seconds") from None


def _seconds(text: str) -> float:
    seconds = _float_seconds(text)
    if seconds < 0:
        raise ValueError("expected a number of seconds, 0 or more")
    return seconds


def _positive_seconds(text: str) -> float:
    seconds = _float_seconds(text)
    if seconds <= 0:
        raise ValueError("expected a positive number of seconds")
    return seconds


def _count(text: str) -> int:
    if not text.isdigit():
        raise ValueError("expected a whole number, 0 or more")
    return int(text)


def _streams(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_STREAMS:
        raise ValueError(f"expected a whole number from 1 to {MAX_STREAMS}")
    return int(text)


def _switch(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("expected 1 (on) or 0 (off)")
    return text == "1"


def _interfaces(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    if any(not name or len(os.fsencode(name)) > 15 or any(c in "/:" or c.isspace() for c in name) for name in names):
        raise ValueError("expected network interfaces' names (each at most 15 bytes, no '/', ':' or space), "
                         "as `ip link` lists them, separated by commas")
    if len(set(names)) < len(names):
        raise ValueError("expected each interface once")
    if len(names) > MAX_STREAMS:
        raise ValueError(f"expected at most {MAX_STREAMS} interfaces (a pair of ranks keeps a connection on each, "
                         f"of at most {MAX_STREAMS})")
    return names


def _host_id(text: str) -> str:
    if len(text) > 64 or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in text):
        raise ValueError("expected a name of at most 64 ASCII letters, digits, '-', '_' or '.'")
    return text


# ---- what users set ---------------------------------------------------------------------------------

SHOAL_SECRET = Variable[str | None](
    "SHOAL_SECRET", None, str,
    "the job secret every connection proves; required when ranks talk over a real network (`shoal run` draws one)")
SHOAL_TIMEOUT_S = Variable[float | None](
    "SHOAL_TIMEOUT_S", None, _positive_seconds,
    "seconds that override the default operation timeout of process groups (5 minutes)")
SHOAL_HEAL_TIMEOUT = Variable[float](
    "SHOAL_HEAL_TIMEOUT", 10.0, _positive_seconds, "seconds a dropped connection may take to heal")
SHOAL_HEARTBEAT_TIMEOUT = Variable[float](
    "SHOAL_HEARTBEAT_TIMEOUT", 5.0, _positive_seconds, "seconds of silence after which a peer is given up")
SHOAL_SHM = Variable[bool](
    "SHOAL_SHM", True, _switch, "0: ranks on one host talk over TCP only, without shared memory")
MAX_STREAMS = 8  # a part's index and count have 3 bits each (comm/transport/striping.py)
SHOAL_STREAMS = Variable[int](
    "SHOAL_STREAMS", 1, _streams,
    "TCP connections from each rank to each other rank of a process group; large frames go round them, for "
    "networks that cap each connection's rate (every rank must give the same number)")
SHOAL_SOCKET_IFNAME = Variable[tuple[str, ...] | None](
    "SHOAL_SOCKET_IFNAME", None, _interfaces,
    "the network interface (eth1, ...) whose address ranks listen on, over the one that reaches the store: for "
    "hosts whose fast network is other than the store's (gloo's GLOO_SOCKET_IFNAME); several, separated by "
    "commas (eth1,eth2), carry a pair's connections in turn, at least one each")
SHOAL_HOST_ID = Variable[str | None](
    "SHOAL_HOST_ID", None, _host_id,
    "names the host this rank is on, over the boot id: ranks share memory only with those of the same name")
SHOAL_TRACE = Variable[str | None](
    "SHOAL_TRACE", None, str, "a directory: trace this process into it, as `shoal run --trace DIR` does")
SHOAL_FLIGHT_RECORDER = Variable[int](
    "SHOAL_FLIGHT_RECORDER", 2000, _count, "operations the flight recorder keeps (0: off)")
SHOAL_FLIGHT_DIR = Variable[str | None](
    "SHOAL_FLIGHT_DIR", None, str, "where flight records go (default: SHOAL_TRACE, else only when asked)")
SHOAL_PROGRESS_EVERY_S = Variable[float](
    "SHOAL_PROGRESS_EVERY_S", 10.0, _seconds, "seconds between plain progress lines (not in a terminal; 0: every item)")
SHOAL_TTY = Variable[bool](
    "SHOAL_TTY", False, _switch, "1: draw progress bars even where output is not a terminal")

# ---- what the launcher sets for its workers (torchrun's names where torchrun has one) -------------------

RANK = Variable[int | None]("RANK", None, _count, "this worker's rank in the job", user=False)
WORLD_SIZE = Variable[int | None]("WORLD_SIZE", None, _count, "the job's number of workers", user=False)
LOCAL_RANK = Variable[int | None]("LOCAL_RANK", None, _count, "this worker's rank on its host", user=False)
MASTER_ADDR = Variable[str | None]("MASTER_ADDR", None, str, "the host of the job's store", user=False)
MASTER_PORT = Variable[int | None]("MASTER_PORT", None, _count, "the port of the job's store", user=False)
TORCHELASTIC_USE_AGENT_STORE = Variable[bool](
    "TORCHELASTIC_USE_AGENT_STORE", False, lambda text: text == "True",
    "True: the launcher serves the store at MASTER_ADDR:MASTER_PORT, and workers connect to it", user=False)
TORCHELASTIC_RUN_ID = Variable[str | None](
    "TORCHELASTIC_RUN_ID", None, str, "the job's id (--rdzv-id): set where a launcher started this worker", user=False)
SHOAL_RESTART_COUNT = Variable[int](
    "SHOAL_RESTART_COUNT", 0, _count, "how many times the launcher has restarted the workers", user=False)
SHOAL_LIVE = Variable[bool]("SHOAL_LIVE", False, _switch, "1: the job runs with live recovery (--live)", user=False)
SHOAL_MIN_WORKERS = Variable[int | None](
    "SHOAL_MIN_WORKERS", None, _count, "live recovery: fewer members than this wait for more",
    user=False)
SHOAL_STORE_REPLICAS = Variable[list[str]](
    "SHOAL_STORE_REPLICAS", [], lambda text: text.split(","),
    "replicas of the job's store (host:port,...): the store at MASTER_ADDR:MASTER_PORT is replicated (--live)",
    user=False)
SHOAL_JOINING = Variable[bool](
    "SHOAL_JOINING", False, _switch, "1: this worker replaces a lost one and joins the running job", user=False)

VARIABLES: tuple[Variable, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Variable))
