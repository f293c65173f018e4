"""A worked custom-dataset plug-in for edgefl: concentric rings in 2-D.

Use it from a config with ``datasets/`` on ``PYTHONPATH``::

    [data]
    source = "custom_plugin:make_rings"
    [data.args]
    radius_noise = 0.15

edgefl calls ``make_rings(num_devices=..., seed=..., **args)``. It returns ``(train, test)``:
a list of one ``TensorDataset`` per device and a shared test ``TensorDataset``. edgefl infers
``input_shape = (2,)`` and ``num_classes = rings`` from the test set.

Each device sees the rings only within its own angular sector and with its own mix of
ring labels (Dirichlet(``label_skew``)), so the split is non-IID in both features and labels.
Device ``k``'s data comes only from the random stream ``[seed, 0, k]``, so it is the same
whichever process builds it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset


def _ring_points(
    rng: np.random.Generator,
    labels: np.ndarray,
    angles: np.ndarray,
    radius_noise: float,
) -> TensorDataset:
    """Points on ring ``label`` (radius ``label + 1``) at ``angles`` (radians), jittered."""
    radius = labels + 1.0 + rng.normal(0.0, radius_noise, size=len(labels))
    x = np.stack([radius * np.cos(angles), radius * np.sin(angles)], axis=1)
    return TensorDataset(
        torch.from_numpy(x.astype(np.float32)), torch.from_numpy(labels.astype(np.int64))
    )


def make_rings(
    num_devices: int,
    seed: int,
    radius_noise: float = 0.1,
    rings: int = 3,
    samples_per_device: int = 120,
    test_samples: int = 600,
    label_skew: float = 0.5,
    sector: float = np.pi,
) -> tuple[list[TensorDataset], TensorDataset]:
    """Concentric-rings classification split non-IID over ``num_devices`` devices.

    Args:
        num_devices: number of devices (passed by edgefl).
        seed: run seed (passed by edgefl).
        radius_noise: standard deviation of the radius jitter (ring spacing is 1).
        rings: number of rings = classes; ring ``c`` has radius ``c + 1``.
        samples_per_device: training points per device.
        test_samples: points in the shared test set (uniform over rings and angles).
        label_skew: Dirichlet concentration of each device's ring mix (small = skewed).
        sector: width in radians of the angular sector each device observes.

    Returns:
        ``(train, test)``: a list of ``num_devices`` TensorDatasets ``(x float32 (n, 2),
        y int64 (n,))`` and one test TensorDataset.
    """
    if radius_noise < 0 or rings < 2 or samples_per_device < 1 or test_samples < 1:
        raise ValueError("make_rings: need radius_noise >= 0, rings >= 2, sizes >= 1")
    train = []
    for k in range(num_devices):
        rng = np.random.default_rng([seed, 0, k])
        mix = rng.dirichlet(np.full(rings, label_skew))
        labels = rng.choice(rings, size=samples_per_device, p=mix)
        centre = rng.uniform(0.0, 2.0 * np.pi)
        angles = centre + rng.uniform(-sector / 2, sector / 2, size=samples_per_device)
        train.append(_ring_points(rng, labels, angles, radius_noise))
    rng = np.random.default_rng([seed, 1, 0])
    labels = np.arange(test_samples) % rings
    angles = rng.uniform(0.0, 2.0 * np.pi, size=test_samples)
    test = _ring_points(rng, labels, angles, radius_noise)
    return train, test
