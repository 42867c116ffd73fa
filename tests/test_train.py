"""The training command ``python -m z3kit_recipes.train``: corpus, config,
options, the summary's memory figures, and a short end-to-end run on 2
spawned gloo ranks."""

from __future__ import annotations

import csv
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F

from z3kit.memory import MemoryKind, MemoryReport
from z3kit_recipes import train
from z3kit_recipes.launch import free_port
from z3kit_recipes.train.corpus import SKIPPED_DIRS
from z3kit_recipes.train.memory import KINDS, MemoryFigures, RankMemory, Replica, peak_rss_bytes
from z3kit_recipes.train.render import render_memory
from z3kit_recipes.models import GPT, GPTConfig
from z3kit_recipes.models.gpt_hf import gpt2_names, gpt2_transposed
from z3kit_recipes.zero3.config.auto import auto_sizes, block_numel
from z3kit_recipes.zero3.config.config import Zero3Config

SMALL_CORPUS = 200_000


# --------------------------------------------------------------------------- #
# Corpus, vocabulary, batches
# --------------------------------------------------------------------------- #


def test_corpus_is_deterministic_and_nonempty() -> None:
    files = train.corpus_files()
    assert files, "the standard library has .py files"
    rel = [p.relative_to(train.stdlib_root()).as_posix() for p in files]
    assert rel == sorted(rel)
    assert not any(part in SKIPPED_DIRS for r in rel for part in r.split("/")[:-1])

    a = train.load_corpus(SMALL_CORPUS)
    b = train.load_corpus(SMALL_CORPUS)
    assert a == b and a.digest == b.digest
    assert len(a.text) == SMALL_CORPUS and a.files > 0
    assert "def " in a.text and "import " in a.text
    # a longer corpus starts with the shorter one
    assert train.load_corpus(2 * SMALL_CORPUS).text.startswith(a.text)


def test_corpus_rejects_empty_sources(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no readable"):
        train.load_corpus(1000, root=tmp_path)
    with pytest.raises(ValueError, match="max_chars"):
        train.load_corpus(0)


def test_vocab_round_trip() -> None:
    text = train.load_corpus(50_000).text
    vocab = train.CharVocab.from_text(text)
    assert list(vocab.chars) == sorted(set(text))
    ids = vocab.encode(text)
    assert ids.dtype == torch.int64 and ids.numel() == len(text)
    # ids are places in the sorted alphabet of the text, every one of them used
    assert int(ids.min()) == 0 and int(ids.max()) == len(vocab) - 1
    assert ids[:500].tolist() == [vocab.chars.index(c) for c in text[:500]]
    assert vocab.decode(ids) == text
    with pytest.raises(ValueError, match="not in the vocabulary"):
        vocab.encode("\u2603")
    assert vocab.encode("").numel() == 0


def test_batches_are_seeded_by_rank_and_step() -> None:
    data = torch.arange(1000) % 97
    x, y = train.sample_batch(data, 4, 16, seed=0, rank=0, step=3)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next characters
    again, _ = train.sample_batch(data, 4, 16, seed=0, rank=0, step=3)
    assert torch.equal(x, again)
    other_rank, _ = train.sample_batch(data, 4, 16, seed=0, rank=1, step=3)
    other_step, _ = train.sample_batch(data, 4, 16, seed=0, rank=0, step=4)
    assert not torch.equal(x, other_rank) and not torch.equal(x, other_step)
    with pytest.raises(ValueError, match="shorter than one sequence"):
        train.sample_batch(data[:10], 1, 16, seed=0, rank=0, step=0)


def test_lr_schedule_warms_up_and_decays() -> None:
    lrs = [train.lr_at(s, 200, 1.0) for s in range(200)]
    assert lrs[0] < lrs[5] <= 1.0
    assert max(lrs) == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1, abs=0.01)
    assert all(0.0 < lr <= 1.0 for lr in lrs)


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #

