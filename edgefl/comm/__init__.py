"""Messaging: the wire format, the transport interface, MPI and loopback transports.

Only :mod:`edgefl.comm.mpi` imports mpi4py; import it lazily through :func:`mpi_transport`.
"""

from .transport import Transport
from .wire import Kind, Message, Validator, WireError

__all__ = ["Kind", "Message", "Transport", "Validator", "WireError", "mpi_transport"]


def mpi_transport(validator: Validator, **kw) -> Transport:
    """Create an :class:`~edgefl.comm.mpi.MPITransport` on ``MPI.COMM_WORLD``."""
    from .mpi import MPITransport

    return MPITransport(validator, **kw)
