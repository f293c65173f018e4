"""Parameter-server pushes and pulls (Li et al., OSDI 2014; docs/parameter-server.md):
filtered, compressed updates (``ps.sparse``, ``ps.filters``: significantly-modified, KKT,
error feedback; index/value or dense encodings, fp16/bf16 values, key caching with RESEND)
and working-set pulls (``ps.pull = "working-set"``: MODEL_KEYS down, WORKSET up).

- pure modules: :mod:`.compress`, :mod:`.filters`, :mod:`.workset`; key ranges and layouts
  in :mod:`edgefl.policies.keyrange`;
- :mod:`.coordinator` and :mod:`.worker`: the two halves. (The sharded server group is a
  server backend: :mod:`edgefl.server.sharded`.)
"""
