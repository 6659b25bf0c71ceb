"""The id a process goes by in the job's store: a launcher among the nodes (node_slots.py), a worker among
a generation's members (membership.py)."""

from __future__ import annotations

import os
import secrets
import socket

_ids: dict[int, str] = {}  # by PID: a forked child is a process of its own


def member_id() -> str:
    """This process's id, unique in the job even across containers (which may share host names and PIDs),
    and the same for all of its parts (its trainings, one after another)."""
    pid = os.getpid()
    if pid not in _ids:
        _ids[pid] = f"{socket.gethostname()}:{pid}:{secrets.token_hex(4)}"
    return _ids[pid]