MODEL = GPTConfig(vocab_size=96, width=64, n_layer=2, n_head=2, seq_len=32)


def _write(tmp_path: Path, name: str, obj: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return path


def test_auto_sizes_fit_the_model() -> None:
    auto = auto_sizes(MODEL.width)
    block = GPT(MODEL).blocks[0]
    assert block_numel(MODEL.width) == sum(p.numel() for p in block.parameters())
    # biases and LayerNorms persist; no weight matrix does
    persistent = {n for n, p in block.named_parameters() if p.numel() < auto["param_persistence_threshold"]}
    assert persistent == {n for n, p in block.named_parameters() if p.dim() == 1}
    # one block is one prefetch and one gradient bucket; two blocks may be live at once
    assert auto["prefetch_bucket_size"] == auto["reduce_bucket_size"] == block_numel(MODEL.width)
    assert auto["max_live_parameters"] == 2 * block_numel(MODEL.width) + block_numel(MODEL.width) // 4
    assert attrs.asdict(train.load_config(None, MODEL)) == {**attrs.asdict(Zero3Config()), **auto}


def test_deepspeed_config_with_auto_sizes(tmp_path: Path) -> None:
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "reduce_bucket_size": 5e4,
            "overlap_comm": False,
        },
    }
    config = train.load_config(_write(tmp_path, "ds.json", ds), MODEL)
    # the main job and the library fill "auto" alike
    assert config == Zero3Config.from_deepspeed(ds, hidden_size=MODEL.width)
    auto = auto_sizes(MODEL.width)
    assert config.prefetch_bucket_size == auto["prefetch_bucket_size"]
    assert config.param_persistence_threshold == auto["param_persistence_threshold"]
    assert config.reduce_bucket_size == 50_000
    assert config.overlap_comm is False and config.gradient_clipping == 1.0
    assert config.compute_dtype == "bf16"
    # knobs the file leaves out keep DeepSpeed's defaults
    assert config.max_live_parameters == Zero3Config().max_live_parameters
    # --dtype overrides the file
    assert train.load_config(_write(tmp_path, "ds.json", ds), MODEL, "fp32").compute_dtype == "fp32"


def test_z3kit_config_auto_sizes_match_the_deepspeed_ones(tmp_path: Path) -> None:
    z3 = {"prefetch_bucket_size": "auto", "max_live_parameters": "auto", "reduce_bucket_size": 4096}
    # gradient_clipping written: a DeepSpeed JSON that leaves it out clips at DeepSpeed's default, 1.0
    ds = {"gradient_clipping": 0.0, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                                          "stage3_max_live_parameters": "auto",
                                                          "reduce_bucket_size": 4096}}
    from_z3 = train.load_config(_write(tmp_path, "z.json", z3), MODEL)
    assert from_z3 == train.load_config(_write(tmp_path, "ds.json", ds), MODEL)
    assert from_z3 == Zero3Config.from_deepspeed(ds, hidden_size=MODEL.width)
    assert from_z3.max_live_parameters == auto_sizes(MODEL.width)["max_live_parameters"]
    assert from_z3.reduce_bucket_size == 4096
    assert from_z3.max_reuse_distance == Zero3Config().max_reuse_distance  # left out: the default


def test_z3kit_config(tmp_path: Path) -> None:
    config = train.load_config(_write(tmp_path, "z.json", {"max_live_parameters": 1234, "overlap_comm": False}), MODEL)
    assert config.max_live_parameters == 1234 and config.overlap_comm is False
    assert config.prefetch_bucket_size == Zero3Config().prefetch_bucket_size
    assert train.load_config(_write(tmp_path, "empty.json", {}), MODEL) == Zero3Config()
    assert train.load_config(_write(tmp_path, "empty.json", {}), MODEL, "bf16").compute_dtype == "bf16"


