"""``BlocksConfig``: the few knobs of the fsdp_blocks runtime."""

from __future__ import annotations

import attrs

from z3kit.validate import bool_validator, int_validator, number_validator


@attrs.frozen
class BlocksConfig:
    """What ``fsdp_blocks.initialize`` takes besides the model and its blocks."""

    #: micro-steps (backward passes) per optimizer step; gradients are
    #: averaged over them and over the ranks
    gradient_accumulation_steps: int = attrs.field(default=1, validator=int_validator(at_least=1))
    #: clip the global gradient norm to this value before each step (0: no clipping)
    gradient_clipping: float = attrs.field(default=0.0, validator=number_validator(at_least=0.0))
    #: the static prefetch plan: in forward gather the next block while this
    #: one runs, in backward the previous one (False: gather each block when it starts)
    prefetch: bool = attrs.field(default=True, validator=bool_validator())
