"""Python objects through a group's collectives and point-to-point, as torch.distributed's
`broadcast_object_list`, `all_gather_object`, `gather_object`, `scatter_object_list` and
`send/recv_object_list` send them: each object is pickled, the lengths travel first, then the bytes,
padded to the longest where a collective needs equal sizes.

Pickles are loaded as they come, as torch's are: every peer of a group has proven the job's secret
(transport/auth.py), so nothing here comes from outside the job. Ranks are global, as in torch.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from shoal.comm.backends.group import ProcessGroup

# The tag send_object_list's messages carry: apart from the small tags programs use for their own send/recv.
_OBJECT_TAG = 0x0B1EC7


def broadcast_object_list(group: ProcessGroup, object_list: list[Any], src: int, *,
                          device: torch.device | None = None) -> None:
    """Every rank's `object_list` becomes `src`'s, in place; all ranks pass lists of the same length. The
    bytes travel on `device` (default: the group's, which NCCL needs to be the rank's GPU)."""
    root = group.group_rank(src, "src")
    if not object_list:
        return
    if group.rank == root:
        pieces = [_pickled(obj) for obj in object_list]
        lengths = torch.tensor([len(p) for p in pieces], dtype=torch.int64)
    else:
        lengths = torch.zeros(len(object_list), dtype=torch.int64)
    device = device or group.device
    lengths = lengths.to(device)
    group.broadcast(lengths, src).wait()
    sizes = lengths.tolist()
    payload = (_as_tensor(b"".join(pieces)) if group.rank == root
               else torch.empty(sum(sizes), dtype=torch.uint8)).to(device)
    group.broadcast(payload, src).wait()
    if group.rank != root:
        object_list[:] = _unpickled_runs(payload, sizes)


def all_gather_object(group: ProcessGroup, object_list: list[Any], obj: Any) -> None:
    """`object_list[r]` becomes rank r's `obj` (group ranks), on every rank; the list needs an entry
    per rank (checked after the collective, as torch does, so that no other rank is left waiting)."""
    mine, lengths = _exchange_lengths(group, obj)
    padded = [torch.empty(max(lengths), dtype=torch.uint8, device=group.device) for _ in range(group.size)]
    group.all_gather(padded, _padded(mine, max(lengths), group)).wait()
    _fill(object_list, padded, lengths, group, "all_gather_object", "object_list")


def gather_object(group: ProcessGroup, obj: Any, object_gather_list: list[Any] | None, dst: int) -> None:
    """On `dst`, `object_gather_list[r]` becomes rank r's `obj`; other ranks pass None (the list is
    checked after the collective, as in all_gather_object)."""
    is_dst = group.rank == group.group_rank(dst, "dst")
    mine, lengths = _exchange_lengths(group, obj)
    padded = ([torch.empty(max(lengths), dtype=torch.uint8, device=group.device) for _ in range(group.size)]
              if is_dst else None)
    group.gather(_padded(mine, max(lengths), group), padded, dst).wait()
    if is_dst:
        _fill(object_gather_list, padded, lengths, group, "gather_object", "object_gather_list")


def scatter_object_list(group: ProcessGroup, output_list: list[Any], input_list: list[Any] | None,
                        src: int) -> None:
    """`output_list[0]` becomes `input_list[r]` of `src` on group rank r; other ranks than `src` pass None."""
    if not output_list:
        raise ValueError("scatter_object_list: scatter_object_output_list must have room for one object")
    is_src = group.rank == group.group_rank(src, "src")
    if is_src:  # the others wait for this root: it can only fail before it sends
        _check_length(input_list, group, "scatter_object_list", "scatter_object_input_list")
        pieces = [_pickled(obj) for obj in input_list]
        lengths = torch.tensor([len(p) for p in pieces], dtype=torch.int64)
    else:
        lengths = torch.zeros(group.size, dtype=torch.int64)
    lengths = lengths.to(group.device)
    group.broadcast(lengths, src).wait()
    sizes = lengths.tolist()
    mine = torch.empty(max(sizes), dtype=torch.uint8, device=group.device)
    blocks = [_padded(p, max(sizes), group) for p in pieces] if is_src else None
    group.scatter(mine, blocks, src).wait()
    output_list[0] = _unpickled(mine, sizes[group.rank])


def send_object_list(group: ProcessGroup, object_list: list[Any], dst: int, *,
                     device: torch.device | None = None) -> None:
    """`object_list`, pickled, to `dst`, whose `recv_object_list` takes a list of the same length."""
    pieces = [_pickled(obj) for obj in object_list]
    device = device or group.device
    group.send(torch.tensor([len(p) for p in pieces], dtype=torch.int64, device=device), dst, _OBJECT_TAG).wait()
    if pieces:
        group.send(_as_tensor(b"".join(pieces)).to(device), dst, _OBJECT_TAG).wait()


def recv_object_list(group: ProcessGroup, object_list: list[Any], src: int | None, *,
                     device: torch.device | None = None) -> int:
    """`object_list` becomes what `src` (None: whichever rank sends first) sent with `send_object_list` (a
    list of the same length); returns the sender's global rank."""
    device = device or group.device
    lengths = torch.zeros(len(object_list), dtype=torch.int64, device=device)
    work = group.recv(lengths, src, _OBJECT_TAG)
    work.wait()
    src = work.source_rank() if src is None else src  # the payload comes from the same sender
    sizes = lengths.tolist()
    if sizes:
        payload = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        group.recv(payload, src, _OBJECT_TAG).wait()
        object_list[:] = _unpickled_runs(payload, sizes)
    return src


def _exchange_lengths(group: ProcessGroup, obj: Any) -> tuple[bytes, list[int]]:
    """Our pickle, and every rank's pickle length."""
    mine = _pickled(obj)
    lengths = [torch.zeros(1, dtype=torch.int64, device=group.device) for _ in range(group.size)]
    group.all_gather(lengths, torch.tensor([len(mine)], dtype=torch.int64, device=group.device)).wait()
    return mine, [int(t.item()) for t in lengths]


def _check_length(objects: list[Any] | None, group: ProcessGroup, op: str, name: str) -> None:
    if objects is None or len(objects) < group.size:
        got = None if objects is None else len(objects)
        raise ValueError(f"{op}: {name} must hold an entry per rank of the group ({group.size}), got {got}")


def _fill(objects: list[Any] | None, padded: list[torch.Tensor], lengths: list[int], group: ProcessGroup,
          op: str, name: str) -> None:
    """Every rank's object into its entry of `objects` (entries past the group's size stay, as in torch)."""
    _check_length(objects, group, op, name)
    for rank, (tensor, nbytes) in enumerate(zip(padded, lengths, strict=True)):
        objects[rank] = _unpickled(tensor, nbytes)


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _padded(data: bytes, size: int, group: ProcessGroup) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    out[:len(data)] = _as_tensor(data)
    return out.to(group.device)


def _unpickled(tensor: torch.Tensor, nbytes: int) -> Any:
    return pickle.loads(tensor[:nbytes].cpu().numpy().tobytes())


def _unpickled_runs(payload: torch.Tensor, sizes: list[int]) -> list[Any]:
    data = payload.cpu().numpy().tobytes()
    objects, at = [], 0
    for size in sizes:
        objects.append(pickle.loads(data[at:at + size]))
        at += size
    return objects
