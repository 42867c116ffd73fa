"""``RunSpec``: the run as the command line settled it, sent to every rank."""

from __future__ import annotations

import attrs

from z3kit_recipes.models import GPTConfig
from z3kit_recipes.zero3.config.config import Zero3Config


@attrs.frozen
class RunSpec:
    """Everything a rank needs; plain data, picklable for spawn."""

    model: GPTConfig
    config: Zero3Config
    #: where ``config`` came from, for the header and the summary
    config_source: str
    steps: int
    batch_size: int
    lr: float
    seed: int
    #: the output folder; None under torchrun without ``--out`` (rank 0 picks one)
    out: str | None
    plot: bool
    profile: bool
    sample_chars: int
    prompt: str
    temperature: float
    corpus_chars: int
    #: the parent's corpus digest: every rank must read the same text
    corpus_digest: str
    #: loopback port of the spawned gloo group (None under torchrun)
    port: int | None = None
    threads: int = 1
    argv: tuple[str, ...] = ()
    #: the ``--model-size`` preset the model came from (before --width etc.), for resume checks
    model_size: str = ""
    #: ``--save-every``: a checkpoint every so many optimizer steps and at the end (None: none)
    save_every: int | None = None
    #: ``--keep-last``: keep only the newest so many of the checkpoints this run saves (None: all)
    keep_last: int | None = None
    #: ``--resume``: the checkpoint to continue from (a run folder's latest, when it named the folder)
    resume: str | None = None
    #: ``--init-from``: a Hugging Face-layout safetensors directory to start from
    init_from: str | None = None
    #: ``--export``: where to write the trained weights in that layout at the end
    export: str | None = None
    #: (name, text) of the files ``--export`` writes beside the weights: the vocabulary's tokenizer
    export_files: tuple[tuple[str, str], ...] = ()
    #: ``--optimizer``: "adamw", or "muon" (Muon on the blocks' matrices, AdamW on the rest)
    optimizer: str = "adamw"

    @property
    def micro_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def tokens_per_step(self, world: int) -> int:
        """Tokens one optimizer step trains on, over all ranks."""
        return self.batch_size * self.model.seq_len * self.micro_steps * world
