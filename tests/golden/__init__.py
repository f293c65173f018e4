"""Golden final models: named job configs and their recorded model hashes (see configs.py)."""
