"""What a forked process inherits: copies of its parent's objects, but of its threads only the one that
forked. A lock another thread held at the fork stays held for good, and the threads that served a
process group, an RPC agent or a pool are gone while their objects still look alive. So modules renew
their locks in a child, and objects that need their threads refuse to work there, naming the remedy."""

from __future__ import annotations

import os
import threading


def renew_locks_in_child(namespace: dict, *names: str) -> None:
    """After a fork, give the child new (unheld) locks under `names` in the module `namespace`."""

    def renew() -> None:
        for name in names:
            namespace[name] = threading.Lock()

    os.register_at_fork(after_in_child=renew)


def refuse_in_child(made_in: int, what: str, remedy: str) -> None:
    """RuntimeError if this is not process `made_in`, where `what` was made: a child forked from it."""
    if os.getpid() != made_in:
        raise RuntimeError(f"{what} was made in process {made_in}, which forked this one ({os.getpid()}); a forked "
                           f"process has none of its threads: {remedy}, or start this process with 'spawn'")
