"""``data.tokenizer`` as a Hugging Face tokenizer folder (what ``AutoTokenizer.from_pretrained`` reads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.errors import ConfigError
from data.config import DataConfig
from data.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

TEXT = "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate: 1609.\n"


def _bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT] * 8, trainer)
    return tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """tokenizer.json + a tokenizer_config.json whose end of sequence is not the usual first candidate."""
    out = tmp_path_factory.mktemp("tok")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_bpe(), eos_token="<|im_end|>")
    fast.save_pretrained(out)
    return out


def test_folder_loads_its_tokenizer_json_with_the_declared_specials(folder, tmp_path):
    tok = load_tokenizer(folder)
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == tok.tok.token_to_id("<|im_end|>") != tok.tok.token_to_id("<|endoftext|>")
    by_file = load_tokenizer(folder / "tokenizer.json")  # the same file beside its config: the same tokenizer
    assert (by_file.fingerprint, by_file.eos_id) == (tok.fingerprint, tok.eos_id)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.encode(TEXT) == hf.encode(TEXT, add_special_tokens=False) and tok.decode(tok.encode(TEXT)) == TEXT
    saved = tok.save(tmp_path / "ckpt")
    assert saved.name == "tokenizer.json" and (tmp_path / "ckpt" / "tokenizer_config.json").is_file()
    assert load_tokenizer(tmp_path / "ckpt").eos_id == tok.eos_id
    DataConfig(tokenizer=str(folder)).validate()


def test_folder_with_sentencepiece_or_slow_files_only(tmp_path):
    from data.tokenizer import train_sentencepiece

    sp_dir = tmp_path / "sp"
    sp_dir.mkdir()
    train_sentencepiece([TEXT * 50], vocab_size=300, out_path=sp_dir / "tokenizer.model")
    assert isinstance(load_tokenizer(sp_dir), SentencePieceTokenizer)

    slow = tmp_path / "slow"  # GPT-2's slow format: vocab.json + merges.txt, converted by transformers
    slow.mkdir()
    bpe = _bpe()
    bpe.model.save(str(slow))
    (slow / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"})
    )
    tok = load_tokenizer(slow)
    assert isinstance(tok, HFTokenizer) and tok.eos_id == bpe.token_to_id("<|endoftext|>")
    assert tok.encode(TEXT) == bpe.encode(TEXT, add_special_tokens=False).ids
    tok.save(tmp_path / "ckpt")
    assert load_tokenizer(tmp_path / "ckpt" / "tokenizer.json").fingerprint == tok.fingerprint


def test_an_empty_folder_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_tokenizer(tmp_path)
    message = str(err.value)
    assert "\n" not in message and "holds no tokenizer.json, tokenizer.model or .tiktoken file" in message, message
    with pytest.raises(ConfigError, match="no such file"):
        DataConfig(tokenizer=str(tmp_path / "missing")).validate()


def test_an_export_carries_no_auto_map_and_its_tokenizer_loads_without_a_prompt(folder, tmp_path, monkeypatch):
    """Issue 41: the README's ``AutoTokenizer.from_pretrained(export)`` asks nothing (transformers would ask
    "Do you wish to run the custom code? [y/N]" through ``input``), and no tokenizer file of the checkpoint or the
    export names custom code. (A folder that names it is refused: tests/pretrain/test_sizes_and_inputs.py.)"""
    import builtins

    from pretrain.export import export_hf
    from tests.interop.conftest import SMALL, our_checkpoint

    checkpoint = our_checkpoint(tmp_path / "run", SMALL, folder)
    out = export_hf(checkpoint, tmp_path / "hf", log=lambda line: None)
    for directory in (checkpoint, out):
        for file in directory.glob("*.json"):
            if file.name != "config.json" or directory == out:
                assert "auto_map" not in json.loads(file.read_text()), file
    asked: list[str] = []

    def no_prompt(prompt: str = "") -> str:
        asked.append(prompt)
        raise EOFError

    monkeypatch.setattr(builtins, "input", no_prompt)
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert asked == [] and hf.encode(TEXT, add_special_tokens=False) == load_tokenizer(folder).encode(TEXT)
