"""The demo's tokenizer ships as a file beside its weights; training it again gives that file."""

from __future__ import annotations

import json

from hybridkv_cli.models import demo as D


def test_the_shipped_tokenizer_file_loads_with_its_vocabulary():
    data = json.loads(D.DEMO_TOKENIZER.read_text(encoding="utf-8"))
    assert len(data["vocab"]) == 1900 and data["vocab"]["<|endoftext|>"] == 0
    tok = D.build_demo_tokenizer()
    assert len(tok) == 1900 + len(D.DEMO_SPECIAL_TOKENS)
    assert {t: tok.convert_tokens_to_ids(t) for t in data["vocab"]} == data["vocab"]
    assert tok.eos_token == "<|im_end|>"
    assert tok.decode(tok("What colour is the star?")["input_ids"]) == "What colour is the star?"


def test_training_the_tokenizer_again_gives_the_shipped_file():
    from training.demo_tokenizer import train_bpe

    vocab, merges = train_bpe()
    data = json.loads(D.DEMO_TOKENIZER.read_text(encoding="utf-8"))
    assert vocab == data["vocab"] and [list(m) for m in merges] == data["merges"]
