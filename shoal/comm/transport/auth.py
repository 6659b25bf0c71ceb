"""Mutual HMAC challenge-response over the job secret, run on every new connection before any payload."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket
import struct
from collections.abc import Callable

from shoal.comm.transport.frame_header import recv_exact

_MAGIC = b"SHOAL\x00v1"
# Hello sent by the connecting side: magic, its rank, the rank it wants, a fresh nonce.
_HELLO = struct.Struct("<8sii32s")
_NONCE = 32
_MAC = 32
_ACCEPTED = b"\x01"


class AuthenticationError(ConnectionError):
    """A peer failed to prove knowledge of the job secret, or spoke something else entirely."""


class HandshakeAbandoned(AuthenticationError):
    """The peer closed the connection before finishing the handshake (a liveness probe does so at once)."""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    try:
        recv_exact(sock, memoryview(buf))
    except ConnectionResetError:
        raise HandshakeAbandoned("peer closed the connection during the handshake") from None
    return bytes(buf)


def client_handshake(sock: socket.socket, secret: bytes, session: bytes, *, my_rank: int, peer_rank: int) -> None:
    """Prove ourselves to `peer_rank`'s listener and check that it knows the secret too."""
    nonce_c = os.urandom(_NONCE)
    sock.sendall(_HELLO.pack(_MAGIC, my_rank, peer_rank, nonce_c))
    reply = _recv_exact(sock, _NONCE + _MAC)
    nonce_l, mac_l = reply[:_NONCE], reply[_NONCE:]
    ids = struct.pack("<ii", my_rank, peer_rank)
    if not hmac.compare_digest(mac_l, _mac(secret, b"listener", session, ids, nonce_c, nonce_l)):
        raise AuthenticationError(f"rank {peer_rank}'s listener does not know the job secret")
    sock.sendall(_mac(secret, b"connector", session, ids, nonce_l, nonce_c))
    if _recv_exact(sock, 1) != _ACCEPTED:
        raise AuthenticationError(f"rank {peer_rank} refused the connection")


def server_handshake(sock: socket.socket, secret: bytes, session: bytes, *, my_rank: int, world_size: int | None,
                     admit: Callable[[int], None]) -> int:
    """Authenticate an incoming connection and return the rank it proved to be (below `world_size`,
    or any rank if that is None); `admit(rank)` may still refuse it (raising) before the peer is told
    it is accepted."""
    magic, peer_rank, wanted, nonce_c = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
    if magic != _MAGIC:
        raise AuthenticationError("not a shoal peer (bad greeting)")
    if wanted != my_rank or peer_rank < 0 or (world_size is not None and peer_rank >= world_size) \
            or peer_rank == my_rank:
        raise AuthenticationError(f"greeting names ranks {peer_rank}->{wanted}, not valid for rank {my_rank}")
    nonce_l = os.urandom(_NONCE)
    ids = struct.pack("<ii", peer_rank, my_rank)
    sock.sendall(nonce_l + _mac(secret, b"listener", session, ids, nonce_c, nonce_l))
    proof = _recv_exact(sock, _MAC)
    if not hmac.compare_digest(proof, _mac(secret, b"connector", session, ids, nonce_l, nonce_c)):
        raise AuthenticationError(f"a connection claiming to be rank {peer_rank} failed the secret check")
    admit(peer_rank)
    sock.sendall(_ACCEPTED)
    return peer_rank
