"""Checkpoints you can trust: written atomically (temporary file, fsync, rename), recorded in a
manifest with their size and SHA-256, verified on load, the newest `keep` kept; optionally written
by a background thread from a snapshot taken at `save` time.

    manager = CheckpointManager("ckpt", keep=3, async_save=True)
    manager.save(step, {"model": model.state_dict(), "optim": optim.state_dict(), "rng": capture_rng()})
    latest = manager.load_latest()        # None, or the newest checkpoint that verifies
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.forks import refuse_in_child

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    step: int
    state: dict[str, Any]
    path: Path | str  # the file; or, for a replica in a worker's memory, which worker


def snapshot(value: Any) -> Any:
    """A copy that later training steps cannot change: tensors cloned to CPU, containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    return value


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Readers see the old file or the whole new one, never a part (also across a crash)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class CheckpointManager:
    """Saves and restores training state in `directory`.

    Replicated state (the usual case: every rank holds the same model) is written by rank 0 only;
    `save(..., per_rank=True)` writes this rank's own part, named after the rank, on every rank.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, async_save: bool = False,
                 rank: int | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.async_save = async_save
        if rank is None:
            import shoal.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank = rank
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._made_in = os.getpid()

    def save(self, step: int, state: dict[str, Any], *, per_rank: bool = False) -> None:
        """Checkpoint `state` as of `step`. With async_save, returns once the snapshot is taken."""
        if not per_rank and self.rank != 0:
            return
        # A forked child would race its parent's writer on the manifest, and could not see that writer end.
        refuse_in_child(self._made_in, "this CheckpointManager", "make one in this process")
        self.wait()  # one write at a time; also surfaces the previous write's error
        copied = snapshot(state)
        if not self.async_save:
            self._write(step, copied, per_rank)
            return
        self._writer = threading.Thread(target=self._write_in_background, args=(step, copied, per_rank),
                                        name="shoal-checkpoint")
        self._writer.start()

    def wait(self) -> None:
        """Block until a background write has finished; raise its error if it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint in the background failed: {error}") from error

    def _write_in_background(self, step: int, copied: dict, per_rank: bool) -> None:
        try:
            self._write(step, copied, per_rank)
        except BaseException as exc:  # kept for wait() / the next save(): never lost
            self._error = exc

    def _manifest(self, per_rank: bool) -> Path:
        return self.directory / (f"manifest-rank{self.rank}.json" if per_rank else "manifest.json")

    def _entries(self, manifest: Path) -> list[dict]:
        if not manifest.exists():
            return []
        try:
            return json.loads(manifest.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"checkpoint manifest {manifest} is not valid JSON ({exc})") from None

    def _write(self, step: int, copied: dict, per_rank: bool) -> None:
        name = f"step-{step:010d}" + (f"-rank{self.rank}" if per_rank else "") + ".pt"
        buffer = io.BytesIO()
        torch.save(copied, buffer)
        data = buffer.getvalue()
        _write_atomic(self.directory / name, data)
        manifest = self._manifest(per_rank)
        entries = [e for e in self._entries(manifest) if e["file"] != name]
        entries.append({"step": step, "file": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        entries.sort(key=lambda e: e["step"])
        stale, entries = entries[:-self.keep], entries[-self.keep:]
        _write_atomic(manifest, json.dumps(entries, indent=1).encode())  # the new file counts from here
        for entry in stale:
            (self.directory / entry["file"]).unlink(missing_ok=True)

    def load_latest(self, *, per_rank: bool = False) -> Checkpoint | None:
        """The newest checkpoint whose size and checksum verify, or None.

        A truncated or corrupted file is skipped with a warning naming it, and the next older one
        is tried. Loading uses `torch.load(weights_only=True)`: no code from the file is run.
        """
        for entry in reversed(self._entries(self._manifest(per_rank))):
            path = self.directory / entry["file"]
            problem = _verify(path, entry)
            if problem:
                _warn_skipped(path, problem)
                continue
            return Checkpoint(entry["step"], torch.load(path, weights_only=True), path)
        return None

    def per_rank_steps(self) -> set[int]:
        """Every step some rank's manifest names (`save(..., per_rank=True)` by a job of any size)."""
        return {entry["step"] for manifest in self.directory.glob("manifest-rank*.json")
                for entry in self._entries(manifest)}

    def verified_file(self, step: int, *, rank: int) -> Path | None:
        """The file `rank` wrote for `step` with per_rank=True, if its manifest names it and it verifies."""
        for entry in self._entries(self.directory / f"manifest-rank{rank}.json"):
            if entry["step"] == step:
                path = self.directory / entry["file"]
                problem = _verify(path, entry)
                if problem:
                    _warn_skipped(path, problem)
                    return None
                return path
        return None


def _warn_skipped(path: Path, problem: str) -> None:
    message = f"skipping checkpoint {path}: {problem}"
    log.warning(message)
    print(f"shoal: {message}", file=sys.stderr)


def _verify(path: Path, entry: dict) -> str | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return "the file is missing"
    if len(data) != entry["size"]:
        return f"truncated ({len(data)} of {entry['size']} bytes)"
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        return "corrupted (SHA-256 does not match the manifest)"
    return None
