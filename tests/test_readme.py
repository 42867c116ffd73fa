"""The README and docs/ hold code that runs and links that lead somewhere.

A fenced block whose info string has the word ``runnable`` is run here:

- ```` ```python runnable file=NAME ````: written to ``NAME`` in a fresh
  folder, for a ```` ```bash runnable ```` block of the same page to run
  (the README's ``train.py`` and its ``torchrun`` line, run as written);
- ```` ```python runnable ranks=2 ````: executed on each rank of the
  session's two-rank gloo pool, whose default process group is up, as in a
  script after ``init_process_group``.

Every other ``python`` block must at least compile. A ``runnable`` block of
another form fails the test that collects it, so a new form is not skipped
silently.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.dist_pool import PoolSet, WorkerContext

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\S*)(.*)$")


@attrs.frozen
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    options: dict[str, str]  # ``runnable`` -> "", ``file=train.py`` -> "train.py"
    code: str

    @property
    def runnable(self) -> bool:
        return "runnable" in self.options

    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page``, in order."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    start: int | None = None
    for number, line in enumerate(lines, 1):
        fence = FENCE.match(line)
        if fence is None:
            continue
        if start is None:
            start, language, rest = number, fence.group(1), fence.group(2).split()
            options = dict((word.split("=", 1) + [""])[:2] for word in rest)
        else:
            found.append(Block(page, start, language, options, "\n".join(lines[start : number - 1]) + "\n"))
            start = None
    assert start is None, f"{page.name}:{start}: a code fence is not closed"
    return found


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
POOL_BLOCKS = [b for b in ALL_BLOCKS if b.runnable and "ranks" in b.options]


def test_every_runnable_block_has_a_known_form() -> None:
    for block in ALL_BLOCKS:
        if not block.runnable:
            continue
        if block.language == "bash":
            assert block.code.startswith("torchrun "), f"{block.name()}: a runnable bash block is a torchrun line"
        else:
            assert block.language == "python", f"{block.name()}: runnable {block.language!r} blocks are not run"
            assert ("file" in block.options) != ("ranks" in block.options), (
                f"{block.name()}: a runnable python block names file=NAME or ranks=2"
            )
            assert block.options.get("ranks", "2") == "2", f"{block.name()}: the pool runs blocks at 2 ranks"
    assert POOL_BLOCKS, "no block runs on the pool"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.language == "python"], ids=Block.name)
def test_every_python_block_compiles(block: Block) -> None:
    ast.parse(block.code, filename=block.name())


def _exec_block(ctx: WorkerContext, code: str, name: str, cwd: str) -> str:
    """Run a block as a script on this rank, in ``cwd``, and return what it printed."""
    printed = io.StringIO()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(before)
    return printed.getvalue()


@contextlib.contextmanager
def _accelerate_launch(ctx: WorkerContext) -> Iterator[None]:
    """What ``accelerate launch --cpu`` gives each process (its rank in the environment), and
    Accelerate's process-wide state reset afterwards, so that other tests in the pool start bare."""
    from accelerate.state import AcceleratorState

    saved = dict(os.environ)
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world), LOCAL_RANK=str(ctx.rank),
                      LOCAL_WORLD_SIZE=str(ctx.world), MASTER_ADDR="127.0.0.1", ACCELERATE_USE_CPU="true")
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(saved)


