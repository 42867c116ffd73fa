"""A text sample from the trained model."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from z3kit_recipes.models import GPT
from z3kit_recipes.train.corpus import CharVocab
from z3kit_recipes.train.spec import RunSpec


def generate(spec: RunSpec, vocab: CharVocab, state: Mapping[str, torch.Tensor]) -> str:
    """The prompt and ``spec.sample_chars`` characters after it, sampled
    from a plain (unsharded) copy of the trained model with ``state``.

    Note: why not generate inside ``engine.gathered_parameters()``.
        The engine's module hooks stay attached inside that block: each
        module's forward releases its parameters again on exit, and the next
        call gathers them with a collective. Generating on rank 0 alone
        there deadlocks; generating on every rank works but costs one
        all-gather per module and character. ``full_state_dict()`` (one
        collective on every rank) and a plain copy on rank 0 cost neither.
    """
    model = GPT(spec.model)
    result = model.load_state_dict(state, strict=False)
    # a tied weight comes under one of its names only: the others are loaded through it
    loaded = {id(p) for name, p in model.named_parameters() if name in state}
    own = dict(model.named_parameters(remove_duplicate=False))
    missing = [k for k in result.missing_keys if k not in own or id(own[k]) not in loaded]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"full_state_dict does not fit the model: missing {missing}, unexpected {result.unexpected_keys}")
    prompt = vocab.encode(spec.prompt)[None, :]
    gen = torch.Generator().manual_seed(spec.seed)
    ids = model.generate(prompt, spec.sample_chars, temperature=spec.temperature, generator=gen)
    return vocab.decode(ids[0])
