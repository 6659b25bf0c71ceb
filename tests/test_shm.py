"""Shared-memory lanes in one process: slots copied out or lent as tensors, and handed back only when free."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import torch

from shoal.comm.shm import lanes


def _lane() -> tuple[lanes.Outbound, lanes.Inbound]:
    outbound = lanes.Outbound()
    inbound = lanes.Inbound(outbound.name)
    outbound.accepted()
    return outbound, inbound


def _frame(value: float) -> torch.Tensor:
    return torch.full((1 << 18,), value)  # 1 MiB of float32


def test_a_lent_slot_stays_taken_until_its_tensor_and_views_are_freed() -> None:
    outbound, inbound = _lane()
    slot = outbound.put(memoryview(_frame(1.0).view(torch.uint8).numpy()))
    lent = inbound.lend(slot, 1 << 20)
    view = lent.view(torch.float32).view(512, 512)  # what an RPC message rebuilds from it
    del lent
    gc.collect()
    assert torch.all(view == 1.0)
    second = outbound.put(memoryview(_frame(2.0).view(torch.uint8).numpy()))
    assert second != slot  # the lent slot is not written over while a view of it lives
    assert torch.all(view == 1.0)
    inbound.take(second, memoryview(bytearray(1 << 20)))
    del view
    gc.collect()
    assert outbound.put(memoryview(_frame(3.0).view(torch.uint8).numpy())) == slot  # handed back


def test_lending_stops_at_the_limit_and_copies_still_work() -> None:
    outbound, inbound = _lane()
    kept = []
    for i in range(lanes.LENDABLE_SLOTS):
        slot = outbound.put(memoryview(_frame(float(i)).view(torch.uint8).numpy()))
        kept.append(inbound.lend(slot, 1 << 20))
    slot = outbound.put(memoryview(_frame(-1.0).view(torch.uint8).numpy()))
    assert inbound.lend(slot, 1 << 20) is None  # the rest of the slots stay for frames copied out
    copy = torch.empty(1 << 20, dtype=torch.uint8)
    inbound.take(slot, memoryview(copy.numpy()))
    assert torch.all(copy.view(torch.float32) == -1.0)
    assert all(torch.all(t.view(torch.float32) == float(i)) for i, t in enumerate(kept))
    kept.clear()
    gc.collect()
    slot = outbound.put(memoryview(_frame(5.0).view(torch.uint8).numpy()))
    assert inbound.lend(slot, 1 << 20) is not None  # lendable again once the kept tensors are gone


def test_a_frame_in_read_only_memory_goes_through_a_lane_without_a_warning() -> None:
    # torch warns once per process, so the check runs in a fresh one, with warnings as errors.
    code = textwrap.dedent("""
        from shoal.comm.shm import lanes
        outbound = lanes.Outbound()
        inbound = lanes.Inbound(outbound.name)
        outbound.accepted()
        body = bytes(range(256)) * 4096  # a pickled RPC body is bytes: read-only
        slot = outbound.put(memoryview(body))
        copy = bytearray(len(body))
        inbound.take(slot, memoryview(copy))
        assert copy == body
    """)
    result = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
