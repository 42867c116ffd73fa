"""``--export`` loads everywhere: the job's GPT saved as Hugging Face's GPT-2
(``z3kit_recipes.models.gpt_hf``, ``train.hf_export``), loaded with
``AutoModelForCausalLM.from_pretrained`` and compared with the project's own
GPT (logits and greedy tokens); ``--init-from`` reads it back at another
world size; a bf16 save records bf16 in ``config.json``; and the main job,
run as a command, ends without a warning (no leaked semaphore)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from z3kit_recipes.models import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

#: 3 layers, a vocabulary and widths that are not powers of two
CONFIG = GPTConfig(vocab_size=53, width=24, n_layer=3, n_head=3, seq_len=20)
#: every parameter sharded (none kept gathered), so the export gathers each
SHARDED = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _trained_engine(ctx: Any, config: GPTConfig = CONFIG, *, compute: str = "fp32") -> Any:
    """A GPT trained 3 steps (AdamW) on this rank's random batches."""
    from z3kit_recipes import zero3

    torch.manual_seed(0)
    cfg = zero3.Zero3Config(param_persistence_threshold=0, compute_dtype=compute)
    engine = zero3.initialize(GPT(config), lambda p: torch.optim.AdamW(p, lr=1e-2), cfg, ctx.group)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    for _ in range(3):
        x = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=gen)
        logits = engine(x[:, :-1]).float()
        loss = nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), x[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
    return engine


def run_export(ctx: Any, out: str) -> dict[str, torch.Tensor]:
    from z3kit_recipes.train import hf_export

    engine = _trained_engine(ctx)
    hf_export.export(engine, out, CONFIG)
    return engine.full_state_dict()  # the GPT's own names, not through the GPT-2 mapping


def run_init_from(ctx: Any, path: str) -> dict[str, torch.Tensor]:
    from z3kit_recipes import zero3
    from z3kit_recipes.train import hf_export

    torch.manual_seed(7)  # another initialization, replaced by the export's weights
    engine = zero3.initialize(GPT(CONFIG), torch.optim.AdamW, SHARDED, ctx.group)
    hf_export.init_from(engine, path, CONFIG)
    return engine.full_state_dict()


def test_export_is_gpt2_and_generates_the_projects_tokens(pools: Any, tmp_path: Path) -> None:
    out = tmp_path / "export"
    full = pools.run(2, run_export, str(out))[0]
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "z3kit_manifest.json"]  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["dtype"]) == (["GPT2LMHeadModel"], "gpt2", "float32")

    ours = GPT(CONFIG).eval()
    ours.load_state_dict(full)  # strict: the tied lm_head.weight is under both names, as in GPT's state_dict
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == "GPT2LMHeadModel" and theirs.dtype == torch.float32
    assert theirs.lm_head.weight is theirs.transformer.wte.weight  # tied, as ours
    ids = torch.randint(0, CONFIG.vocab_size, (3, CONFIG.seq_len), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    prompt = ids[:, :4]
    want = ours.generate(prompt, CONFIG.seq_len - 4, temperature=0)
    got = theirs.generate(prompt, max_new_tokens=CONFIG.seq_len - 4, do_sample=False)
    assert torch.equal(got, want)

    # --init-from reads it back into shards, at another world size, bit for bit
    for back in (pools.run(1, run_init_from, str(out))[0], *pools.run(2, run_init_from, str(out))):
        assert back.keys() == full.keys() and all(torch.equal(back[n], full[n]) for n in full)


def test_transposed_ranges_read_only_their_rows(tmp_path: Path) -> None:
    """A shard's flat range of a weight stored transposed (GPT-2's Conv1D),
    also one that starts and ends inside a row."""
    from safetensors.torch import save_file

    from z3kit_recipes.zero3.weights.safetensors_io import index_of, read_flat_range

    weight = torch.randn(7, 5)
    save_file({"w": weight.t().contiguous()}, str(tmp_path / "model.safetensors"))
    stored = index_of(tmp_path)["w"]
    flat = weight.reshape(-1)
    for start, stop in [(0, 35), (0, 5), (3, 4), (3, 17), (12, 35), (34, 35)]:
        assert torch.equal(read_flat_range(stored, "w", start, stop, transposed=True), flat[start:stop])


def test_gpt2_mapping_names_every_tensor_once() -> None:
    from z3kit_recipes.models.gpt_hf import gpt2_config, gpt2_names, gpt2_transposed

    for tie_mode in ("hf", "functional"):
        config = GPTConfig(vocab_size=11, width=8, n_layer=2, n_head=2, seq_len=4, tie_mode=tie_mode)
        names = gpt2_names(config)
        assert set(names) == set(GPT(config).state_dict())
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2_config(config)))
        assert set(names.values()) <= set(hf.state_dict())
        for ours in gpt2_transposed(config):  # Conv1D: (in, out)
            assert hf.state_dict()[names[ours]].shape == GPT(config).state_dict()[ours].shape[::-1]


