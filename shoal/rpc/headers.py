"""The typed headers of RPC messages: what a request asks, how its answer went, and the RRef
bookkeeping between owners and holders. Each travels pickled in front of its payload, as its
class and field values: a dataclass's own pickling looks its fields up on every message."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

FunctionRef = tuple[str, str]  # (module, qualified name)
RRefId = tuple[int, int]  # (rank that created it, number)
ForkId = tuple[int, int]
# A notice riding in a request's header (agent/riders.py): its function, whether the receiver runs it on
# the reader thread, and its arguments, plain data pickled with the header.
Rider = tuple[FunctionRef, bool, tuple]


class Kind(int, Enum):
    """The kind of an RPC message; the wire hands each kind to its own handler."""

    REQUEST = 1
    RESPONSE = 2
    CONTROL = 3
    NOTICE = 4  # a call that is not answered


class Mode(str, Enum):
    """What a request asks of the callee."""

    CALL = "call"  # run a function, answer with its result
    REMOTE = "remote"  # run a function, keep its result as an owned object (remote())
    FETCH = "fetch"  # answer with a copy of an owned object (RRef.to_here())

    def __reduce_ex__(self, protocol: int) -> tuple:
        """By name, through a builtin: an Enum's own pickling looks the value up in Python code."""
        return getattr, (Mode, self._name_)  # not .name: a property, in Python


@dataclass(frozen=True, slots=True)
class AutogradTag:
    """Names the distributed autograd context a message belongs to and says where the gradients of
    its tensors that require grad go: to the send recorded on the sender (`send_id`, None if it
    recorded none), except for `forwarded` tensors, which the sender received and passes on
    unchanged: their gradients go straight to where they were made."""

    context_id: int
    send_id: int | None = None
    forwarded: tuple[tuple[int, int, int, int], ...] = ()  # (index here, origin's rank, send id, index)

    def __reduce__(self) -> tuple:
        return AutogradTag, (self.context_id, self.send_id, self.forwarded)


@dataclass(frozen=True, slots=True)
class Request:
    mode: Mode
    function: FunctionRef | None = None
    rref_id: RRefId | None = None
    fork_id: ForkId | None = None
    autograd: AutogradTag | None = None
    on_reader: bool = False  # a notice whose receiver runs it on the reader thread (`@runs_on_reader`)
    riders: tuple[Rider, ...] = ()  # notices riding along; a notice made only to carry them has no function

    def __reduce__(self) -> tuple:
        return Request, (self.mode, self.function, self.rref_id, self.fork_id, self.autograd, self.on_reader,
                         self.riders)


@dataclass(frozen=True, slots=True)
class Response:
    ok: bool
    autograd: AutogradTag | None = None

    def __reduce__(self) -> tuple:
        return Response, (self.ok, self.autograd)


@dataclass(frozen=True, slots=True)
class ForkChange:
    """A holder tells an owner that a fork of its object was made ("add") or dropped ("delete")."""

    action: str
    rref_id: RRefId
    fork_id: ForkId
    holder: int | None = None

    def __reduce__(self) -> tuple:
        return ForkChange, (self.action, self.rref_id, self.fork_id, self.holder)
