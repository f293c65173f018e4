"""Model buffers (BatchNorm running statistics): federated with the parameters, or kept per
device (FedBN, Li et al., ICLR 2021; ``model.buffers = "local"``).

- :mod:`.checks`: what float buffers cannot run with (pure; refused before any rank starts);
- :mod:`.worker`: FedBN's worker half: each device's own buffer values, put into the model
  before its tasks, kept out of its updates (zero delta), saved in checkpoints;
- :mod:`.plugin`: the Plugin classes (``ModelBuffers``: the checks, always on;
  ``FedBN``: on with ``model.buffers = "local"``).

Federating needs no plugin: :class:`~edgefl.models.flat.FlatParams` puts the float buffers
in the flat vector after the parameters, so they travel and are aggregated like them.
"""
