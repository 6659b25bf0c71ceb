"""Retrying with exponential backoff until a deadline: connecting to a listener that is not up yet,
polling a store, re-establishing a dropped link."""

from __future__ import annotations

import time
from collections.abc import Iterator


def attempts(deadline: float, *, first: float = 0.01, limit: float = 0.5, factor: float = 2.0) -> Iterator[int]:
    """Yield the attempt number at once, then again after each pause (first, first*factor, ... capped
    at `limit`); stop instead of pausing past `deadline` (a time.monotonic() value)."""
    delay, attempt = first, 0
    while True:
        yield attempt
        if time.monotonic() + delay > deadline:
            return
        time.sleep(delay)
        delay, attempt = min(delay * factor, limit), attempt + 1
