"""How Hugging Face Accelerate recognises the engine: as a model it prepared already.

``accelerator.prepare(engine, optimizer, loader)`` would wrap a plain module
in DDP (under a multi-process launch), whose first backward fails on the
sharded parameters; the engine reduces its gradients itself.
``Accelerator.prepare_model`` returns as it is a module that carries its own
mark of a prepared model (``_is_accelerate_prepared``, checked before any
wrapping, device move, autocast or compile), which is what the engine is to
Accelerate: so the engine carries that mark. (The model does not: Trainer's
``prepare_model`` marks it itself after what it does to a model, autocast
among it, and ``Zero3Trainer`` goes through it.) This module is the one place
that names the mark; the README's Accelerate loop, run by
``tests/test_readme.py``, pins that Accelerate returns the engine as it is.
Accelerate then does the data (a ``DataLoader`` sharded over the ranks) and
``accelerator.backward(loss)``; the engine does the rest
(``engine.step()``, and its own ``gradient_accumulation_steps``:
``engine.no_sync()``, which ``accelerator.accumulate`` calls, is refused).
The optimizer Accelerate wraps is ``engine.optimizer``: its ``step()``
between backward and ``engine.step()`` is refused, naming ``engine.step()``.
Accelerate's ``mixed_precision`` (an autocast around the forward) is not
applied to the engine: its precision is ``Zero3Config(compute_dtype=...)``.
"""

from __future__ import annotations

from torch import nn

#: Accelerate's attribute for "prepared already" (``Accelerator.prepare_model``)
PREPARED_MARK = "_is_accelerate_prepared"


def mark_prepared(module: nn.Module) -> None:
    """Make Accelerate's ``prepare`` hand ``module`` back as it is."""
    object.__setattr__(module, PREPARED_MARK, True)
