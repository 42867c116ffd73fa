"""How Hugging Face Accelerate recognises the engine: as a model it prepared already.

``accelerator.prepare(engine, optimizer, loader)`` would wrap a plain module
in DDP (under a multi-process launch), whose first backward fails on the
sharded parameters' ``(0,)`` placeholders; the engine already reduces its
gradients. ``Accelerator.prepare_model`` returns a module that carries its
own mark of a prepared model (``_is_accelerate_prepared``, checked before any
wrapping, device move, autocast or compile) as it is, which is what the engine
is to Accelerate: so the engine carries that mark. This module is the one
place that names it; ``tests/test_zero3_accelerate.py`` pins that Accelerate
returns the engine itself. Accelerate then does the data (sharding a
``DataLoader`` over the ranks) and ``accelerator.backward(loss)``; the engine
does the rest (``engine.step()``; its own ``gradient_accumulation_steps``, as
``engine.no_sync()``, which ``accelerator.accumulate`` calls, is refused).
The optimizer Accelerate wraps is ``engine.optimizer``: calling its
``step()`` between backward and ``engine.step()`` is refused, naming ``engine.step()``.
"""

from __future__ import annotations

from torch import nn

#: Accelerate's attribute for "prepared already" (``Accelerator.prepare_model``)
PREPARED_MARK = "_is_accelerate_prepared"


def mark_prepared(module: nn.Module) -> None:
    """Make Accelerate's ``prepare`` hand ``module`` back as it is."""
    object.__setattr__(module, PREPARED_MARK, True)
