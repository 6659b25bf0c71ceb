"""Notices: calls that nobody waits for and nobody answers. They go now (`notify`) or soon, riding on
the next message to their worker (`notify_soon`, riders.py); they run as they arrive, on the
connection's reader thread or on the pool, and only a log tells of a failure."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from shoal.rpc.agent.riders import Riders
from shoal.rpc.agent.running import Runner
from shoal.rpc.agent.wire import Wire
from shoal.rpc.functions import is_run_on_reader
from shoal.rpc.headers import FunctionRef, Kind, Mode, Request, Rider
from shoal.rpc.message import Encoded, decode, function_ref
from shoal.rpc.rref_context import RRefContext

log = logging.getLogger(__name__)


class Notices:
    """This worker's notices, out and in. `ids` numbers the messages this worker sends."""

    def __init__(self, name: str, *, wire: Wire, ids: Iterator[int], rrefs: RRefContext, runner: Runner) -> None:
        self._name = name
        self._wire = wire
        self._ids = ids
        self._rrefs = rrefs
        self._runner = runner
        self._riders = Riders(self._send_alone, f"shoal-rpc-notices-{name}")

    # ---- out ------------------------------------------------------------------------------------

    def notify(self, dst: int, func: Any, args: tuple) -> None:
        """Run `func(*args)` on rank `dst` without waiting for it (`RpcAgent.notify`)."""
        ref = function_ref(func)
        payload = self._rrefs.encode_for(dst, (args, {}))
        header = Request(Mode.CALL, ref, on_reader=is_run_on_reader(func), riders=self._riders.take(dst))
        self._wire.send(dst, Kind.NOTICE, next(self._ids), header, payload)

    def notify_soon(self, dst: int, func: Any, args: tuple) -> None:
        """`notify`, riding on the next request or notice to `dst` (`RpcAgent.notify_soon`)."""
        self._riders.add(dst, (function_ref(func), is_run_on_reader(func), args))

    def take(self, dst: int) -> tuple[Rider, ...]:
        """The notices waiting for `dst`, for the request about to go there."""
        return self._riders.take(dst)

    def _send_alone(self, dst: int, riders: tuple[Rider, ...]) -> None:
        """A notice of no function of its own, carrying `riders` (which found no message to ride on)."""
        self._wire.send(dst, Kind.NOTICE, next(self._ids), Request(Mode.CALL, riders=riders), Encoded(b""))

    def drop(self, rank: int) -> None:
        """`rank` is gone: what waited for it goes nowhere."""
        self._riders.drop(rank)

    def flush(self, timeout: float) -> bool:
        """Send every notice still waiting; wait until they are sent."""
        return self._riders.flush(timeout)

    def stop(self, timeout: float) -> None:
        self._riders.stop(timeout)

    # ---- in -------------------------------------------------------------------------------------

    def on_notice(self, src: int, msg_id: int, header: Request, body: bytes | bytearray,
                  tensors: list[torch.Tensor]) -> None:
        if header.function is not None:
            try:
                args, kwargs = decode(body, tensors, self._rrefs.adopt)
            except Exception as exc:
                log.error("worker %r: notice %s.%s from rank %d could not be read: %r", self._name, *header.function,
                          src, exc)
            else:
                self._run(src, header.function, header.on_reader, args, kwargs)
        self.run_riders(src, header.riders)

    def run_riders(self, src: int, riders: tuple[Rider, ...]) -> None:
        """Run the notices that came along with a message, after the message itself is under way:
        nobody waits for them, and they promise no order."""
        for function, on_reader, args in riders:
            self._run(src, function, on_reader, args, {})

    def _run(self, src: int, ref: FunctionRef, on_reader: bool, args: tuple, kwargs: dict) -> None:
        def settle(value: Any, error: BaseException | None) -> None:
            if error is not None:  # nobody waits for an answer: this log is all that is left of it
                log.error("worker %r: notice %s.%s from rank %d failed: %r", self._name, *ref, src, error)

        if on_reader:  # marked by the sender: one of shoal's own quick functions, imported everywhere
            self._runner.run_function(ref, args, kwargs, None, settle)
        else:
            self._runner.submit(self._runner.run_function, ref, args, kwargs, None, settle)
