"""torch.compile support around the forward (above ``training``).

- ``compiled``: the ``ForwardContext`` every forward runs in: compiled
  blocks as fetch units, eager learning forwards, compile counts (torch's
  private compile names it needs are in ``z3kit.dynamo``).
"""