@pytest.mark.parametrize(
    ("obj", "error", "match"),
    [
        ({"stage3_prefetch_bucket_size": 10}, ValueError, "unknown z3kit config keys.*stage3_prefetch_bucket_size"),
        ({"max_live_parameters": -1}, ValueError, "max_live_parameters"),
        ({"overlap_comm": "yes"}, TypeError, "overlap_comm"),
        ({"zero_optimization": {"stage": 3}, "optimizer": {"type": "Lamb"}}, ValueError, "optimizer.type"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, ValueError, "offload_param"),
        ({"zero_optimization": {"stage": 2}}, ValueError, "stage 3"),
        ([1, 2], TypeError, "JSON object"),
        ({"gradient_clipping": "auto"}, ValueError, '"auto".*gradient_clipping'),
        ({"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": "auto"}, ValueError,
         '"auto".*gradient_accumulation_steps'),
    ],
)
def test_bad_configs_are_rejected(tmp_path: Path, obj: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        train.load_config(_write(tmp_path, "bad.json", obj), MODEL)


def test_config_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        train.load_config(path, MODEL)


def test_main_refuses_a_bad_config_before_spawning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "bad.json", {"no_such_knob": 1})
    assert train.main(["--config", str(path), "--out", str(tmp_path / "out"), "--corpus-chars", "50000"]) == 2
    assert "no_such_knob" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- #
