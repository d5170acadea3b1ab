"""One generation path for every evaluation and every attention variant: prefill the prompt
into the KV cache, decode greedily (or by sampling), stop at EOS, a stop string or a token budget.

Tasks (lm-eval's ``generate_until``, LongBench, needle / RULER, RAG) see only ``TextGenerator``:
``encode`` / ``decode`` to size and truncate prompts with the model's tokenizer, ``max_context``
(the prompt plus the new tokens must fit it), and ``generate(prompt, max_new_tokens, stop)``.
Tests substitute any object with that surface (a fake model that returns the gold answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from data.tokenizer import Tokenizer
    from model.transformer import Transformer


class Generator(Protocol):
    """What the generation tasks use of ``TextGenerator`` (tests pass fakes with this surface)."""

    max_context: int

    def encode(self, text: str) -> list[int]: ...

    def generate(
        self, prompt: str | list[int], max_new_tokens: int, *, stop: Sequence[str] = (), temperature: float = 0.0
    ) -> str: ...


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first occurrence of any stop string, and whether one occurred."""
    cuts = [i for s in stop if s and (i := text.find(s)) >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


class TextGenerator:
    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        device: torch.device | str = "cpu",
        max_context: int | None = None,
    ):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.max_context = max_context or model.cfg.max_seq_len

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @torch.no_grad()
    def generate_ids(
        self,
        ids: Sequence[int],
        max_new_tokens: int,
        *,
        stop: Sequence[str] = (),
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
    ) -> list[int]:
        """New token ids after ``ids`` (left-truncated to fit ``max_context`` with the new tokens)."""
        if max_new_tokens < 1:
            return []
        budget = max(1, self.max_context - max_new_tokens)
        ids = list(ids)[-budget:] or [self.tokenizer.eos_id]
        gen = torch.Generator(device=self.device).manual_seed(seed) if temperature > 0 else None
        check = (lambda new: cut_at_stop(self.decode(new[0].tolist()), stop)[1]) if stop else None
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(
                torch.tensor([ids], device=self.device),
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                eos_id=self.tokenizer.eos_id,
                generator=gen,
                stop=check,
                vocab_size=self.tokenizer.vocab_size,
            )
        finally:
            self.model.train(was_training)
        assert isinstance(out, torch.Tensor)  # tokens only: return_logits is off
        new = out[0, len(ids) :].tolist()
        eos = self.tokenizer.eos_id
        return new[: new.index(eos)] if eos in new else new

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int,
        *,
        stop: Sequence[str] = (),
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
    ) -> str:
        """The continuation of ``prompt`` as text, cut before the first stop string."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        text = self.decode(
            self.generate_ids(ids, max_new_tokens, stop=stop, temperature=temperature, top_k=top_k, seed=seed)
        )
        return cut_at_stop(text, stop)[0]
