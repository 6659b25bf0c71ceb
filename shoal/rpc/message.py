"""What an RPC message is on the wire, and how functions and errors travel.

A message is a pickled body plus the tensors taken out of it, which the body refers to by index;
how they travel is the wire's business (`agent/wire.py`). RRefs in a message are replaced by tokens
the RRef context hands out (the fork protocol, see `rref_context.py`). Unpickling runs arbitrary
code, which is safe here only because every connection proved knowledge of the job secret before a
byte of it was read.
"""

from __future__ import annotations

import importlib
import inspect
import io
import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.rpc.headers import FunctionRef

RRefToken = Callable[[Any], tuple]
AdoptRRef = Callable[[tuple], Any]


@dataclass
class Encoded:
    """A message ready to send: the body, the flat byte tensors it refers to, and (by index) the
    tensors among them that require grad, as they were before flattening (for distributed autograd)."""

    body: bytes
    tensors: list[torch.Tensor] = field(default_factory=list)
    grad_tensors: dict[int, torch.Tensor] = field(default_factory=dict)


def _tensor_in_message(*args: Any) -> torch.Tensor:
    """Stands for a tensor in a pickled body; the unpickler puts the rebuilding of the message's
    received tensors in its place."""
    raise pickle.UnpicklingError("a tensor of an RPC message can only be rebuilt along with the message")


def _rref_in_message(token: tuple) -> Any:
    """Stands for an RRef in a pickled body; the unpickler puts the fork protocol's adoption in
    its place, where it has one."""
    raise pickle.UnpicklingError("an RRef in an RPC message cannot be rebuilt here: no fork protocol "
                                 "adopts it (only a worker's RPC agent decodes RRefs)")


