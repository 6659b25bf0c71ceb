"""Data parallelism: DistributedDataParallel and the communication hooks it averages buckets with."""

from shoal.parallel.comm_hooks import GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from shoal.parallel.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel", "GradBucket", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]