def _exec_accelerate_block(ctx: WorkerContext, code: str, name: str, cwd: str) -> dict[str, Any]:
    """The README's Accelerate loop on this rank, then the same loop on Accelerate with DDP
    (``accumulate`` over 2 micro-batches, as the engine's ``gradient_accumulation_steps=2``)."""
    import torch
    from accelerate import Accelerator
    from z3kit_recipes.models import TinyMLP

    namespace: dict[str, Any] = {"__name__": "__main__"}
    with _accelerate_launch(ctx):
        exec(compile(code, name, "exec"), namespace)
        engine, accelerator = namespace["engine"], namespace["accelerator"]
        out: dict[str, Any] = {"losses": namespace["losses"], "weights": engine.full_state_dict(),
                               "left_alone": type(engine).__name__ == "Zero3Engine",  # not DDP around it
                               "distributed": accelerator.distributed_type.value}
        optimizer = accelerator.prepare(engine.optimizer)  # wrapped by Accelerate: its step() is refused
        engine.backward(engine(torch.ones(2, 16)).sum())
        try:
            optimizer.step()
        except RuntimeError as exc:
            out["optimizer_step"] = str(exc)
        engine.step()
    with _accelerate_launch(ctx):
        accelerator = Accelerator(gradient_accumulation_steps=2)
        torch.manual_seed(0)
        model = TinyMLP(depth=3, width=16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 16))
        ddp, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=4))
        out["twin_wrapped"] = type(ddp).__name__
        out["twin_losses"] = []
        for x, y in loader:
            with accelerator.accumulate(ddp):
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            out["twin_losses"].append(loss.item())
        out["twin_weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _imported(code: str) -> set[str]:
    """The top-level packages a block imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("block", POOL_BLOCKS, ids=Block.name)
def test_the_block_runs_on_two_ranks(block: Block, pools: PoolSet, tmp_path: Path) -> None:
    for package in sorted(_imported(block.code)):
        pytest.importorskip(package)  # peft and transformers come with the dev extra
    if "accelerate" in _imported(block.code):  # at parity with Accelerate + DDP on the same data
        import torch

        for r in pools.run(2, _exec_accelerate_block, block.code, block.name(), str(tmp_path), timeout=120):
            assert r["distributed"] == "MULTI_CPU" and r["left_alone"] and r["twin_wrapped"] == "DistributedDataParallel"
            assert "Call engine.step() instead; nothing was changed" in r["optimizer_step"]
            assert len(r["losses"]) == len(r["twin_losses"]) == 8  # 64 rows, batches of 4, half on each rank
            torch.testing.assert_close(r["losses"], r["twin_losses"], rtol=1e-5, atol=0)
            assert r["weights"].keys() == r["twin_weights"].keys()
            for name, value in r["twin_weights"].items():
                torch.testing.assert_close(r["weights"][name], value, rtol=1e-5, atol=1e-7)
        return
    printed = pools.run(2, _exec_block, block.code, block.name(), str(tmp_path), timeout=120)
    assert len(printed) == 2  # both ranks ran it to the end
    if "print(engine.stats())" in block.code:
        assert all("Zero3Stats: step" in out for out in printed)
    if 'model.save_pretrained("lora")' in block.code:  # PEFT's save inside gathered_parameters: full adapters
        from safetensors.torch import load_file

        adapters = load_file(tmp_path / "lora" / "adapter_model.safetensors")
        assert adapters and all(t.dim() == 2 and t.numel() > 0 for t in adapters.values()), adapters


def test_the_readme_training_script_runs_under_torchrun(tmp_path: Path) -> None:
    """``train.py`` as the README writes it, launched by the README's own ``torchrun`` line."""
    readme = [b for b in ALL_BLOCKS if b.page.name == "README.md" and b.runnable]
    [script] = [b for b in readme if b.options.get("file") == "train.py"]
    [launch] = [b for b in readme if b.language == "bash"]
    (tmp_path / "train.py").write_text(script.code, encoding="utf-8")
    command = shlex.split(launch.code)
    assert command[0] == "torchrun" and command[-1] == "train.py"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *command[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^micro-step \d+: loss (\S+)$", done.stdout, re.M)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, done.stdout  # it learns
    assert "Zero3Stats: step 20 (micro-step 40)" in done.stdout  # 40 micro-steps, accumulation 2
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "runs" / "my_run" / "weights" / "model.safetensors")
    assert weights["tok_emb.weight"].shape == (256, 64)  # whole, not a shard
    assert (tmp_path / "runs" / "my_run" / "checkpoint" / "z3kit_manifest.json").is_file()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # a '#' comment in code is no heading
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_somewhere(page: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = page if not path else (page.parent / path).resolve()
        assert linked.exists(), f"{page.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(linked), f"{page.name}: link to {target}: no such heading"


def test_the_readme_opens_with_what_a_newcomer_needs() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 600, "keep the README under 600 lines: move measurements and internals to docs/"
    opening = "\n".join(lines[:120])
    assert "## Contents" in opening and "\ntorchrun " in opening
