"""Pipeline parallelism: a model cut into stages on different ranks, batches cut into micro-batches, run
with the GPipe or 1F1B schedule, with torch.distributed.pipelining's interface."""

from shoal.pipeline.schedules import Schedule1F1B, ScheduleGPipe
from shoal.pipeline.split import split_sequential
from shoal.pipeline.stage import PipelineStage

__all__ = ["PipelineStage", "Schedule1F1B", "ScheduleGPipe", "split_sequential"]
