"""Launching workers (the `shoal run` launcher, torchrun's flags and environment) and the generations
of a job's membership, through which workers go on when others are lost."""

from shoal.elastic.launcher import LaunchConfig, Launcher, parse_args
from shoal.elastic.membership import EvictedError, Generation, Membership

__all__ = ["EvictedError", "Generation", "LaunchConfig", "Launcher", "Membership", "parse_args"]
