"""Atomic, verified, optionally asynchronous checkpoints (of replicated, per-rank, sharded and model-parallel
state), live replicas of model-parallel state in other workers' memory, and the RNG state that makes
resumption exact."""

from shoal.checkpoint.manager import Checkpoint, CheckpointManager
from shoal.checkpoint.model_parallel import ModelParallelCheckpoint
from shoal.checkpoint.replica import ModelReplicas, ReplicaLost
from shoal.checkpoint.rng import capture_rng, restore_rng
from shoal.checkpoint.sharded import ShardedCheckpoint
from shoal.checkpoint.sigterm import finish_writes_on_sigterm

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "ModelParallelCheckpoint",
    "ModelReplicas",
    "ReplicaLost",
    "ShardedCheckpoint",
    "capture_rng",
    "finish_writes_on_sigterm",
    "restore_rng",
]
