"""Atomic, verified, optionally asynchronous checkpoints (of replicated, per-rank and model-parallel state), and
the RNG state that makes resumption exact."""

from shoal.checkpoint.manager import Checkpoint, CheckpointManager
from shoal.checkpoint.model_parallel import ModelParallelCheckpoint
from shoal.checkpoint.rng import capture_rng, restore_rng
from shoal.checkpoint.sigterm import finish_writes_on_sigterm

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "ModelParallelCheckpoint",
    "capture_rng",
    "finish_writes_on_sigterm",
    "restore_rng",
]
