"""FedProx (Li et al., MLSys 2020): a proximal term keeps local training near the global model.

Written only against the plugin API (:mod:`edgefl.algorithms.base`) and the client hook
(:mod:`edgefl.training`): the worker half adds ``mu * (w - w_global)`` to every gradient,
the gradient of ``mu / 2 * ||w - w_global||^2``, through ``FitContext.grad_hooks``.
"""
