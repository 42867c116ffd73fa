"""torch.compile support around the forward (above ``training``).

- ``compiled``: the ``ForwardContext`` every forward runs in: compiled
  blocks as fetch units, eager learning forwards, compile counts;
- ``compile_events``: dynamo's compile-end events (the one user of the
  private ``torch._dynamo.callback``).
"""
