"""One worker's RRef context, as torch's RRefContext: the owner's table, which keeps a referenced
object alive exactly as long as some worker holds a reference to it, and the fork protocol, which
keeps the table right as references travel (forked into messages, adopted out of them, released).

The protocol follows PyTorch's reference counting with forks. The owner keeps each object with the
set of forks (user references on other workers) that point to it and frees it when the set is
empty and no local RRef is left. A worker that passes an RRef to another creates a fork. If the
worker owns the object, it records the fork in its table. Otherwise it first sends "add fork" to
the owner, on the same ordered connection that later carries its own "delete". The owner thus
learns of the child before it can forget the parent. A child's delete may overtake its own "add"
(they travel on different connections), so an unmatched delete is remembered as a tombstone and
cancels the add when that arrives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from shoal.rpc.future import Future
from shoal.rpc.headers import ForkChange, ForkId, RRefId
from shoal.rpc.message import Encoded, encode
from shoal.rpc.releaser import Releaser
from shoal.rpc.rref import reference_of

if TYPE_CHECKING:
    from shoal.rpc.rref import RRef


class Owned:
    """An object this worker owns on behalf of RRefs: its value (a future, as a remote() call may
    still be computing it) and the forks that hold it."""

    __slots__ = ("created", "forks", "rref_id", "value")

    def __init__(self, rref_id: RRefId) -> None:
        self.rref_id = rref_id
        self.value: Future[Any] = Future()
        self.forks: dict[ForkId, int] = {}  # fork -> rank holding it
        # False while only a fetch has named this id: the remote() call creating it is on its way.
        self.created = False


class OwnerTable:
    """The objects this worker owns that other workers reference."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[RRefId, Owned] = {}
        self._tombstones: set[tuple[RRefId, ForkId]] = set()

    def local(self, rref_id: RRefId, value: Any) -> Owned:
        """An entry for `RRef(value)`: held by the local RRef only, until it is first forked."""
        entry = Owned(rref_id)
        entry.created = True
        entry.value.set_result(value)
        return entry

    def entry(self, rref_id: RRefId) -> Owned:
        """The entry for `rref_id`, or a placeholder its creating remote() call will fill: a fetch, or
        a reference a holder sends home, can overtake that call (they travel on different connections)."""
        with self._lock:
            entry = self._entries.get(rref_id)
            if entry is None:
                entry = self._entries[rref_id] = Owned(rref_id)
            return entry

    def created_remotely(self, rref_id: RRefId, fork_id: ForkId, holder: int) -> Owned:
        """A remote() call arrived: the entry exists from now on, held by the caller's fork."""
        entry = self.entry(rref_id)
        with self._lock:
            entry.created = True
        self.add_fork(entry, fork_id, holder)
        return entry

    def add_fork(self, entry: Owned | RRefId, fork_id: ForkId, holder: int) -> None:
        with self._lock:
            if not isinstance(entry, Owned):
                entry = self._entries.setdefault(entry, Owned(entry))
            key = (entry.rref_id, fork_id)
            if key in self._tombstones:  # its delete overtook this add
                self._tombstones.discard(key)
            else:
                entry.forks[fork_id] = holder
                self._entries[entry.rref_id] = entry
            self._release_if_unheld(entry)

    def delete_fork(self, rref_id: RRefId, fork_id: ForkId) -> None:
        with self._lock:
            entry = self._entries.get(rref_id)
            if entry is None or fork_id not in entry.forks:
                self._tombstones.add((rref_id, fork_id))
                return
            del entry.forks[fork_id]
            self._release_if_unheld(entry)

    def drop_holder(self, rank: int) -> None:
        """A worker is gone: the references it held are gone with it."""
        with self._lock:
            for entry in list(self._entries.values()):
                for fork in [f for f, holder in entry.forks.items() if holder == rank]:
                    del entry.forks[fork]
                self._release_if_unheld(entry)

    def _release_if_unheld(self, entry: Owned) -> None:
        # Local RRefs keep the entry object (and so the value) alive on their own.
        if entry.created and not entry.forks:
            self._entries.pop(entry.rref_id, None)

    def __len__(self) -> int:
        """How many objects other workers hold references to."""
        with self._lock:
            return len(self._entries)


class Reference(NamedTuple):
    """What the fork protocol knows of one RRef: the object it names, on which worker, and which fork
    of it this reference is."""

    owner: int
    rref_id: RRefId
    fork_id: ForkId | None = None
    """The fork this reference is, on a holder; None on the owner."""
    entry: Owned | None = None
    """The owned object, on the owner only."""


