"""A document (id + normalised text) and the text normalisation every source applies."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import ConfigError


@dataclass(frozen=True)
class Document:
    id: str
    text: str


def normalise_text(raw: bytes | str, *, where: str = "") -> str:
    """UTF-8 (BOM stripped) with LF line endings."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"data.path: {where or 'a document'} is not UTF-8 text (invalid byte at offset {exc.start})"
            ) from None
    else:
        text = raw.removeprefix("\ufeff")
    return text.replace("\r\n", "\n").replace("\r", "\n")
