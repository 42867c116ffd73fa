"""z3kit: primitives for ZeRO-3 style fully sharded data parallel training."""