# --------------------------------------------------------------------------- #
# The dtype in config.json is the dtype saved
# --------------------------------------------------------------------------- #


def run_bf16_saves(ctx: Any, gpt_out: str, llama_out: str) -> None:
    from z3kit_recipes import zero3
    from z3kit_recipes.train.hf_export import gpt2_layout
    from z3kit_recipes.zero3.weights import pretrained

    engine = _trained_engine(ctx, compute="bf16")
    pretrained.save_pretrained(engine, gpt_out, dtype=torch.bfloat16, layout=gpt2_layout(CONFIG))
    config = transformers.LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(1)
    llama = zero3.initialize(transformers.LlamaForCausalLM(config), torch.optim.AdamW, SHARDED, ctx.group)
    llama.save_pretrained(llama_out, dtype=torch.bfloat16)


def test_a_bf16_save_loads_as_bf16(pools: Any, tmp_path: Path) -> None:
    gpt_out, llama_out = tmp_path / "gpt", tmp_path / "llama"
    pools.run(2, run_bf16_saves, str(gpt_out), str(llama_out))
    for out in (gpt_out, llama_out):
        config = json.loads((out / "config.json").read_text())
        assert config["dtype"] == config["torch_dtype"] == "bfloat16", out
        model = transformers.AutoModelForCausalLM.from_pretrained(out)  # dtype: the config's
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, out
        ids = torch.randint(0, 50, (1, 6))
        assert torch.isfinite(model(ids).logits.float()).all()


# --------------------------------------------------------------------------- #
# The main job as a command: its export, and no warning at the end
# --------------------------------------------------------------------------- #


def test_main_job_exports_for_transformers_and_ends_without_warnings(tmp_path: Path) -> None:
    """The smallest run of the job's tests (tiny model, 2 spawned ranks), as
    a command: nothing on stderr but the progress bar, no leaked semaphore
    (tqdm's lock was one per rank; see ``train.loop``)."""
    out = tmp_path / "run"
    argv = ["--nproc", "2", "--steps", "2", "--model-size", "tiny", "--sample-chars", "0",
            "--corpus-chars", "50000", "--out", str(out), "--export", str(out / "export")]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "z3kit_recipes.train", *argv], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "leaked semaphore" not in done.stderr
    # the bar redraws itself with carriage returns; every other line would be a warning or an error
    lines = [part for line in done.stderr.splitlines() for part in line.split("\r") if part.strip()]
    others = [line for line in lines if "step/s" not in line and "?step/s" not in line]
    assert not others, done.stderr
    assert not [line for line in lines if "warn" in line.lower()]

    export = out / "export"
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    s = json.loads((out / "summary.json").read_text())
    assert model.config.vocab_size == s["corpus"]["vocab_size"] and s["checkpoints"]["export"] == str(export)
    # the project's GPT from the same file, through the GPT-2 names the other way
    from safetensors.torch import load_file

    from z3kit_recipes.models.gpt_hf import gpt2_names, gpt2_transposed
    from z3kit_recipes.train import gpt_config

    config = gpt_config("tiny", s["corpus"]["vocab_size"])
    stored = load_file(export / "model.safetensors")
    flipped = gpt2_transposed(config)
    ours = GPT(config).eval()
    ours.load_state_dict({n: stored[h].t() if n in flipped else stored[h]
                          for n, h in gpt2_names(config).items() if h in stored}, strict=False)  # fmt: skip
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    want = ours.generate(prompt, 12, temperature=0)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), want)

    # the vocabulary is in the folder, committed with the weights, and reads back as text
    manifest = json.loads((export / "z3kit_manifest.json").read_text())
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])
    from z3kit_recipes.train.corpus import CharVocab, load_corpus

    corpus = load_corpus(50_000)
    vocab = CharVocab.from_text(corpus.text)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert len(tokenizer) == len(vocab) == model.config.vocab_size
    sample = corpus.text[20_000:22_000]
    assert "\n" in sample and "    " in sample
    ids = tokenizer.encode(sample)
    assert ids == vocab.encode(sample).tolist()  # the ids the model trained on
    assert tokenizer.decode(ids) == sample
    text_prompt = "    def __init__(self"
    generator = transformers.pipeline("text-generation", model=str(export))
    generated = generator(text_prompt, max_new_tokens=12, do_sample=False)[0]["generated_text"]
    greedy = ours.generate(vocab.encode(text_prompt)[None], 12, temperature=0)[0]
    assert generated == vocab.decode(greedy)  # the prompt and 12 characters, as the project's GPT writes them
    assert generated.startswith(text_prompt) and len(generated) == len(text_prompt) + 12