class _Pickler(pickle.Pickler):
    """Takes tensors out of a body and RRefs through the fork protocol. A reducer override, not a
    persistent id: pickle asks the latter about every object, the former not about plain ints,
    strings, tuples, lists and dicts, which are most of a body."""

    def __init__(self, file: io.BytesIO, rref_token: RRefToken | None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.grad_tensors: dict[int, torch.Tensor] = {}
        self._index: dict[int, int] = {}
        self._rref_token = rref_token

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return _tensor_in_message, self._tensor(obj)
        if self._rref_token is not None and getattr(type(obj), "_is_shoal_rref", False):  # not the class itself
            return _rref_in_message, (self._rref_token(obj),)
        return NotImplemented

    def _tensor(self, tensor: torch.Tensor) -> tuple:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise TypeError(f"RPC arguments and results must be dense CPU tensors; got one on "
                            f"{tensor.device} with layout {tensor.layout} (move it with .cpu() first)")
        index = self._index.get(id(tensor))
        if index is None:  # a tensor passed twice travels once
            index = self._index[id(tensor)] = len(self.tensors)
            self.tensors.append(tensor.detach().contiguous().view(-1).view(torch.uint8))
            if tensor.requires_grad:
                self.grad_tensors[index] = tensor
        # isinstance() of Parameter runs Python code (its metaclass): most tensors are plain ones
        kind = "tensor" if type(tensor) is torch.Tensor or not isinstance(tensor, torch.nn.Parameter) else "parameter"
        return (kind, index, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.requires_grad)


class _Received:
    """A message's received tensors, rebuilt as the body refers to them."""

    def __init__(self, tensors: list[torch.Tensor], grad_tensors: dict[int, torch.Tensor] | None) -> None:
        self._tensors = tensors
        self._rebuilt: dict[int, torch.Tensor] = {}
        self._grad_tensors = grad_tensors

    def tensor(self, kind: str, index: int, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> torch.Tensor:
        if index not in self._rebuilt:  # a tensor passed twice arrives as one tensor, as it left
            tensor = self._tensors[index].view(getattr(torch, dtype)).view(shape)
            self._rebuilt[index] = (torch.nn.Parameter(tensor, requires_grad=requires_grad) if kind == "parameter"
                                    else tensor.requires_grad_(requires_grad))
            if requires_grad and self._grad_tensors is not None:
                self._grad_tensors[index] = self._rebuilt[index]
        return self._rebuilt[index]


class _Unpickler(pickle.Unpickler):
    """Puts the received tensors and RRefs back where the body refers to them. What it hands the
    body for that must not refer back to the unpickler, which keeps it in its memo: the cycle
    would hold every tensor of the message (a lent shared-memory slot, say) until a garbage collection."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor], adopt_rref: AdoptRRef | None,
                 grad_tensors: dict[int, torch.Tensor] | None) -> None:
        super().__init__(file)
        self._received = _Received(tensors, grad_tensors)
        self._adopt_rref = adopt_rref

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__:
            if name == "_tensor_in_message":
                return self._received.tensor
            if name == "_rref_in_message" and self._adopt_rref is not None:
                return self._adopt_rref
        return super().find_class(module, name)


def encode(body: Any, rref_token: RRefToken | None = None) -> Encoded:
    """Pickle `body` with its tensors taken out; `rref_token(rref)` turns each RRef into a token."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, rref_token)
    pickler.dump(body)
    return Encoded(buffer.getvalue(), pickler.tensors, pickler.grad_tensors)


def decode(body: bytes | bytearray, tensors: list[torch.Tensor], adopt_rref: AdoptRRef | None = None,
           grad_tensors: dict[int, torch.Tensor] | None = None) -> Any:
    """Rebuild a body from its bytes and received tensors; `adopt_rref(token)` makes RRefs, and the
    rebuilt tensors that require grad are put into `grad_tensors` by index."""
    return _Unpickler(io.BytesIO(body), tensors, adopt_rref, grad_tensors).load()


# ---- functions, sent by reference -------------------------------------------------------------

_refs: dict[Callable, FunctionRef] = {}
_functions: dict[FunctionRef, Callable] = {}


def function_ref(func: Callable) -> FunctionRef:
    """(module, name) under which the callee can import `func`; TypeError if there is none."""
    try:
        return _refs[func]
    except (KeyError, TypeError):
        pass
    if inspect.ismethod(func):
        raise TypeError(f"{func!r} is a bound method; RPC sends functions by reference, so pass a "
                        f"module-level function, or call the method through an RRef (rref.rpc_sync().name())")
    module = getattr(func, "__module__", None)
    for name in (getattr(func, "__qualname__", None), getattr(func, "__name__", None)):
        if module and name and "<" not in name:
            try:
                if _resolve(module, name) is func:
                    _refs[func] = (module, name)
                    return module, name
            except (ImportError, AttributeError):
                continue
    raise TypeError(f"{func!r} cannot be sent by reference: RPC runs functions and classes defined at "
                    f"the top level of a module the callee can import, not lambdas or nested functions")


def _resolve(module: str, name: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


class UnknownFunctionError(LookupError):
    """The callee could not import the function a call named."""


def resolve_function(ref: FunctionRef, worker: str) -> Callable:
    try:
        return _functions[ref]
    except KeyError:
        pass
    try:
        func = _functions[ref] = _resolve(*ref)
    except (ImportError, AttributeError) as exc:
        raise UnknownFunctionError(f"worker {worker!r} has no function {ref[0]}.{ref[1]} ({exc}); RPC sends "
                                   f"functions by reference, so the callee must be able to import them") from None
    return func


# ---- errors, re-raised on the caller ----------------------------------------------------------

class RemoteTraceback(Exception):
    """The traceback of an exception raised on another worker, attached as `__cause__`."""

    def __str__(self) -> str:
        return self.args[0]


class RemoteError(RuntimeError):
    """A remote exception that could not be rebuilt as its own type on the caller."""


PackedError = tuple[bytes | None, str, str, str]


def pack_error(exc: BaseException, worker: str) -> PackedError:
    """The exception itself where it pickles, and always its type name, message and traceback."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        data: bytes | None = pickle.dumps(exc)
    except Exception:
        data = None
    try:
        message = str(exc)
    except Exception:  # a user's __str__ that fails must not keep the caller from hearing of the error
        message = f"<str() of the {type(exc).__name__} failed>"
    return data, f"{type(exc).__module__}.{type(exc).__qualname__}", message, f"on worker {worker!r}:\n{text}"


def unpack_error(packed: PackedError) -> BaseException:
    data, type_name, message, remote_traceback = packed
    exc: BaseException | None = None
    if data is not None:
        try:
            exc = pickle.loads(data)
        except Exception:
            exc = None  # its class takes other constructor arguments, or is unknown here
    if not isinstance(exc, Exception):  # also a SystemExit there, which must not end the caller
        exc = RemoteError(f"{type_name}: {message}")
    exc.__cause__ = RemoteTraceback(remote_traceback)
    return exc
