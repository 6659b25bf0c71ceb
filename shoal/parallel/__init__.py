"""Data parallelism: DistributedDataParallel (processes), the communication hooks it averages buckets with,
DataParallel (threads in one process), fully_shard (ZeRO stage 3: parameters, gradients and optimizer state
sharded), Join (training on uneven inputs), and model averaging with the
post-local SGD hook (local steps, parameters averaged every few; the optimizer is shoal.optim's)."""

from shoal.parallel.comm_hooks import (
    GradBucket,
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from shoal.parallel.data_parallel import DataParallel
from shoal.parallel.ddp import DistributedDataParallel
from shoal.parallel.fully_shard import FSDPModule, fully_shard
from shoal.parallel.join import Join, Joinable, JoinHook
from shoal.parallel.model_averaging import ModelAverager, PeriodicModelAverager
from shoal.parallel.post_local_sgd_hook import PostLocalSGDState, post_localSGD_hook
from shoal.parallel.powersgd_hook import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = [
    "DataParallel",
    "DistributedDataParallel",
    "FSDPModule",
    "GradBucket",
    "Join",
    "JoinHook",
    "Joinable",
    "ModelAverager",
    "PeriodicModelAverager",
    "PostLocalSGDState",
    "PowerSGDState",
    "allreduce_hook",
    "batched_powerSGD_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "fully_shard",
    "post_localSGD_hook",
    "powerSGD_hook",
]
