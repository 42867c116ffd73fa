"""Weights in and out of an engine (a feature: given an ``EngineCore``, never the facade).

- ``checkpoint``: sharded checkpoints through ``torch.distributed.checkpoint``;
- ``pretrained`` and ``safetensors_io``: Hugging Face weights in and out;
- ``full_values``: full parameter values out, a rank's values in;
- ``deepspeed_files`` and ``deepspeed_import``: DeepSpeed ZeRO-3 checkpoints;
- ``commit``, ``target`` and ``together``: how a save is staged and committed,
  what it may replace, and the steps the ranks take together.
"""
