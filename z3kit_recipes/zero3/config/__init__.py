"""Configuration (the bottom layer; imports nothing else from ``zero3``).

- ``config``: ``Zero3Config``, its DeepSpeed-style knobs and ``from_deepspeed``;
- ``auto``: what ``"auto"`` means for a size knob (derived from the model's hidden size);
- ``budget``: ``memory_budget`` turned into knobs (``MemoryPlan``);
- ``timeouts``: ``collective_timeout_s`` against the process group's own timeout.
"""
