"""User clients that break one device in ways its host cannot survive
(tests/fault/test_blame.py): device ``BAD_DEVICE`` hangs, or kills its own process, in every
task that starts from model version ``BAD_FROM`` or later (a data loader deadlocked on that
device's data, a segfault in its native code); every other device trains with the built-in
client. And clients that break every device from version ``BAD_FROM`` while the
environment variable ``EDGEFL_TEST_BREAK`` is "1" (tests/fault/test_stops.py: the resumed
run, without it, trains normally). Importable by MPI ranks (PYTHONPATH=tests)."""

from __future__ import annotations

import os
import signal
import time

import torch

from edgefl.training import DefaultClient, FitResult

BAD_DEVICE = 2
BAD_FROM = 3
_default = DefaultClient()


def hang_on_one_device(model, dataset, task, ctx) -> FitResult:
    if ctx.device == BAD_DEVICE and ctx.round >= BAD_FROM:
        while True:  # (a deadlock: never returns, never raises)
            time.sleep(3600)
    return _default.fit(model, dataset, task, ctx)


def crash_on_one_device(model, dataset, task, ctx) -> FitResult:
    if ctx.device == BAD_DEVICE and ctx.round >= BAD_FROM:
        os.kill(os.getpid(), signal.SIGKILL)  # (the host process dies with it)
    return _default.fit(model, dataset, task, ctx)


STOP_FROM = 5  # the clients below break every device from this model version


def _broken(ctx) -> bool:
    return os.environ.get("EDGEFL_TEST_BREAK") == "1" and ctx.round >= STOP_FROM


def nan_everywhere(model, dataset, task, ctx) -> FitResult:
    """Every device's loss and update are NaN (all get quarantined: the run cannot go on)."""
    res = _default.fit(model, dataset, task, ctx)
    if not _broken(ctx):
        return res
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return FitResult(res.samples, float("nan"))


def diverge(model, dataset, task, ctx) -> FitResult:
    """Every device moves its weights to 3.3e38 (finite): under the momentum of
    ``server.optimizer = "fedavgm"`` the global model overflows one version later."""
    if not _broken(ctx):
        return _default.fit(model, dataset, task, ctx)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.3e38)
    return FitResult(len(dataset), 1.0)
