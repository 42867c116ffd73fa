"""``--save-every``, ``--resume``, ``--init-from`` and ``--export``: the run's
weights and training state in and out, through the engine's own methods.

- ``engine.save_checkpoint`` / ``load_checkpoint``: the sharded training
  state (parameters, optimizer state, random state, step counters), each
  rank writing its part, committed with a manifest; a checkpoint saved at
  one world size loads at another (the engine reshards).
- ``save_pretrained`` / ``load_pretrained``: the full parameters as
  Hugging Face-layout safetensors under GPT-2's names (``hf_export``: the
  folder loads with ``AutoModelForCausalLM.from_pretrained``), written by
  rank 0 as they are gathered, read straight into the shards.

What the engine does not know, the job keeps in the checkpoint's
``client_state`` (:func:`client_state`): the next step, the LR schedule,
the loss history so far, the arguments a continuation must share
(:func:`run_arguments`) and the command that saved it.

Note: what makes a resumed run exact.
    A rank's batches are seeded by ``(seed, rank, step)`` and the learning
    rate is a function of the step and the schedule, so a run that restarts
    at step ``s`` with the same corpus, model, seed, batch size, learning
    rate and accumulation steps, at the same world size, draws the same
    batches with the same learning rates, while the engine restores the
    parameters, the optimizer state and the random state. Its losses from
    ``s`` on then equal an uninterrupted run's bit for bit (fp32). A resumed
    run keeps the saved run's LR schedule, also when ``--steps`` differs (a
    run extended past it trains on at the schedule's final rate). At another
    world size the engine reshards, but each rank's batches are another data
    order: the run continues, not exactly, and the loss history before the
    resume keeps only the mean over the old ranks (each new rank's column).
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from z3kit_recipes import zero3
from z3kit_recipes.models import GPTConfig
from z3kit_recipes.train import hf_export
from z3kit_recipes.train.corpus import CharVocab
from z3kit_recipes.train.loop import LoopStart
from z3kit_recipes.train.run_folder import checkpoint_path, rotate
from z3kit_recipes.train.spec import RunSpec
from z3kit_recipes.zero3.weights.commit import read_manifest

#: version of the job's ``client_state`` layout
CLIENT_STATE_VERSION: Final = 1
#: the manifest's kind of a checkpoint (``zero3.weights.checkpoint``) and of an export (``zero3.weights.pretrained``)
CHECKPOINT_KIND: Final = "z3kit checkpoint"
EXPORT_KIND: Final = "hugging-face weights"


def vocab_digest(vocab: CharVocab) -> str:
    return hashlib.sha256(vocab.chars.encode("utf-8")).hexdigest()


def run_arguments(spec: RunSpec, vocab_sha256: str) -> dict[str, Any]:
    """What a resumed run must share with the saved one (see the module's note)."""
    m = spec.model
    return {
        "model_size": spec.model_size, "width": m.width, "layers": m.n_layer, "heads": m.n_head,
        "seq_len": m.seq_len, "vocab_size": m.vocab_size, "vocab_sha256": vocab_sha256,
        "corpus_chars": spec.corpus_chars, "corpus_sha256": spec.corpus_digest, "seed": spec.seed,
        "batch_size": spec.batch_size, "lr": spec.lr, "gradient_accumulation_steps": spec.micro_steps,
        "dtype": spec.config.compute_dtype, "optimizer": spec.optimizer,
    }  # fmt: skip


def client_state(
    spec: RunSpec, vocab_sha256: str, next_step: int, schedule_steps: int, loss_table: list[list[float]], lrs: list[float]
) -> dict[str, Any]:
    """The job's part of a checkpoint saved after ``next_step`` steps
    (``loss_table[rank][step]``, every rank's: the saved object is rank 0's)."""
    return {
        "version": CLIENT_STATE_VERSION,
        "next_step": next_step,
        # a --config JSON's scheduler keeps its own state in the engine's part of the checkpoint
        "schedule": {"kind": "linear warm-up, cosine decay to lr / 10" if spec.config.lr_scheduler is None
                     else f"the --config JSON's {spec.config.lr_scheduler.type}",
                     "steps": schedule_steps, "peak_lr": spec.lr},
        "loss_table": loss_table,
        "lrs": list(lrs),
        "world": len(loss_table),
        "run": run_arguments(spec, vocab_sha256),
        "argv": list(spec.argv),
    }


def _model(a: Mapping[str, Any]) -> str:
    return f"{a['model_size']} ({a['layers']} layers x {a['width']} wide, {a['heads']} heads, seq {a['seq_len']})"


def mismatches(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """Each argument where this run (``now``) would not continue the saved
    one, named by its option (both are :func:`run_arguments`)."""
    out = []
    dims = ("width", "layers", "heads", "seq_len")
    if any(saved[k] != now[k] for k in dims):
        option = "--model-size" if saved["model_size"] != now["model_size"] else "/".join(
            "--" + k.replace("_", "-") for k in dims if saved[k] != now[k])  # fmt: skip
        out.append(f"{option}: the checkpoint's model is {_model(saved)}, this run's {_model(now)}")
    if (saved["vocab_size"], saved["vocab_sha256"]) != (now["vocab_size"], now["vocab_sha256"]):
        out.append(f"--corpus-chars: the vocabulary differs ({saved['vocab_size']} characters from "
                   f"{saved['corpus_chars']:,} in the checkpoint, {now['vocab_size']} from {now['corpus_chars']:,} here)")
    elif saved["corpus_sha256"] != now["corpus_sha256"]:
        same = saved["corpus_chars"] == now["corpus_chars"]
        out.append(f"--corpus-chars: the corpus differs ({saved['corpus_chars']:,} characters in the checkpoint, "
                   f"{now['corpus_chars']:,} here{'; another Python standard library?' if same else ''})")
    for key, option in (("seed", "--seed"), ("batch_size", "--batch-size"), ("lr", "--lr"), ("dtype", "--dtype")):
        if saved[key] != now[key]:
            out.append(f"{option}: {saved[key]} in the checkpoint, {now[key]} here")
    if saved.get("optimizer", "adamw") != now["optimizer"]:  # checkpoints from before --optimizer: AdamW
        out.append(f"--optimizer: {saved.get('optimizer', 'adamw')} in the checkpoint, {now['optimizer']} here")
    key = "gradient_accumulation_steps"
    if saved[key] != now[key]:
        out.append(f"--config: {key} {saved[key]} in the checkpoint, {now[key]} here")
    return out


def check_resumable(path: str, client: Mapping[str, Any], spec: RunSpec, vocab_sha256: str) -> None:
    """Refuse (``ValueError`` naming each mismatch) to resume ``spec`` from
    the checkpoint at ``path`` whose client state is ``client``."""
    if not isinstance(client, Mapping) or client.get("version") != CLIENT_STATE_VERSION:
        raise ValueError(f"--resume {path}: not a checkpoint of python -m z3kit_recipes.train "
                         f"(client state version {CLIENT_STATE_VERSION})")  # fmt: skip
    problems = mismatches(client["run"], run_arguments(spec, vocab_sha256))
    if spec.steps <= client["next_step"]:
        problems.append(f"--steps {spec.steps}: the checkpoint is at step {client['next_step']} already "
                        "(--steps counts every step of the run, the resumed ones too)")  # fmt: skip
    if problems:
        saved = " ".join(client.get("argv", [])) or "(defaults)"
        raise ValueError(f"--resume {path}: this run does not continue the saved one: " + "; ".join(problems)
                         + f". The saved run's options: {saved}")  # fmt: skip


def read_client_state(path: str) -> dict[str, Any]:
    """The ``client_state`` of the checkpoint at ``path``, read in this
    process without a process group (before any rank starts)."""
    root = Path(path)
    try:
        manifest = read_manifest(root)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--resume {path}: {exc}") from None
    kind = manifest.get("kind")
    if kind == EXPORT_KIND:
        raise ValueError(f"--resume {path}: this is an --export (weights only): start from it with --init-from")
    if kind != CHECKPOINT_KIND:
        raise ValueError(f"--resume {path}: not a checkpoint (its manifest says {kind!r})")
    state: dict[str, Any] = {"client_state": (None,)}  # as zero3.weights.checkpoint saves it: a pickled one-tuple
    with warnings.catch_warnings():  # DCP says that it reads in one process: meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp_load(state, storage_reader=FileSystemReader(str(root)), no_dist=True)
    client: dict[str, Any] = state["client_state"][0]
    return client


@attrs.frozen
class SavedCheckpoint:
    step: int
    path: str
    seconds: float


@attrs.frozen
class CheckpointFigures:
    """The summary's record of what the run loaded and wrote."""

    init_from: str | None
    resumed_from: str | None
    #: the step the run resumed at, and the world size the checkpoint was saved at
    resumed_at_step: int | None
    resumed_world: int | None
    saved: list[SavedCheckpoint]
    export: str | None
    export_s: float | None


def init_from(engine: zero3.Zero3Engine, path: str, model: GPTConfig) -> str:
    """``--init-from``: the weights of ``path`` into the shards (collective)."""
    hf_export.init_from(engine, path, model)
    return f"initialized from {path}"


def load_client_state(engine: zero3.Zero3Engine, path: str) -> Any:
    """Load the checkpoint at ``path`` into the engine (collective); its client state
    (``load_checkpoint`` answers DeepSpeed's ``(path, client_state)``)."""
    _, client = engine.load_checkpoint(path)
    if client is None:
        raise ValueError(f"--resume {path}: no checkpoint there (an empty folder)")
    return client


def resume(engine: zero3.Zero3Engine, spec: RunSpec, vocab_sha256: str, path: str) -> tuple[LoopStart, int, str]:
    """``--resume``: load the checkpoint (collective), check it continues
    this run, and return where the loop starts, the world size it was saved
    at, and what rank 0 says."""
    client = load_client_state(engine, path)
    check_resumable(path, client, spec, vocab_sha256)
    step, table, saved_world = int(client["next_step"]), client["loss_table"], int(client["world"])
    if engine.progress()[0] != step:
        raise RuntimeError(f"--resume {path}: the engine is at step {engine.progress()[0]}, its client state at {step}")
    rank, world = engine.rank, engine.world
    if saved_world == world:
        mine = [float(v) for v in table[rank]]
    else:  # another world size: the old ranks' rows do not map onto the new ones
        mine = [sum(row[s] for row in table) / saved_world for s in range(step)]
    schedule = int(client["schedule"]["steps"])
    start = LoopStart(step, tuple(mine), tuple(float(v) for v in client["lrs"]), schedule)
    note = "" if saved_world == world else f"; saved at {saved_world} ranks, so the data order differs from here on"
    if schedule != spec.steps:
        note += f"; the LR schedule stays the saved run's ({schedule} steps)"
    return start, saved_world, f"resumed from {path} at step {step} of {spec.steps}{note}"


class Checkpointer:
    """What a run writes: with ``--save-every``, a checkpoint every
    ``spec.save_every`` steps (``after_step``, for the loop) and one at the
    end (``finish``), then ``--export``; all collective. Keeps the record
    for the summary (``figures``)."""

    def __init__(
        self, engine: zero3.Zero3Engine, spec: RunSpec, out: Path, vocab_sha256: str, start: LoopStart,
        resumed_world: int | None,
    ) -> None:  # fmt: skip
        self.engine, self.spec, self.out, self.vocab_sha256 = engine, spec, out, vocab_sha256
        self.start, self.resumed_world = start, resumed_world
        self.schedule_steps = spec.steps if start.schedule_steps is None else start.schedule_steps
        self.saved: list[SavedCheckpoint] = []
        #: the checkpoints this run wrote that are still there, oldest first (``--keep-last`` deletes from these)
        self.kept: list[Path] = []
        self.export_s: float | None = None

    def after_step(self, done: int, losses: list[float], lrs: list[float]) -> str | None:
        every = self.spec.save_every
        if every is None or done % every != 0 or done >= self.spec.steps:  # the last one: finish()
            return None
        return self.save(done, losses, lrs)

    def finish(self, losses: list[float], lrs: list[float]) -> list[str]:
        """The end of the run: the last checkpoint (``--save-every``) and ``--export``; what rank 0 says."""
        said = []
        if self.spec.save_every is not None:
            said.append(self.save(len(losses), losses, lrs))
        if self.spec.export is not None:
            started = time.perf_counter()
            hf_export.export(self.engine, self.spec.export, self.spec.model, self.spec.export_files)
            self.export_s = time.perf_counter() - started
            said.append(f"exported the weights to {self.spec.export} in {self.export_s:.1f} s")
        return said

    def figures(self) -> CheckpointFigures:
        resumed = self.spec.resume is not None
        return CheckpointFigures(
            self.spec.init_from, self.spec.resume, self.start.step if resumed else None, self.resumed_world,
            list(self.saved), self.spec.export, self.export_s,
        )  # fmt: skip

    def save(self, done: int, losses: list[float], lrs: list[float]) -> str:
        started = time.perf_counter()
        path = checkpoint_path(self.out, done)
        table = _gather_losses(losses, self.engine)
        state = client_state(self.spec, self.vocab_sha256, done, self.schedule_steps, table, lrs)
        # the checkpoint folder itself (DeepSpeed's save_dir/tag), without DeepSpeed's `latest` file
        self.engine.save_checkpoint(Path(path).parent, tag=Path(path).name, client_state=state, save_latest=False)
        seconds = time.perf_counter() - started
        self.saved.append(SavedCheckpoint(done, str(path), seconds))
        said = f"saved checkpoint {path} (step {done}) in {seconds:.1f} s"
        self.kept = [p for p in self.kept if p != path] + [path]
        keep = self.spec.keep_last
        if keep is not None:
            # rank 0 deletes, after every rank has written (save_checkpoint is collective); the newest stays
            doomed, self.kept = rotate(self.kept, keep, delete=self.engine.rank == 0)
            if doomed:
                said += f"; deleted {', '.join(p.name for p in doomed)} (--keep-last {keep})"
        return said


def _gather_losses(losses: list[float], engine: zero3.Zero3Engine) -> list[list[float]]:
    """Every rank's losses (float64: exactly this rank's Python floats), by rank."""
    row = torch.tensor(losses, dtype=torch.float64, device=engine.device)
    rows = [torch.empty_like(row) for _ in range(engine.world)]
    dist.all_gather(rows, row, group=engine.group)
    return [[float(v) for v in r.cpu().tolist()] for r in rows]
