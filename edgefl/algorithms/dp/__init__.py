"""Client-level differential privacy (``dp.enabled``; docs/robustness.md): DP-FedAvg with
clipping, Gaussian noise and an RDP accountant (:mod:`.dpfedavg`). It is a choice of the
aggregation axis (its state, the accountant, is saved with the aggregator's)."""
