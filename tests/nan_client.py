"""A user client that breaks one device (tests/fault/test_rehost.py, tests/test_quarantine.py):
device ``NAN_DEVICE`` ends every task with NaN weights (its held-out loss and update are
NaN, like a device whose local data or arithmetic went bad); every other device trains
with the built-in client. Importable by MPI ranks (PYTHONPATH=tests)."""

from __future__ import annotations

import torch

from edgefl.training import DefaultClient, FitResult

NAN_DEVICE = 3
_default = DefaultClient()


def nan_on_one_device(model, dataset, task, ctx) -> FitResult:
    res = _default.fit(model, dataset, task, ctx)
    if ctx.device != NAN_DEVICE:
        return res
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return FitResult(res.samples, float("nan"))
