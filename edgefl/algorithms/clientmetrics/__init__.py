"""Client metrics: the numbers a ``train.client`` returns besides samples and loss
(``FitResult.metrics``) reach rank 0 and the metrics rows.

Each metric goes into the row of the model version its update went into, per device
(``devices/<id>/client/<name>``) and as the mean weighted by the samples the client
reported (``client/<name>``). Only pushed updates carry them (a gated device's local
iterations without a push report no metrics).
"""
