"""Hermes (Basani et al., HiPC 2024; docs/hermes.md): significance-gated pushes
(``algorithm.gate = "hermes"``, HermesGUP), dynamic data allocation toward the median
iteration time (``algorithm.allocation = "hermes"``), loss-weighted aggregation
(``algorithm.aggregation = "loss-weighted" | "loss-softmax"``), and the WI / API-call
metrics every run reports under ``summary.json`` ``hermes``.

- pure modules: the gate (:mod:`.gate`), the allocator (:mod:`.allocation`), the
  loss-weighted aggregators (:mod:`.loss_weighted`), the metrics (:mod:`.metrics`);
- :mod:`.coordinator` and :mod:`.worker`: the two halves.
"""
