"""What the signature every frame of an operation carries means: which operation, and what the ranks
must agree on, told in words for the errors that name a mismatch."""

from __future__ import annotations

from shoal.comm.algorithms.reduce_op import ReduceOp
from shoal.comm.transport import dtypes
from shoal.comm.transport.frames import Signature

OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
       "all_to_all", "barrier", "send/recv"]
_REDUCING = {"all_reduce", "reduce", "reduce_scatter"}
_ROOTED = {"broadcast", "reduce", "gather", "scatter"}


def describe(sig: Signature) -> str:
    """Human-readable form of a frame signature, for mismatch errors."""
    opcode, dtype, redop, root, numel = sig
    name = OPS[opcode] if opcode < len(OPS) else f"op#{opcode}"
    parts = [dtypes.name(dtype), f"numel={numel}"]
    if name in _REDUCING:
        parts.append(f"op={ReduceOp(redop).name}")
    if name in _ROOTED:
        parts.append(f"root={root}")
    return f"{name}({', '.join(parts)})"