def test_the_tokenizer_is_the_character_vocabulary() -> None:
    """Every character of the corpus, spaces and newlines included: the
    vocabulary's ids, and back to the same text; a character outside it is refused."""
    from z3kit_recipes.train.corpus import CharVocab, load_corpus
    from z3kit_recipes.train.tokenizer import char_tokenizer

    text = load_corpus(200_000).text
    vocab = CharVocab.from_text(text)
    tokenizer = char_tokenizer(vocab, max_length=64)
    ids = tokenizer.encode(text)
    assert ids == vocab.encode(text).tolist()
    assert tokenizer.decode(ids) == text
    edges = "  \n\n x = 1  \n"
    assert set(edges) <= set(vocab.chars) and tokenizer.decode(tokenizer.encode(edges)) == edges
    assert tokenizer.convert_ids_to_tokens(vocab.encode("ab").tolist()) == ["a", "b"]
    outside = next(chr(c) for c in range(0x4E00, 0x9FFF) if chr(c) not in vocab.chars)
    with pytest.raises(Exception, match="UNK"):
        tokenizer.encode(f"a{outside}b")


def run_refused_saves(ctx: Any, out: str) -> list[str]:
    from tests.errors import error_of
    from z3kit_recipes import zero3
    from z3kit_recipes.train.hf_export import gpt2_layout
    from z3kit_recipes.zero3.weights import pretrained
    from z3kit_recipes.zero3.weights.export_layout import ExportLayout

    engine = zero3.initialize(GPT(CONFIG), torch.optim.AdamW, SHARDED, ctx.group)
    layout = gpt2_layout(CONFIG)
    partial = ExportLayout({k: v for k, v in layout.names.items() if "ln_f" not in k}, layout.transposed, layout.config)
    return [
        error_of(pretrained.save_pretrained, engine, out, layout=partial),
        error_of(pretrained.save_pretrained, engine, out, dtype=torch.int8),
        _missing_error(pretrained.load_pretrained, engine, out, layout=partial),
    ]


def _missing_error(fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except FileNotFoundError as e:
        return f"FileNotFoundError: {e}"
    return "no error"


def test_bad_layout_or_dtype_is_refused_before_anything_is_written(pools: Any, tmp_path: Path) -> None:
    out = tmp_path / "export"
    for save_layout, save_dtype, load in pools.run(2, run_refused_saves, str(out)):
        assert save_layout.startswith("ValueError: ") and "no stored name for 2" in save_layout
        assert "ln_f.weight, ln_f.bias" in save_layout and "Nothing was read or written" in save_layout
        assert save_dtype.startswith("TypeError: ") and "floating-point torch.dtype" in save_dtype
        assert load.startswith("FileNotFoundError: ") and "does not exist" in load
    assert list(tmp_path.iterdir()) == []  # no folder, no staging folder


def test_an_export_layout_refuses_two_tensors_under_one_name() -> None:
    from z3kit_recipes.zero3.weights.export_layout import ExportLayout

    with pytest.raises(ValueError, match="several tensors under one name: x"):
        ExportLayout({"a": "x", "b": "x"})
    with pytest.raises(ValueError, match="transposed names tensors that names does not: c"):
        ExportLayout({"a": "x"}, {"c"})
    with pytest.raises(ValueError, match="not a plain file name of its own: '../t.json', 'config.json', 'w.safetensors'"):
        ExportLayout({"a": "x"}, files={"config.json": "{}", "w.safetensors": "", "../t.json": "", "ok.json": ""})
