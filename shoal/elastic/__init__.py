"""Launching workers: the `shoal run` launcher (torchrun's flags and environment)."""

from shoal.elastic.launcher import LaunchConfig, Launcher, parse_args

__all__ = ["LaunchConfig", "Launcher", "parse_args"]
