"""Simulation of heterogeneous edge fleets (pure modules, no MPI): device profiles, and the
virtual clock and timelines that use them. See ``docs/device-profiles.md``."""