# Options
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "0"],
        ["--steps", "ten"],
        ["--nproc", "0"],
        ["--batch-size", "-2"],
        ["--lr", "0"],
        ["--lr", "nan"],
        ["--lr", "fast"],
        ["--model-size", "huge"],
        ["--dtype", "fp16"],
        ["--width", "30", "--heads", "4"],
        ["--sample-chars", "-1"],
        ["--corpus-chars", "10"],
        ["--config", "/no/such/config.json"],
        ["--prompt", ""],
        ["--no-such-option"],
    ],
)
def test_parser_rejects_bad_values(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_parser_defaults_and_overrides() -> None:
    args = train.parse_args([])
    assert (args.nproc, args.steps, args.model_size, args.lr) == (2, train.DEFAULT_STEPS, "small", train.DEFAULT_LR)
    cfg = train.model_config_from_args(args, 50)
    assert (cfg.width, cfg.n_layer, cfg.n_head, cfg.seq_len) == train.MODEL_SIZES["small"]
    args = train.parse_args(["--model-size", "tiny", "--width", "48", "--seq-len", "16"])
    cfg = train.model_config_from_args(args, 50)
    tiny = train.MODEL_SIZES["tiny"]
    assert (cfg.width, cfg.n_layer, cfg.n_head, cfg.seq_len) == (48, tiny[1], tiny[2], 16)


# --------------------------------------------------------------------------- #
# Memory figures
# --------------------------------------------------------------------------- #


def _report(current: dict[str, int], peak: dict[str, int], device_peak: int | None = None) -> MemoryReport:
    return MemoryReport(current=current, peak=peak, peak_total=sum(peak.values()) - 1, device_peak=device_peak)


def test_rank_memory_survives_the_exchange_row() -> None:
    current = {k.value: 100 * (i + 1) for i, k in enumerate(MemoryKind)}
    peak = {k: 3 * v for k, v in current.items()}
    for rss, device in ((123 << 20, None), (None, 7 << 30)):
        mine = RankMemory.of(1, _report(current, peak, device), peak_rss=rss, peak_live_numel=4242)
        row = mine.to_row()
        assert row.dtype == torch.int64  # exact at any size
        back = RankMemory.from_row(1, [int(v) for v in row.tolist()])
        assert back == mine
        assert back.current_total == sum(current.values()) and back.peak_total == sum(peak.values()) - 1
        assert (back.peak_rss, back.device_peak) == (rss, device)


def test_peak_rss_reads_vmhwm(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  900000 kB\nVmHWM:\t  123456 kB\nVmRSS:\t  100000 kB\n")
    assert peak_rss_bytes(status) == 123456 * 1024
    status.write_text("Name:\tpython\n")
    assert peak_rss_bytes(status) is None
    assert peak_rss_bytes(tmp_path / "missing") is None
    if Path("/proc/self/status").is_file():
        rss = peak_rss_bytes()
        assert rss is not None and rss > 50 << 20  # this process imported torch


def test_replica_is_what_one_rank_holds_unsharded() -> None:
    fp32 = Replica.of(1000, torch.float32)
    assert fp32.bytes[MemoryKind.PARAM_SHARDS.value] == 4000 and fp32.bytes[MemoryKind.FP32_MASTERS.value] == 0
    assert fp32.total == 16 * 1000  # parameters, gradients, AdamW's two moments
    bf16 = Replica.of(1000, torch.bfloat16)
    assert bf16.bytes[MemoryKind.PARAM_SHARDS.value] == 2000 and bf16.bytes[MemoryKind.FP32_MASTERS.value] == 4000
    assert bf16.total == 18 * 1000
    assert set(fp32.bytes) == set(KINDS)


def test_memory_table_shows_every_kind_per_rank() -> None:
    current = dict.fromkeys(KINDS, 0) | {"param_shards": 2048, "optimizer_state": 4096 + 8}
    peak = current | {"grad_partitions": 2048, "grad_buckets": 1 << 20}
    ranks = [
        RankMemory.of(r, _report(current, peak, device_peak=3 << 20), peak_rss=200 << 20, peak_live_numel=10)
        for r in range(2)
    ]
    table = "\n".join(render_memory(MemoryFigures(1024, ranks, Replica.of(1024, torch.float32), "memory budget 9 B")))
    for kind in KINDS:
        assert kind in table
    assert "rank 0" in table and "rank 1" in table and "unsharded replica" in table
    assert "0 B / 2.0 kB" in table  # grad partitions: none after the step, a shard's worth at its peak
    assert "1.00 MB" in table and "200.00 MB" in table and "device peak" in table and "3.00 MB" in table
    assert "16.0 kB" in table  # the replica's total: 16 bytes per parameter
    assert "memory plan     memory budget 9 B" in table
    # every label stands apart from its first value, the longest kind's name included
    longest = max(KINDS, key=len)
    assert len(longest) >= len("host_optimizer_state")
    for line in table.splitlines():
        label = next((k for k in (*KINDS, "total", "process peak RSS", "device peak") if line.startswith(f"  {k} ")), None)
        if label is not None:
            assert line[len(label) + 2 : len(label) + 4] == "  ", line
    assert any(line.startswith(f"  {longest}  ") for line in table.splitlines())


# --------------------------------------------------------------------------- #
# End to end
# --------------------------------------------------------------------------- #


def test_runs_as_a_command() -> None:
    """``python -m z3kit_recipes.train`` imports the package and runs ``__main__``."""
    done = subprocess.run(
        [sys.executable, "-m", "z3kit_recipes.train", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m z3kit_recipes.train") and "--corpus-chars" in done.stdout


def test_end_to_end_two_ranks(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    steps = 6
    argv = [
        "--nproc", "2", "--steps", str(steps), "--model-size", "tiny", "--plot", "--profile",
        "--sample-chars", "40", "--corpus-chars", str(SMALL_CORPUS), "--out", str(tmp_path),
    ]  # fmt: skip
    assert train.main(argv) == 0
    printed = capfd.readouterr().out  # the ranks print, not this process
    assert "loss" in printed and "collectives" in printed and "sample:" in printed

    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["world"] == 2 and s["backend"] == "gloo"
    assert s["training"]["steps"] == steps
    assert math.isfinite(s["loss"]["start"]) and math.isfinite(s["loss"]["end"])
    assert 0 < s["loss"]["end"] < 2 * math.log(s["corpus"]["vocab_size"])

    vocab = s["corpus"]["vocab_size"]
    model = GPT(train.gpt_config("tiny", vocab))
    params = list(model.parameters())  # the tied lm head once
    mem = s["memory"]
    assert mem["model_numel"] == model.num_parameters()
    # analytically, at 2 ranks: each rank holds ceil(numel / 2) fp32 elements of every parameter
    shard_bytes = sum(math.ceil(p.numel() / 2) * 4 for p in params)
    # parameters under the persistence threshold stay gathered (whole, padded to 2 shards) between steps
    threshold = s["config"]["param_persistence_threshold"]
    persistent_bytes = sum(math.ceil(p.numel() / 2) * 2 * 4 for p in params if p.numel() < threshold)
    assert [r["rank"] for r in mem["per_rank"]] == [0, 1]
    for r in mem["per_rank"]:
        now, peak = r["current"], r["peak"]
        assert set(now) == set(peak) == set(KINDS)
        assert now["param_shards"] == peak["param_shards"] == shard_bytes
        assert now["fp32_masters"] == peak["fp32_masters"] == 0  # fp32: the shards are the masters
        # gradient partitions and buckets exist only from the first backward to the optimizer step
        assert now["grad_partitions"] == 0 and now["grad_buckets"] == 0
        assert peak["grad_partitions"] == shard_bytes  # one fp32 partition per parameter shard
        assert peak["grad_buckets"] > 0
        # AdamW: exp_avg and exp_avg_sq like each shard, plus one scalar step per parameter
        assert 2 * shard_bytes < now["optimizer_state"] <= 2 * shard_bytes + 8 * len(params)
        assert now["gathered_params"] == persistent_bytes < peak["gathered_params"]
        # the live bound, plus a coalesced prefetch's output buffer beside the parameters
        # it is copied into (for a moment), plus padding (< 1 element per parameter)
        transient = s["config"]["prefetch_bucket_size"]
        assert peak["gathered_params"] <= 4 * (r["peak_live_numel"] + transient + len(params))
        assert r["current_total"] == sum(now.values())
        assert max(peak.values()) <= r["peak_total"] <= sum(peak.values())
        assert r["device_peak"] is None  # CPU
        if Path("/proc/self/status").is_file():
            assert r["peak_rss"] > 50 << 20  # torch alone is larger
    assert mem["replica"]["bytes"]["param_shards"] == 4 * mem["model_numel"]
    assert mem["replica"]["total"] == 16 * mem["model_numel"]  # parameters, gradients, two moments
    assert mem["plan"] is None
    assert "memory per rank" in printed and "unsharded replica" in printed and "process peak RSS" in printed

    live = s["live"]
    assert live["peak_live_numel"] == max(r["peak_live_numel"] for r in mem["per_rank"])
    assert 0 < live["peak_live_numel"] <= live["max_live_parameters"] + live["largest_fetch_numel"]
    assert live["peak_live_numel"] < mem["model_numel"]  # sharding shows: never the whole model at once
    coll = s["collectives"]
    assert coll["calls_per_step"] > 0 and coll["bytes_per_step"] > 0
    assert "all_gather" in coll["per_step"]
    assert 0.0 <= s["comm_wait"]["share"] <= 1.0
    # the first step records the trace; every later one matches it
    assert s["trace"] == {"state": "complete", "invalidations": 0}
    timeline = s["timeline"]
    assert timeline["step"] == steps - 1 and timeline["events"] > 0
    assert timeline["peak_live_numel"] <= live["peak_live_numel"]
    # Fetches of the last step that had to gather parameters themselves
    # (prefetch had not brought them): none, in forward or in backward. A
    # parameter released in forward moves the prefetch frontier back to its
    # next use, so backward's fetches are prefetched too.
    assert timeline["demand_gathers"] == 0
    assert timeline["prefetches"] > 0
    assert s["sample"]["text"].startswith(train.DEFAULT_PROMPT)
    assert len(s["sample"]["text"]) == len(train.DEFAULT_PROMPT) + 40

    with (tmp_path / "loss_history.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == steps and set(rows[0]) >= {"step", "lr", "loss_mean", "loss_rank0", "loss_rank1"}

    for png in ("loss.png", "live_params.png"):
        data = (tmp_path / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000
    for r in range(2):
        trace = (tmp_path / f"trace_rank{r}.json").read_text()
        assert "z3kit.fetch" in trace and "z3kit.release" in trace and "z3kit.reduce_bucket" in trace
        json.loads(trace)  # loadable by Perfetto / chrome://tracing
    labels = s["profile"]["labels_rank0"]
    assert labels["z3kit.fetch"] > 0 and labels["z3kit.reduce_bucket"] > 0
    assert set(s["files"]) >= {"summary.json", "loss_history.csv", "loss.png", "live_params.png", "trace_rank0.json"}


def test_profile_window() -> None:
    assert train.profile_window(1) == (-1, -1)
    assert train.profile_window(2) == (1, 2)
    assert train.profile_window(6) == (2, 2 + train.PROFILE_STEPS)
    first, end = train.profile_window(400)
    assert end - first == train.PROFILE_STEPS and end < 400


def test_missing_cli_extra_is_reported(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.import_module

    def no_matplotlib(name: str, package: str | None = None) -> object:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_matplotlib)
    assert train.main(["--plot", "--corpus-chars", "50000"]) == 2
    assert "z3kit[cli]" in capsys.readouterr().err


def test_torchrun_launch_runs_in_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With torchrun's variables set, main() trains in the calling process
    (here one gloo rank on the CPU) and picks ./runs/<timestamp> itself."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    assert train.main(["--steps", "3", "--model-size", "tiny", "--sample-chars", "0", "--corpus-chars", "50000"]) == 0
    assert not torch.distributed.is_initialized()
    (run,) = (tmp_path / "runs").iterdir()
    s = json.loads((run / "summary.json").read_text())
    assert s["world"] == 1 and s["backend"] == "gloo" and s["training"]["steps"] == 3
    r0 = s["memory"]["per_rank"][0]
    assert r0["current"]["param_shards"] == 4 * s["memory"]["model_numel"]  # one rank holds everything
    assert "loss" in capsys.readouterr().out


# --------------------------------------------------------------------------- #
# Checkpoints: --save-every, --resume, --init-from, --export
# --------------------------------------------------------------------------- #

TINY_RUN = ["--model-size", "tiny", "--sample-chars", "0", "--corpus-chars", "50000"]


def _main_printing(argv: list[str], log: Path) -> tuple[int, str]:
    """``train.main(argv)`` with file descriptor 1 (this process's and the
    spawned ranks') sent to ``log``: its status and what was printed."""
    sys.stdout.flush()
    saved = os.dup(1)
    with log.open("w+") as f:
        os.dup2(f.fileno(), 1)
        try:
            status = train.main(argv)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
    return status, log.read_text()


def _torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's variables for one rank: main() trains in this process."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(key, value)


def _losses(out: Path, column: str = "loss_mean") -> list[float]:
    with (out / "loss_history.csv").open() as f:
        return [float(row[column]) for row in csv.DictReader(f)]


@attrs.frozen
class _Runs:
    a: Path
    b: Path
    printed_a: str
    printed_b: str


@pytest.fixture(scope="module")
def saved_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    """Run A: 6 steps, a checkpoint every 3; run B: resumed from A's step-3
    checkpoint up to 6. Both export their final weights (2 spawned ranks each)."""
    root = tmp_path_factory.mktemp("checkpoints")
    a, b = root / "a", root / "b"
    status, printed_a = _main_printing(
        [*TINY_RUN, "--steps", "6", "--save-every", "3", "--out", str(a), "--export", str(a / "export")], root / "a.log"
    )
    assert status == 0, printed_a
    resume = ["--steps", "6", "--resume", str(a / "checkpoint-000003"), "--out", str(b), "--export", str(b / "export")]
    status, printed_b = _main_printing([*TINY_RUN, *resume], root / "b.log")
    assert status == 0, printed_b
    return _Runs(a, b, printed_a, printed_b)


def test_resume_continues_exactly(saved_and_resumed: _Runs) -> None:
    a, b = saved_and_resumed.a, saved_and_resumed.b
    # steps 3..5 of the resumed run, bit for bit (the CSV holds each float in full), every rank
    for column in ("loss_rank0", "loss_rank1", "loss_mean"):
        losses_a, losses_b = _losses(a, column), _losses(b, column)
        assert len(losses_a) == len(losses_b) == 6
        assert losses_b[3:] == losses_a[3:]
        assert losses_b[:3] == losses_a[:3]  # the history before the resume comes from the checkpoint
    # the final full parameters too
    from safetensors.torch import load_file

    weights_a, weights_b = load_file(a / "export" / "model.safetensors"), load_file(b / "export" / "model.safetensors")
    assert sorted(weights_a) == sorted(weights_b) and "transformer.wte.weight" in weights_a  # GPT-2's names
    for name, tensor in weights_a.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, weights_b[name]), name

    assert sorted(p.name for p in a.glob("checkpoint-*")) == ["checkpoint-000003", "checkpoint-000006"]
    assert not list(b.glob("checkpoint-*"))  # no --save-every
    sa, sb = (json.loads((out / "summary.json").read_text()) for out in (a, b))
    assert [c["step"] for c in sa["checkpoints"]["saved"]] == [3, 6]
    assert sa["checkpoints"]["export"] == str(a / "export") and sa["checkpoints"]["resumed_from"] is None
    assert "checkpoint-000003/" in sa["files"]
    assert sb["checkpoints"]["resumed_from"] == str(a / "checkpoint-000003")
    assert (sb["checkpoints"]["resumed_at_step"], sb["checkpoints"]["resumed_world"]) == (3, 2)
    assert (sb["training"]["steps"], sb["training"]["first_step"]) == (6, 3)
    assert sb["loss"]["first"] == sa["loss"]["first"] and sb["loss"]["last"] == sa["loss"]["last"]
    # one line each, from rank 0
    pa, pb = saved_and_resumed.printed_a, saved_and_resumed.printed_b
    assert pa.count("saved checkpoint ") == 2 and pa.count(f"exported the weights to {a / 'export'}") == 1
    assert pb.count(f"resumed from {a / 'checkpoint-000003'} at step 3 of 6") == 1
    assert "saved checkpoint" not in pb and pb.count("exported the weights to") == 1


def test_init_from_starts_from_the_exported_weights(
    saved_and_resumed: _Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step from A's export (one rank, in this process): its loss is the
    loss of A's final weights on that step's batch, not a fresh model's."""
    a = saved_and_resumed.a
    _torchrun_env(monkeypatch)
    out = tmp_path / "c"
    assert train.main([*TINY_RUN, "--steps", "1", "--init-from", str(a / "export"), "--out", str(out)]) == 0
    (first,) = _losses(out, "loss_rank0")

    from safetensors.torch import load_file

    corpus = train.load_corpus(50_000)
    vocab = train.CharVocab.from_text(corpus.text)
    model = GPT(train.gpt_config("tiny", len(vocab)))
    stored = load_file(a / "export" / "model.safetensors")  # GPT-2's names, Conv1D weights transposed
    config, flipped = model.config, gpt2_transposed(model.config)
    own = {n: stored.pop(h).t() if n in flipped else stored.pop(h) for n, h in gpt2_names(config).items() if h in stored}
    loaded = model.load_state_dict(own, strict=False)
    assert loaded.missing_keys == ["lm_head.weight"] and not stored  # tied to tok_emb.weight
    x, y = train.sample_batch(vocab.tokens(corpus.text), 16, 32, seed=0, rank=0, step=0)
    with torch.no_grad():
        want = float(F.cross_entropy(model(x).float().reshape(-1, len(vocab)), y.reshape(-1)))
    assert first == pytest.approx(want, rel=1e-6, abs=1e-6)
    # A's own first step trained a fresh model on this very batch (seed 0, rank 0, step 0)
    assert abs(first - _losses(a, "loss_rank0")[0]) > 0.05
    s = json.loads((out / "summary.json").read_text())
    assert s["checkpoints"]["init_from"] == str(a / "export")


def test_resume_at_another_world_size(saved_and_resumed: _Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A's 2-rank checkpoint resumed on one rank: the engine reshards; the
    history before the resume is the saved mean over A's ranks."""
    a = saved_and_resumed.a
    _torchrun_env(monkeypatch)
    out = tmp_path / "d"
    assert train.main([*TINY_RUN, "--steps", "4", "--resume", str(a / "checkpoint-000003"), "--out", str(out)]) == 0
    losses = _losses(out)
    assert len(losses) == 4 and losses[:3] == _losses(a)[:3] and math.isfinite(losses[3])
    s = json.loads((out / "summary.json").read_text())
    assert (s["world"], s["checkpoints"]["resumed_world"], s["training"]["first_step"]) == (1, 2, 3)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (["--model-size", "small"], "--model-size: the checkpoint's model is tiny"),
        (["--seq-len", "16"], "--seq-len"),
        (["--seed", "1"], "--seed: 0 in the checkpoint, 1 here"),
        (["--batch-size", "8"], "--batch-size: 16 in the checkpoint, 8 here"),
        (["--lr", "0.01"], "--lr"),
        (["--corpus-chars", "60000"], "--corpus-chars"),
        (["--steps", "3"], "--steps 3: the checkpoint is at step 3 already"),
        (["--optimizer", "muon"], "--optimizer: adamw in the checkpoint, muon here"),
    ],
)
def test_resume_refuses_another_run(
    saved_and_resumed: _Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: list[str], named: str
) -> None:
    """Checked before any process starts: status 2, the option named."""
    argv = [*TINY_RUN, "--steps", "6", "--resume", str(saved_and_resumed.a / "checkpoint-000003"), *change]
    assert train.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "does not continue the saved one" in err and named in err
    assert not (tmp_path / "out").exists()


def test_resume_refuses_what_is_not_a_checkpoint(
    saved_and_resumed: _Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train.main([*TINY_RUN, "--resume", str(saved_and_resumed.a / "export")]) == 2
    assert "start from it with --init-from" in capsys.readouterr().err
    assert train.main([*TINY_RUN, "--resume", str(tmp_path)]) == 2  # no manifest
    assert f"error: --resume {tmp_path}: " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--save-every", "0"], "--save-every"),
        (["--save-every", "1", "--keep-last", "0"], "--keep-last: must be >= 1"),
        (["--keep-last", "2"], "--keep-last 2 rotates the checkpoints that --save-every N saves: give --save-every too"),
        (["--resume", "/no/such/checkpoint"], "no such folder"),
        (["--init-from", "/no/such/export"], "no such folder"),
        (["--resume", ".", "--init-from", "."], "not allowed with"),
        (["--export", "."], "refusing to replace it"),
    ],
)
def test_checkpoint_options_are_checked(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_optimizer_muon_trains_and_is_not_given_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--optimizer muon: Muon on the blocks' matrices, AdamW on the rest (one rank, in this process);
    with a --config JSON that names an optimizer too, refused before anything starts."""
    _torchrun_env(monkeypatch)
    out = tmp_path / "muon"
    assert train.main([*TINY_RUN, "--steps", "3", "--optimizer", "muon", "--out", str(out)]) == 0
    assert "Muon (match_rms_adamw) on the blocks' matrices" in capsys.readouterr().out
    losses = _losses(out)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {}}}))
    assert train.main([*TINY_RUN, "--optimizer", "muon", "--config", str(path), "--out", str(tmp_path / "x")]) == 2
    assert "--optimizer muon and --config" in capsys.readouterr().err
