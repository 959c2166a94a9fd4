"""The runtime's errors: what stops a run, and what a worker or agent tells apart."""

from __future__ import annotations


class TrainingError(RuntimeError):
    """A failure the run cannot survive; the message says which and why."""


class JobRestart(TrainingError):
    """A fault under ``ft.on_fault=exit``: every worker is stopped for an outer relaunch."""


class Preempted(TrainingError):
    """SIGTERM: a checkpoint was saved at a step boundary and the job stopped."""


class ControllerLost(RuntimeError):
    """A worker or agent can no longer reach the controller (it died, or the node was cut off)."""


class DeviceFault(RuntimeError):
    """This worker's own device is broken: the controller handles it as the loss of that device."""


class LaunchError(ValueError):
    """The launch keys and the environment do not describe a job; the message names the key and the fix."""
