"""Client-level differential privacy (``dp.enabled``; docs/robustness.md): DP-FedAvg with
clipping and Gaussian noise (:mod:`.dpfedavg`), accounted with Google's dp-accounting for the
sampling edgefl does (``dp.sampling``; :mod:`.accounting`). It is a choice of the aggregation
axis (its state, the accountant, is saved with the aggregator's)."""