ForkToken = tuple[int, RRefId, "ForkId | None"]  # (owner, object, fork): what a message carries for an RRef
MakeRRef = Callable[[Reference, "Future[None] | None"], "RRef"]


class RRefContext:
    """One worker's RRefs: the table of the objects it owns (`table`) and its end of the fork
    protocol. `tell_owner(owner, change)` sends a ForkChange on the connection to `owner`, in order
    with everything else this worker sends there; `make_rref(reference, created)` makes the RRef of
    a reference, bound to this worker's agent."""

    def __init__(self, rank: int, new_id: Callable[[], tuple[int, int]],
                 tell_owner: Callable[[int, ForkChange], None], make_rref: MakeRRef, name: str) -> None:
        self.rank = rank
        self.table = OwnerTable()
        self._new_id = new_id
        self._tell_owner = tell_owner
        self._make_rref = make_rref
        self._releaser = Releaser(lambda token: self._release_now(*token), f"shoal-rpc-release-{name}")

    # ---- references made here ------------------------------------------------------------------

    def own(self, value: Any) -> Reference:
        """The reference of `RRef(value)`: a new object owned here, held by that RRef alone until it
        is first forked."""
        entry = self.table.local(self._new_id(), value)
        return Reference(self.rank, entry.rref_id, None, entry)

    def own_later(self) -> Reference:
        """The reference of a remote() call to this worker itself: a new object owned here, whose value
        the call is still computing, held by the caller's RRef alone until it is first forked."""
        entry = Owned(self._new_id())
        entry.created = True
        return Reference(self.rank, entry.rref_id, None, entry)

    def make(self, reference: Reference, created: Future[None] | None = None) -> RRef:
        """The RRef of `reference`; `created` is the remote() call that creates its object, if any."""
        return self._make_rref(reference, created)

    # ---- references in messages -----------------------------------------------------------------

    def encode_for(self, dst: int, body: Any) -> Encoded:
        """Pickle `body` for `dst`, forking every RRef in it; undo the forks if pickling fails."""
        forks: list[ForkToken] = []

        def token(rref: RRef) -> ForkToken:
            forks.append(self._fork(reference_of(rref), dst))
            return forks[-1]

        try:
            return encode(body, token)
        except BaseException:
            for fork in forks:
                if fork[2] is not None:
                    self._releaser.put(fork)
            raise

    def _fork(self, reference: Reference, holder: int) -> ForkToken:
        owner, rref_id, _, entry = reference
        if holder == owner and entry is None:
            # Going home from a holder: no fork. The object cannot be freed before the message is read, since the
            # reference it is sent from, or the fork that reference came from, holds it until a
            # delete that the owner reads after this message (the same connection carries both).
            return (owner, rref_id, None)
        fork_id = self._new_id()
        if entry is not None:
            self.table.add_fork(entry, fork_id, holder)
        else:  # tell the owner before the message carrying the fork can reach anyone
            self._tell_owner(owner, ForkChange("add", rref_id, fork_id, holder))
        return (owner, rref_id, fork_id)

    def adopt(self, token: ForkToken) -> RRef:
        """The RRef a received token stands for."""
        owner, rref_id, fork_id = token
        if owner != self.rank:
            return self._make_rref(Reference(owner, rref_id, fork_id), None)
        if fork_id is None:  # sent home by a holder, whose fork keeps the entry (perhaps not yet created)
            return self._make_rref(Reference(owner, rref_id, None, self.table.entry(rref_id)), None)
        rref = self._make_rref(Reference(owner, rref_id, None, self.table.entry(rref_id)), None)
        self.table.delete_fork(rref_id, fork_id)  # the local RRef holds the object from now on
        return rref

    def on_change(self, change: ForkChange) -> None:
        """A holder's word about one of our objects."""
        if change.action == "add":
            self.table.add_fork(change.rref_id, change.fork_id, change.holder)
        elif change.action == "delete":
            self.table.delete_fork(change.rref_id, change.fork_id)

    # ---- references dropped ---------------------------------------------------------------------

    def release(self, reference: Reference) -> None:
        """A holder's RRef is gone (called from its __del__, so only queued here)."""
        self._releaser.put((reference.owner, reference.rref_id, reference.fork_id))

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
