"""Shared memory that processes of one user on one host can map by name: the memory under shared-memory
lanes (lanes.py) and under the collectives of ranks on one host (arena.py).

A region is anonymous memory (memfd): it has no name in any file system, so nothing can be left
behind when a process dies. The creator announces `host/pid:fd:token` over an authenticated
connection; a peer of the same host (`host()`) opens /proc/PID/fd/FD (possible only on the same
machine, for the same user) and checks the random token written at the region's start, so a
same-numbered descriptor on another machine is never mistaken for it. Once every peer has mapped it,
the creator closes its descriptor.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading

from shoal import config

TOKEN = slice(0, 16)  # the region's random identity; what follows is the user's
HEADER_BYTES = 64  # the token, padded to a cache line


def host() -> str:
    """This host's identity: SHOAL_HOST_ID where set (ranks of one machine told apart, as if on several),
    else the kernel's boot id. Only ranks of one identity share memory."""
    named = config.SHOAL_HOST_ID.get()
    if named is not None:
        return named
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def available() -> bool:
    """Whether regions can be shared here: the platform has memfd and /proc (Linux) and SHOAL_SHM is not "0"."""
    return config.SHOAL_SHM.get() and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class Region:
    """A mapped region: our own (`create`) or a peer's (`open`)."""

    def __init__(self, memory: mmap.mmap, name: str, fd: int | None) -> None:
        self.memory = memory
        self.view = memoryview(memory)
        self.name = name
        self._fd = fd
        self._closing = threading.Lock()

    @classmethod
    def create(cls, size: int, label: str) -> Region:
        token = secrets.token_bytes(16)
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        memory[TOKEN] = token
        return cls(memory, f"{host()}/{os.getpid()}:{fd}:{token.hex()}", fd)

    @classmethod
    def open(cls, name: str, size: int) -> Region:
        """Map the region a peer announced as `name`; OSError or ValueError where it cannot be (another
        host, another user, another pid namespace)."""
        owner, _, rest = name.rpartition("/")
        pid, fd_number, token = rest.split(":") if rest.count(":") == 2 else ("", "", "")
        if not (owner and pid.isdigit() and fd_number.isdigit() and len(token) == 32):
            raise ValueError(f"bad shared-memory region name {name!r}")
        if owner != host():
            raise ValueError(f"shared-memory region {name} is on host {owner}, not ours ({host()})")
        # Mapped writable even where we only read: torch cannot wrap a read-only buffer.
        fd = os.open(f"/proc/{int(pid)}/fd/{int(fd_number)}", os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"shared-memory region {name} has the wrong size")
            memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if memory[TOKEN] != bytes.fromhex(token):
            raise ValueError(f"{name} is not the region the peer announced (another host?)")
        return cls(memory, name, None)

    def close_descriptor(self) -> None:
        """The mapping stays; the descriptor was only there for peers to open."""
        with self._closing:  # a reader thread and close() may both get here
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
