"""Example ordering: CD-GraB, D-RR and ID-GraB (``algorithm.ordering``; docs/ordering.md).

- :mod:`.orderers`: the pure balancing (PairBalance, sketches, the streamed epoch);
- :mod:`.coordinator`: rank 0 balances the devices' gradient rows as they arrive and sends
  every device its next-epoch order (ORDER);
- :mod:`.worker`: a device trains one epoch in the order it got and ships its per-example
  gradients (GRADS).
"""
