"""edgefl: federated / edge training over MPI.

Rank 0 coordinates; ranks >= 1 host edge devices. See ``docs/architecture.md``.
"""

__version__ = "0.1.0"
