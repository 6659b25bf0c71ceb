"""The dtypes that can travel between ranks, and the one-byte codes frames and headers name them by."""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


def code(dtype: torch.dtype, what: str) -> int:
    """The code of `dtype`; TypeError naming `what` (the caller's context) when it cannot travel."""
    found = _CODE.get(dtype)
    if found is None:
        raise TypeError(f"{what}: dtype {dtype} cannot be sent between ranks "
                        f"(supported: {[name(d) for d in range(len(DTYPES))]})")
    return found


def name(code: int) -> str:
    """A code as users write the dtype ("float32"), or "dtype#N" for a code from a newer peer."""
    return str(DTYPES[code]).removeprefix("torch.") if code < len(DTYPES) else f"dtype#{code}"
