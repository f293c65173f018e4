"""A ``(train, test)`` data plug-in with one bad value on request (docs/quickstart.md,
"When something is wrong"): ``bad = "label"``, ``"nan"`` or ``"test-nan"``.

Run from the repository root (docs/examples on PYTHONPATH, for every rank):

    PYTHONPATH=docs/examples edgefl simulate --set data.source=mydata:make \
        --set data.args.bad='"label"'
"""

import numpy as np


def make(num_devices, seed, bad=""):
    rng = np.random.default_rng(seed)
    train = []
    for device in range(num_devices):
        x, y = rng.normal(size=(60, 60)).astype(np.float32), rng.integers(0, 10, 60)
        if bad == "label" and device == 3:
            y[40] = 12
        if bad == "nan" and device == 5:
            x[7, 0] = np.nan
        train.append((x, y))
    x, y = rng.normal(size=(100, 60)).astype(np.float32), np.arange(100) % 10
    if bad == "test-nan":
        x[0, 0] = np.nan
    return train, (x, y)
