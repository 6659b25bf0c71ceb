"""The random number generators' states (torch, numpy, Python), in a form `torch.load(weights_only=True)`
accepts, so that a resumed run draws the same numbers an uninterrupted one would."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, python_state, gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "python": {"version": version, "state": list(python_state), "gauss": gauss}}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
