"""The job's character vocabulary as a Hugging Face tokenizer, for ``--export``.

One token per character, the id the model trained on (``CharVocab``: the
index into the sorted characters), so that ``AutoTokenizer`` and
``pipeline("text-generation", model=export)`` read an export back as
text: a ``tokenizers`` ``WordLevel`` model over the characters, a
pre-tokenizer that splits the text into single characters (newlines and
spaces included: ``[\\s\\S]`` matches every character), and a ``Fuse``
decoder that joins the tokens with nothing between them. Decoding leaves
the text as it is (``clean_up_tokenization_spaces`` off), so
``decode(encode(text)) == text`` for any text of the vocabulary's
characters; a character outside it is refused on encoding (there is no
unknown token: every id is a character the model knows).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from z3kit_recipes.train.corpus import CharVocab

def char_tokenizer(vocab: CharVocab, max_length: int) -> PreTrainedTokenizerFast:
    """The tokenizer of ``vocab``; ``max_length``: the model's sequence length."""
    # WordLevel wants an unknown token's name; it is not in the vocabulary, so an unknown character is an error
    model = models.WordLevel({c: i for i, c in enumerate(vocab.chars)}, unk_token="[UNK]")
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    # transformers leaves the constructor unannotated
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, clean_up_tokenization_spaces=False, model_max_length=max_length
    )


def tokenizer_files(vocab: CharVocab, max_length: int) -> tuple[tuple[str, str], ...]:
    """(file name, text) of each file ``save_pretrained`` writes for the tokenizer of ``vocab``."""
    with tempfile.TemporaryDirectory() as folder:
        char_tokenizer(vocab, max_length).save_pretrained(folder)
        return tuple((p.name, p.read_text(encoding="utf-8")) for p in sorted(Path(folder).iterdir()))
