"""Pipeline parallelism: a model cut into stages on different ranks, batches cut into micro-batches, run
with the GPipe, 1F1B, interleaved 1F1B or looped BFS schedule, with torch.distributed.pipelining's
interface."""

from shoal.pipeline.microbatch import TensorChunkSpec
from shoal.pipeline.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from shoal.pipeline.split import split_sequential
from shoal.pipeline.stage import PipelineStage

__all__ = ["PipelineStage", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
           "TensorChunkSpec", "split_sequential"]
