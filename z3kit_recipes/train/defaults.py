"""The job's defaults, in a module that imports nothing: the command line
reads them to parse its options and print ``--help`` before torch is
imported (which takes seconds), and the modules that use them read them
from here."""

from __future__ import annotations

from typing import Final

#: (width, layers, heads, seq_len) of each ``--model-size``
MODEL_SIZES: Final[dict[str, tuple[int, int, int, int]]] = {
    "tiny": (32, 2, 2, 32),
    "small": (96, 4, 4, 64),
    "medium": (256, 6, 8, 128),
}
DEFAULT_MODEL_SIZE: Final = "small"
DEFAULT_CORPUS_CHARS: Final = 2_000_000
DEFAULT_STEPS: Final = 400
DEFAULT_BATCH_SIZE: Final = 16
DEFAULT_LR: Final = 3e-3
#: the job's AdamW apart from its learning rate (torch's eps and weight decay, GPT's betas)
ADAM_BETAS: Final = (0.9, 0.95)
ADAM_EPS: Final = 1e-8
WEIGHT_DECAY: Final = 0.01
DEFAULT_SAMPLE_CHARS: Final = 300
DEFAULT_PROMPT: Final = "    def __init__(self"
DEFAULT_TEMPERATURE: Final = 0.7
#: steps recorded by --profile
PROFILE_STEPS: Final = 3


def warmup_steps(steps: int) -> int:
    """The job's linear warm-up: the first 5% of ``steps``, at least 1, at most 20."""
    return min(20, max(1, steps // 20))
