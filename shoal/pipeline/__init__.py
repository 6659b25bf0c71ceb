"""Pipeline parallelism: a model cut into stages on different ranks (by hand, by `split_sequential`, or
traced and cut by `pipeline`), batches cut into micro-batches, run by any of torch's schedules (GPipe,
1F1B, interleaved, looped, zero bubble, V-shaped), with torch.distributed.pipelining's interface."""

from shoal.pipeline.microbatch import TensorChunkSpec
from shoal.pipeline.pipe import Pipe, PipeInfo, build_stage, pipeline
from shoal.pipeline.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from shoal.pipeline.split import split_sequential
from shoal.pipeline.stage import PipelineStage
from shoal.pipeline.tracing import SplitPoint, pipe_split

__all__ = ["Pipe", "PipeInfo", "PipelineStage", "Schedule1F1B", "ScheduleDualPipeV", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble",
           "SplitPoint", "TensorChunkSpec", "build_stage", "pipe_split", "pipeline", "split_sequential"]
