"""The step's state (above ``config``, below everything that consults it).

- ``state``: ``StepState``, where the engine is in its training step (its
  phase, the forward under way, whether the ranks are broken, the step
  counters), with the transitions the runtime's parts move it through;
- ``position``: how far this rank got in its micro-step, as the notice
  board compares it.
"""
