"""The parts assembled and run (above ``compile``).

- ``build``: ``assemble`` makes the ``EngineParts`` in data-flow order;
- ``root_hooks``: the root's pre- and post-forward, which start and end every forward;
- ``core``: ``EngineCore``, forward, backward and step over the parts: what
  the features (``weights``, ``lockstep``) are given;
- ``step_stats`` and ``stats``: the per-step clock, and ``Zero3Stats``.
"""
