"""A free TCP port, for a rendezvous endpoint that the caller did not choose."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at this moment (the OS picks it); it may be taken again before use."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
