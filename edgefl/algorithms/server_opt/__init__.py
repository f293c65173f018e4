"""Server optimizers (``[server]``; docs/parameter-server.md): plain SGD, FedAvgM, FedAdam,
FedYogi, FedAdagrad, an L1 prox step and a user function, applied to every model change
(:mod:`.optimizers`). The core owns the optimizer; its state is in every checkpoint."""
