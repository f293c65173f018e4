"""Pure policies of the runtime's core axes and the algorithms' pure rules (no MPI inside):
consistency, aggregation (incl. robust rules, DP, server optimizers), gating, allocation,
residuals, key ranges. Plugins (:mod:`edgefl.algorithms`) wire them to messages."""
