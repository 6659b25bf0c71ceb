"""Progress of a loop: a redrawn bar in a terminal, and plain lines now and then where output goes
to a pipe or a log file, which carriage returns would fill with fragments.

A worker's output is a pipe to its launcher even when the launcher prints to a terminal; the launcher
says so in SHOAL_TTY, so a worker started by it in a terminal still draws a bar.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

from tqdm import tqdm

from shoal import config

T = TypeVar("T")


def to_terminal(file: TextIO) -> bool:
    return file.isatty() or config.SHOAL_TTY.get()


def progress(items: Iterable[T], desc: str, *, enabled: bool = True, file: TextIO | None = None,
             every_s: float | None = None) -> Iterator[T]:
    """Yield `items`, showing how far the loop has got (nothing when not `enabled`). In plain mode a
    line goes out at most every `every_s` seconds (SHOAL_PROGRESS_EVERY_S, 10 by default)."""
    file = file if file is not None else sys.stdout
    if not enabled:
        yield from items
    elif to_terminal(file):
        yield from tqdm(items, desc=desc, leave=False, file=file, mininterval=0.5)
    else:
        every = every_s if every_s is not None else config.SHOAL_PROGRESS_EVERY_S.get()
        yield from _lines(items, desc, file, every)


def _lines(items: Iterable[T], desc: str, file: TextIO, every_s: float) -> Iterator[T]:
    total = len(items) if hasattr(items, "__len__") else None
    started = last = time.monotonic()
    for done, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            rate = done / (now - started)
            of = f"/{total} ({done / total:.0%})" if total else ""
            print(f"{desc}: {done}{of}, {rate:.1f} it/s", file=file, flush=True)
