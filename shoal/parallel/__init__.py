"""Data parallelism: DistributedDataParallel (processes), the communication hooks it averages buckets with,
and DataParallel (threads in one process)."""

from shoal.parallel.comm_hooks import GradBucket, allreduce_hook, bf16_compress_hook, fp16_compress_hook
from shoal.parallel.data_parallel import DataParallel
from shoal.parallel.ddp import DistributedDataParallel

__all__ = ["DataParallel", "DistributedDataParallel", "GradBucket", "allreduce_hook", "bf16_compress_hook",
           "fp16_compress_hook"]
