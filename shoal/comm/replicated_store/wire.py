"""The replicated store's messages: JSON objects, each after its length in four bytes. Values are bytes
(a process group's store may hold binary addresses), carried in base64."""

from __future__ import annotations

import base64
import json
import socket
import struct
from typing import Any

_LENGTH = struct.Struct("!I")
_MAX_MESSAGE = 1 << 30


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(body)) + body)


def receive(sock: socket.socket) -> dict[str, Any]:
    """The next message; ConnectionError where the other end closed the connection."""
    (length,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    if length > _MAX_MESSAGE:
        raise ConnectionError(f"store message of {length} bytes: not a shoal store at the other end")
    return json.loads(_exactly(sock, length))


def call(sock: socket.socket, message: dict[str, Any]) -> dict[str, Any]:
    send(sock, message)
    return receive(sock)


def pack(value: bytes) -> str:
    return base64.b64encode(value).decode()


def unpack(text: str) -> bytes:
    return base64.b64decode(text)


def split_address(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" (an IPv6 host keeps its colons)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _exactly(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the store's connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
