"""Error types shared by every layer.

``EdgeflError`` is a *user* error: bad config, missing file, unimportable plug-in, corrupt
checkpoint. The CLI prints its message on one line and exits with status 2, no traceback.
Anything else escaping is a bug and keeps its traceback.
"""


class EdgeflError(Exception):
    """A problem with the user's input. The message names what was wrong and where."""


class ConfigError(EdgeflError):
    """An invalid configuration value or key (the message names the key path)."""


class DataError(EdgeflError):
    """A dataset, plug-in or data file that cannot be used (the message names it)."""


class CheckpointError(EdgeflError):
    """A checkpoint that is missing, truncated, corrupt or incompatible."""
