"""Models: built-in architectures, plug-in loading, flat parameter buffers and local training.

Public API: ``build_model``, ``MODEL_NAMES``, ``FlatParams``, ``layout_signature``.
Training helpers live in ``edgefl.models.train``.
"""

from edgefl.models.build import MODEL_NAMES, build_model
from edgefl.models.flat import FlatParams, layout_signature

__all__ = ["MODEL_NAMES", "FlatParams", "build_model", "layout_signature"]
