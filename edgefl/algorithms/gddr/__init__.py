"""GDDR: per-device residual buffers with delayed, sum-preserving release
(``algorithm.residual = "gddr"``; docs/gddr.md).

- pure modules: the rule (:mod:`.residual`), its tau controllers (:mod:`.tau`), the replay
  of dead devices' residuals (:mod:`.replay`), residual checkpoints (:mod:`.store`);
- :mod:`.coordinator`: decodes RESIDUAL messages, replays a dead device's last residual
  checkpoint, adapts tau, and collects every residual at the end (the flush);
- :mod:`.worker`: each device's residual, its releases (RESIDUAL) and its HDF5 residual
  checkpoints.
"""
