"""Federated (per-device) evaluation (``evaluation.every = K > 0``; docs/evaluation.md).

Every K global versions each device evaluates the global model its task starts from on its
own held-out split and reports loss, accuracy and the user's metrics to rank 0, which adds
the per-device values and their sample-weighted means to the metrics rows.

- pure modules: the split and the metrics (:mod:`.metrics`), the message kind
  (:mod:`.kinds`), the config section (:mod:`.config`);
- :mod:`.coordinator` and :mod:`.worker`: the two halves.
"""
