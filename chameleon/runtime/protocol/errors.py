"""The runtime's errors: what stops a run, and what a worker or agent tells apart."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """How a run ends, as every process of it exits: node 0's controller and every node's agent alike."""

    TRAINED = 0
    FAILED = 1  # a failure the run cannot survive (one line says why)
    CONFIG = 2  # a config or launch error (one line names the key and the fix)
    RELAUNCH = 3  # stopped for an outer relaunch: ft.on_fault=exit, or a node that lost its controller
    PREEMPTED = 4  # SIGTERM: a checkpoint was saved; continue with ckpt.resume=
    INTERRUPTED = 130  # Ctrl-C


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


def exit_code_of(err: BaseException) -> ExitCode:
    """The code a run that ``err`` ended exits with."""
    if isinstance(err, LaunchError):
        return ExitCode.CONFIG
    if isinstance(err, JobRestart):
        return ExitCode.RELAUNCH
    if isinstance(err, Preempted):
        return ExitCode.PREEMPTED
    if isinstance(err, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    return ExitCode.FAILED
