"""Our tokenizers as Hugging Face tokenizer folders (``AutoTokenizer.from_pretrained`` loads them offline).

- ``tokenizer.json`` (with its folder's ``tokenizer_config.json`` when it came from one): copied; a
  ``tokenizer_config.json`` naming the end/beginning-of-sequence tokens is written when there is none.
- SentencePiece ``tokenizer.model``: converted by ``transformers``' own SentencePiece converter
  (``LlamaTokenizer``: byte fallback, no normalisation, a prefix space only if the model adds one), then
  written as ``tokenizer.json`` + ``tokenizer_config.json`` beside a copy of ``tokenizer.model``. Our
  user-defined pieces (the newline) stay ordinary tokens, not special ones.
- tiktoken ranks files are not converted.

No BOS or EOS is added on encode, as in our training data. ``check_hf_tokenizer`` encodes and decodes a
sample with both tokenizers and names the first difference.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from core.errors import ConfigError
from data.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer

SAMPLE = (
    "ROMEO. But soft, what light through yonder window breaks?\n\n"
    "  Two spaces,\tone tab,   three spaces; digits 0123456789 and 3.14159.\n"
    "Caf\u00e9 na\u00efve \u00fcber \u2014 \u201cquotes\u201d \u2018single\u2019 \u2026 \u00a9 \u20ac5\n"
    "\u4e2d\u6587 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4 \u0420\u0443\u0441\u0441\u043a\u0438\u0439 "
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \U0001f600\U0001f680\n"
    " leading space, trailing space \n\n\nend"
)


def _piece(tok: Tokenizer, token_id: int | None) -> str | None:
    if token_id is None:
        return None
    if isinstance(tok, SentencePieceTokenizer):
        return tok.sp.id_to_piece(token_id)
    if isinstance(tok, HFTokenizer):
        return tok.tok.id_to_token(token_id)
    return None


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_hf_tokenizer(tok: Tokenizer, out: Path, *, model_max_length: int) -> list[str]:
    """Write ``tok`` into folder ``out`` as files AutoTokenizer loads; returns the file names written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tok, SentencePieceTokenizer):
        return _from_sentencepiece(tok, out, model_max_length)
    if isinstance(tok, HFTokenizer):
        written = [tok.save(out).name, *(c.name for c in tok.companions)]
        if "tokenizer_config.json" not in written:
            config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": _piece(tok, tok.eos_id),
                "bos_token": _piece(tok, tok.eos_id),  # the token a text starts from here: EOS
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": model_max_length,
            }
            _write_json(out / "tokenizer_config.json", {k: v for k, v in config.items() if v is not None})
            written.append("tokenizer_config.json")
        return written
    raise ConfigError(
        f"tokenizer: {tok.file_name} ({type(tok).__name__}) has no Hugging Face tokenizer export "
        "(SentencePiece .model and tokenizer.json do)"
    )


def _from_sentencepiece(tok: SentencePieceTokenizer, out: Path, model_max_length: int) -> list[str]:
    # protobuf-generated: the stubs do not declare its message classes
    from sentencepiece.sentencepiece_model_pb2 import ModelProto  # type: ignore[attr-defined]
    from transformers import AutoTokenizer

    proto = ModelProto()
    proto.ParseFromString(tok.path.read_bytes())
    unk = tok.sp.unk_id()
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_prefix_space": bool(proto.normalizer_spec.add_dummy_prefix),
        "add_bos_token": False,
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "eos_token": _piece(tok, tok.eos_id),
        "bos_token": _piece(tok, tok.eos_id),  # the token a text starts from here: EOS
        "unk_token": _piece(tok, unk) if unk >= 0 else None,
        "model_max_length": model_max_length,
    }
    config = {k: v for k, v in config.items() if v is not None}
    with tempfile.TemporaryDirectory(prefix="sp_to_hf_") as tmp:
        shutil.copyfile(tok.path, Path(tmp) / "tokenizer.model")
        _write_json(Path(tmp) / "tokenizer_config.json", config)
        fast = AutoTokenizer.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
        fast.save_pretrained(str(out))
    # transformers lists SentencePiece's user-defined pieces ("\n") among the special tokens; they are text
    user_defined = {p.piece for p in proto.pieces if p.type == ModelProto.SentencePiece.USER_DEFINED}
    saved = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key in ("extra_special_tokens", "additional_special_tokens"):
        if isinstance(saved.get(key), list):
            saved[key] = [t for t in saved[key] if _token_text(t) not in user_defined]
    for key in ("is_local", "local_files_only", "name_or_path"):
        saved.pop(key, None)
    _write_json(out / "tokenizer_config.json", saved)
    shutil.copyfile(tok.path, out / "tokenizer.model")
    return sorted(p.name for p in out.iterdir() if p.name.startswith(("tokenizer", "special_tokens")))


def _token_text(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def check_hf_tokenizer(tok: Tokenizer, folder: Path, texts: tuple[str, ...] = (SAMPLE,)) -> str | None:
    """None when AutoTokenizer on ``folder`` encodes and decodes ``texts`` as ``tok`` does, else the first
    difference in one line."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    for text in texts:
        ours, theirs = tok.encode(text), hf.encode(text, add_special_tokens=False, verbose=False)
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            return f"token {at} of {text[:40]!r}...: ours {ours[at : at + 3]}, transformers {theirs[at : at + 3]}"
        if hf.decode(ours) != tok.decode(ours):
            return f"decoding {text[:40]!r}...: transformers gives {hf.decode(ours)[:60]!r}"
    if hf.eos_token_id != tok.eos_id:
        return f"eos id: ours {tok.eos_id}, transformers {hf.eos_token_id}"
    return None
