"""Working sets: the keys a device's data can touch (``ps.pull = "working-set"``)."""

from __future__ import annotations

import numpy as np

# Models whose working set the worker computes: a linear layer over input features. Any
# other model's working set is every key (it pulls the full model).
WORKING_SET_MODELS = ("logreg",)


def working_set_pulls(cfg: dict) -> bool:
    """Does rank 0 send workers only the values at their devices' working sets?"""
    return cfg["ps"]["pull"] == "working-set" and cfg["model"]["name"] in WORKING_SET_MODELS


def device_working_set(layout, dataset) -> np.ndarray:
    """Sorted int64 keys a ``logreg`` device's data can touch: the ``linear.weight`` columns
    of the features that are nonzero in any of its examples, plus ``linear.bias``
    (:func:`edgefl.policies.keyrange.linear_working_set`).

    Args:
        layout: the model's :class:`~edgefl.policies.keyrange.ParamLayout`.
        dataset: the device's training examples: ``clicks`` examples (a ``csr`` matrix) or
            any dataset of ``(x, y)`` pairs (x flattened as ``logreg`` does).
    """
    import torch

    from ...data.base import dataset_tensors
    from ...policies.keyrange import csr_columns, linear_working_set

    csr = getattr(dataset, "csr", None)
    if csr is not None:
        cols = csr_columns(csr)
    else:
        x = dataset_tensors(dataset, "working set")[0]
        x = x.reshape(x.shape[0], -1)
        cols = torch.nonzero((x != 0).any(dim=0)).reshape(-1).numpy().astype(np.int64)
    return linear_working_set(layout, "linear.weight", cols, dense=["linear.bias"]).keys


def malformed(keys: np.ndarray, how: str, numel: int) -> np.ndarray:
    """Test hook ``ps.debug_bad_working_set``: a key list rank 0 must reject."""
    if how == "unsorted":
        return np.ascontiguousarray(keys[::-1])
    if how == "duplicate":
        return np.concatenate([keys[:1], keys])
    return np.concatenate([keys, np.array([numel], keys.dtype)])  # out-of-range


def loss_gradient(
    model, dataset, task: str, device: str = "cpu", batch_size: int = 1024, loss=None
):
    """Gradient of the mean training loss over ``dataset`` at the model's current parameters.

    One forward/backward pass (batches of ``batch_size`` samples, default 1024, weighted by
    their size) with torch autograd, in eval mode so it draws no randomness and moves no
    batch-norm statistics; parameters and their ``.grad`` are left as they were (None).

    Args:
        model: any module of ``edgefl.models``.
        dataset: a dataset of ``(x, y)`` pairs.
        task: ``"classification"`` or ``"lm"``.
        device: torch device of the model.
        batch_size: samples per forward pass.
        loss: the training loss (:func:`edgefl.training.resolve_loss`; default: the one
            ``train.loss = "auto"`` picks for ``task``).

    Returns:
        float32 numpy vector in ``FlatParams`` order (``named_parameters`` order).
    """
    import torch

    from ...training import resolve_loss

    loss_fn = loss if loss is not None else resolve_loss("auto", task)
    n = len(dataset)
    params = [p for _, p in model.named_parameters()]
    was_training = model.training
    model.eval()
    for p in params:
        p.grad = None
    try:
        if n:
            loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)
            for xb, yb in loader:
                xb, yb = xb.to(device), yb.to(device)
                (loss_fn(model(xb), yb) * (yb.shape[0] / n)).backward()
        g = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
    finally:
        for p in params:
            p.grad = None
        model.train(was_training)
    return g.detach().cpu().numpy().astype(np.float32, copy=False)
