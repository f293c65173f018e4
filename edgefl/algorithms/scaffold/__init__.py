"""SCAFFOLD (Karimireddy et al., ICML 2020): control variates correct client drift.

Written only against the plugin API (:mod:`edgefl.algorithms.base`) and the client hook
(:mod:`edgefl.training`). Rank 0 keeps the server control variate ``c``; each device keeps
its own ``c_i``. Every local step uses the gradient ``g + c - c_i``; after a task of ``K``
steps at learning rate ``lr`` the device sets ``c_i+ = c_i - c + (x - y_i) / (K lr)``
(option II of the paper, x the start model, y_i the trained one) and uploads its model delta
together with ``dc_i = c_i+ - c_i``; rank 0 adds ``sum(dc_i) / N`` (N = all devices) to ``c``
when the round's step is applied. Both variates are in checkpoints.
"""
