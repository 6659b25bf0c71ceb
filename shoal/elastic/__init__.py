"""Launching workers (the `shoal run` launcher, torchrun's flags and environment), and live recovery:
training that goes on in the same processes when workers are lost, and that workers join, on
generations of membership; for model-parallel jobs, trainers' steps that go on without a lost trainer,
and remote modules built again elsewhere when their workers are lost."""

from shoal.elastic.launch_config import LaunchConfig, parse_args
from shoal.elastic.launcher import Launcher
from shoal.elastic.live import LiveTraining
from shoal.elastic.live_modules import LiveModules
from shoal.elastic.membership import EvictedError, Generation, JobFinished, Membership
from shoal.elastic.trainer_steps import Batch, TrainerSteps

__all__ = ["Batch", "EvictedError", "Generation", "JobFinished", "LaunchConfig", "Launcher", "LiveModules",
           "LiveTraining", "Membership", "TrainerSteps", "parse_args"]
