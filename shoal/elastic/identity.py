"""The id a process goes by in the job's store: a launcher among the nodes (node_slots.py), a worker among
a generation's members (membership.py)."""

from __future__ import annotations

import os
import secrets
import socket


def member_id() -> str:
    """This process's id, unique in the job even across containers (which may share host names and PIDs)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
