"""Configuration (the bottom layer; imports nothing else from ``zero3``).

- ``config``: ``Zero3Config``, its DeepSpeed-style knobs and ``from_deepspeed``;
- ``deepspeed_json``: a DeepSpeed JSON read as DeepSpeed reads it (what is accepted, refused, noted);
- ``training_values``: ``TrainingValues``, what fills a DeepSpeed JSON's other ``"auto"`` values;
- ``json_optimizer``, ``lr_schedules``: the optimizer and the warmup schedules a DeepSpeed JSON names;
- ``auto``: what ``"auto"`` means for a size knob (derived from the model's hidden size);
- ``budget``: ``memory_budget`` turned into knobs (``MemoryPlan``);
- ``timeouts``: ``collective_timeout_s`` against the process group's own timeout.
"""
