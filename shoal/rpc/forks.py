"""The fork protocol of RRefs as one worker runs it (see `rref.py` for why it is safe): forking a
reference into a message, adopting one out of a message, and releasing one when it is dropped."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shoal.rpc.headers import ForkChange, ForkId, RRefId
from shoal.rpc.message import Encoded, encode
from shoal.rpc.releaser import Releaser
from shoal.rpc.rref import Owned, OwnerTable

if TYPE_CHECKING:
    from shoal.rpc.rref import RRef

ForkToken = tuple[int, RRefId, "ForkId | None"]  # (owner, object, fork): what a message carries for an RRef
MakeRRef = Callable[[int, RRefId, "ForkId | None", "Owned | None"], "RRef"]


class Forks:
    """One worker's end of the fork protocol. `tell_owner(owner, change)` sends a ForkChange on the
    connection to `owner`, in order with everything else this worker sends there."""

    def __init__(self, rank: int, table: OwnerTable, new_id: Callable[[], tuple[int, int]],
                 tell_owner: Callable[[int, ForkChange], None], make_rref: MakeRRef, name: str) -> None:
        self.rank = rank
        self.table = table
        self._new_id = new_id
        self._tell_owner = tell_owner
        self._make_rref = make_rref
        self._releaser = Releaser(lambda token: self._release_now(*token), f"shoal-rpc-release-{name}")

    def encode_for(self, dst: int, body: Any) -> Encoded:
        """Pickle `body` for `dst`, forking every RRef in it; undo the forks if pickling fails."""
        forks: list[ForkToken] = []

        def token(rref: RRef) -> ForkToken:
            forks.append(self._fork(rref, dst))
            return forks[-1]

        try:
            return encode(body, token)
        except BaseException:
            for fork in forks:
                if fork[2] is not None:
                    self._releaser.put(fork)
            raise

    def _fork(self, rref: RRef, holder: int) -> ForkToken:
        if holder == rref._owner and rref._entry is None:
            # Going home from a holder: no fork. The object cannot be freed before the message is read, since the
            # reference it is sent from, or the fork that reference came from, holds it until a
            # delete that the owner reads after this message (the same connection carries both).
            return (rref._owner, rref._rref_id, None)
        fork_id = self._new_id()
        if rref._entry is not None:
            self.table.add_fork(rref._entry, fork_id, holder)
        else:  # tell the owner before the message carrying the fork can reach anyone
            self._tell_owner(rref._owner, ForkChange("add", rref._rref_id, fork_id, holder))
        return (rref._owner, rref._rref_id, fork_id)

    def adopt(self, token: ForkToken) -> RRef:
        """The RRef a received token stands for."""
        owner, rref_id, fork_id = token
        if owner != self.rank:
            return self._make_rref(owner, rref_id, fork_id, None)
        if fork_id is None:  # sent home by a holder, whose fork keeps the entry (perhaps not yet created)
            return self._make_rref(owner, rref_id, None, self.table.entry(rref_id))
        rref = self._make_rref(owner, rref_id, None, self.table.entry(rref_id))
        self.table.delete_fork(rref_id, fork_id)  # the local RRef holds the object from now on
        return rref

    def on_change(self, change: ForkChange) -> None:
        """A holder's word about one of our objects."""
        if change.action == "add":
            self.table.add_fork(change.rref_id, change.fork_id, change.holder)
        elif change.action == "delete":
            self.table.delete_fork(change.rref_id, change.fork_id)

    def release(self, owner: int, rref_id: RRefId, fork_id: ForkId) -> None:
        """A user RRef is gone (called from its __del__, so only queued here)."""
        self._releaser.put((owner, rref_id, fork_id))

    def _release_now(self, owner: int, rref_id: RRefId, fork_id: ForkId) -> None:
        if owner == self.rank:
            self.table.delete_fork(rref_id, fork_id)
        else:
            self._tell_owner(owner, ForkChange("delete", rref_id, fork_id))

    def flush(self, timeout: float) -> bool:
        """Wait until every release queued so far has been sent."""
        return self._releaser.flush(timeout)

    def stop(self, timeout: float) -> None:
        self._releaser.stop(timeout)
