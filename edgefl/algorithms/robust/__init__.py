"""Robust aggregation (docs/robustness.md). The robust rules themselves (median, trimmed
mean, (multi-)Krum, norm clipping) are choices of the aggregation axis
(:mod:`edgefl.algorithms.robust.rules`); this plugin is the norm bound that drops or clips
outlying updates before any rule sees them (``robust.norm_bound``,
``robust.norm_bound_relative``)."""
