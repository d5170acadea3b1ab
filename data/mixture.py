"""One loader worker's mixture of sources, packed into sequences; its position is its whole state.

Packing. EOS ends every document; a sequence holds T + 1 tokens and shares its first token with the last
one of the sequence before (as data.packing), so every token is a target exactly once.

Weighting (``data.mixture_weighting``), when there are two or more sources:
  * "tokens" (default; what OLMo and Megatron blending do): every sequence comes from one source, packed
    from that source's own documents, so a weight is a share of the tokens. Sequence n goes to the source
    furthest behind its weight: argmax_s w_s * (n + 1) - n_s (n_s: sequences source s has had; ties to the
    first source). Deterministic, within about one sequence per source of the weights at every step; the state
    is n_s plus each source's position and half-packed document. A long document is spread over the
    steps at its source's rate instead of filling them.
  * "documents": draw d picks a source by an RNG seeded from (seed, generation, g, d // 1024); the drawn
    documents are packed one after the other, whatever their source. The state is d.
One source streams the same either way, in the "documents" state format. A state written before weightings
existed has no "weighting": it is document-weighted and its stream stays so (and keeps the format) to the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from data.source_stream import MIX, SourceStream, StreamDoc, rng

if TYPE_CHECKING:
    import datasets

    from data.stream_sources import SourceSpec
    from data.tokenizer import Tokenizer


class StreamSet(Protocol):
    """What the mixers (and data.stream_resume) read of a ``data.streaming.StreamDataset``; a protocol, since
    that module imports this one."""

    tokenizer: Tokenizer | None
    seq_len: int
    seed: int
    window: int
    specs: list[SourceSpec]
    bases: list[datasets.IterableDataset]
    weights: list[float]
    source_names: list[str]


STATE_FORMAT = "stream-v1"
MIX_BLOCK = 1024  # mixture draws generated per RNG
SIZE_ONLY_SEQ_LEN = 2048  # documents() with token weighting and no data.seq_len: sequence length it plans with


class DocumentBatch(NamedTuple):
    tokens: torch.Tensor  # [B, T + 1] int64
    # [B, T + 1] int64: index of each token's document within its sequence (EOS ends its document)
    doc_ids: torch.Tensor


def fresh_state(weighting: str, *, g: int, G: int, seed: int, window: int, sources: list[str]) -> dict:
    """The state of a worker that has taken nothing yet."""
    n = len(sources)
    state = {
        "format": STATE_FORMAT,
        "worker": g,
        "workers": G,
        "seed": seed,
        "window": window,
        "sources": list(sources),
        "weighting": weighting,
        "generation": 0,
        "streams": [SourceStream.fresh_state() for _ in range(n)],
        "tokens": [0] * n,
    }
    if weighting == "tokens":
        state.update(picks=[0] * n, lanes=[None] * n)
    else:
        state.update(draws=0, current=-1, pos=-1, doc_epoch=-1, token_offset=0)
    return state


def weighting_of(state: dict) -> str:
    """A state written before weightings existed was document-weighted."""
    return state.get("weighting", "documents")


def keep_legacy(state: dict, like: dict) -> dict:
    """``state`` without its weighting when ``like`` was written before weightings existed."""
    if "weighting" not in like:
        state.pop("weighting", None)
    return state


def pending(state: dict, src: int) -> tuple[int, int] | None:
    """(stream position, epoch) of source ``src``'s half-packed document in a worker state, if any."""
    if weighting_of(state) == "tokens":
        lane = state["lanes"][src]
        return None if lane is None else (lane[0], lane[1])
    return (state["pos"], state["doc_epoch"]) if state["current"] == src else None


class _Mixer:
    """What both weightings share: the per-source streams, the state header, target-token counts."""

    weighting = ""

    def __init__(self, ds: StreamSet, g: int, G: int, state: dict, *, tokenize: bool):
        self.ds, self.g, self.G = ds, g, G
        tok = ds.tokenizer if tokenize else None
        self.streams = [
            SourceStream(spec, base, seed=ds.seed, window=ds.window, worker=g, workers=G, tokenizer=tok, state=s)
            for spec, base, s in zip(ds.specs, ds.bases, state["streams"])
        ]
        self.weights = np.asarray(ds.weights)
        self.generation, self.counts = state["generation"], list(state["tokens"])
        self._legacy = "weighting" not in state  # written before weightings existed: keep that format

    def _header(self, streams: list[dict]) -> dict:
        header = {
            "format": STATE_FORMAT,
            "worker": self.g,
            "workers": self.G,
            "seed": self.ds.seed,
            "window": self.ds.window,
            "sources": self.ds.source_names,
            "weighting": self.weighting,
            "generation": self.generation,
            "streams": streams,
            "tokens": list(self.counts),
        }
        if self._legacy:
            del header["weighting"]
        return header


class DocumentMixer(_Mixer):
    """Document weighting: sources drawn per document, documents packed back to back.

    ``state()`` is the position before the document being packed (every source's position and the
    draw count), that document's position and token offset (the next sequence's first token)."""

    weighting = "documents"

    def __init__(self, ds: StreamSet, g: int, G: int, state: dict, *, tokenize: bool = True):
        super().__init__(ds, g, G, state, tokenize=tokenize)
        self.draws = state["draws"]
        self._block: tuple[int, np.ndarray] | None = None
        self.current, self.pos, self.doc_epoch, self.offset = -1, -1, -1, 0
        self._before = (self.draws, [s.state() for s in self.streams])
        if state["current"] >= 0:  # re-take the document that was being packed
            self._take()
            self.offset = state["token_offset"]

    def state(self) -> dict:
        draws, streams = self._before
        return self._header(streams) | {
            "draws": draws,
            "current": self.current,
            "pos": self.pos,
            "doc_epoch": self.doc_epoch,
            "token_offset": self.offset,
        }

    def _pick(self, d: int) -> int:
        if len(self.streams) == 1:
            return 0
        block = d // MIX_BLOCK
        if self._block is None or self._block[0] != block:
            draw = rng(self.ds.seed, MIX, self.generation, self.g, block)
            self._block = (block, draw.choice(len(self.streams), size=MIX_BLOCK, p=self.weights))
        return int(self._block[1][d % MIX_BLOCK])

    def _take(self) -> StreamDoc:
        self._before = (self.draws, [s.state() for s in self.streams])
        src = self._pick(self.draws)
        self.draws += 1
        self.pos, doc, self.doc_tokens = self.streams[src].take()
        self.current, self.doc_epoch, self.offset = src, doc.epoch, 0
        return doc

    def documents(self) -> Iterator[StreamDoc]:
        while True:
            yield self._take()

    def sequence(self, T: int) -> tuple[np.ndarray, np.ndarray]:
        """T + 1 tokens and their document indices; the last token opens the next sequence."""
        need = T + 1
        parts: list[np.ndarray] = []
        ids: list[np.ndarray] = []
        while need:
            doc_tokens = self.doc_tokens if self.current >= 0 else None
            if doc_tokens is None or self.offset >= len(doc_tokens):
                self._take()
            assert self.doc_tokens is not None  # packing sequences needs the tokenizer
            piece = self.doc_tokens[self.offset : self.offset + need]
            parts.append(piece)
            ids.append(np.full(len(piece), len(ids), dtype=np.int64))
            # targets only: not the sequence's shared first token
            self.counts[self.current] += len(piece) - (1 if len(ids) == 1 else 0)
            self.offset += len(piece)
            need -= len(piece)
        self.offset -= 1
        return np.concatenate(parts), np.concatenate(ids)


class _Lane:
    """A source's half-packed document under token weighting."""

    __slots__ = ("doc", "epoch", "offset", "pos", "size", "tokens")

    def __init__(self, pos: int, doc: StreamDoc, tokens: np.ndarray | None):
        self.pos, self.doc, self.epoch, self.tokens, self.offset = pos, doc, doc.epoch, tokens, 0
        # without a tokenizer (documents() only) a document's size is its UTF-8 bytes + EOS
        self.size = len(tokens) if tokens is not None else len(doc.text.encode()) + 1


class TokenMixer(_Mixer):
    """Token weighting: each sequence from one source, chosen so every source keeps to its share of tokens.

    ``state()``: sequences per source (the sampler's position), and per source its position before its
    half-packed document, that document's position, epoch and token offset."""

    weighting = "tokens"

    def __init__(self, ds: StreamSet, g: int, G: int, state: dict, *, tokenize: bool = True):
        super().__init__(ds, g, G, state, tokenize=tokenize)
        self.picks = list(state["picks"])
        self.lanes: list[_Lane | None] = [None] * len(self.streams)
        self._before = [s.state() for s in self.streams]
        self.opened: list[StreamDoc] | None = None  # documents() collects the documents packing opens here
        for src, lane in enumerate(state["lanes"]):
            if lane is not None:  # re-take the half-packed document
                self._open(src).offset = lane[2]

    def state(self) -> dict:
        lanes = [None if ln is None else [ln.pos, ln.epoch, ln.offset] for ln in self.lanes]
        return self._header(list(self._before)) | {"picks": list(self.picks), "lanes": lanes}

    def _pick(self) -> int:
        n = sum(self.picks) + 1
        behind = [w * n - k for w, k in zip(self.weights.tolist(), self.picks)]
        return behind.index(max(behind))

    def _open(self, src: int) -> _Lane:
        self._before[src] = self.streams[src].state()
        pos, doc, tokens = self.streams[src].take()
        lane = self.lanes[src] = _Lane(pos, doc, tokens)
        if self.opened is not None:
            self.opened.append(doc)
        return lane

    def sequence(self, T: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """T + 1 tokens of one source and their document indices (None, None without a tokenizer)."""
        src = self._pick()
        self.picks[src] += 1
        need = T + 1
        parts: list[np.ndarray] = []
        ids: list[np.ndarray] = []
        lane = self.lanes[src]
        while need:
            if lane is None or lane.offset >= lane.size:
                lane = self._open(src)
            take = min(need, lane.size - lane.offset)
            if lane.tokens is not None:
                parts.append(lane.tokens[lane.offset : lane.offset + take])
                ids.append(np.full(take, len(ids), dtype=np.int64))
            self.counts[src] += take - (1 if need == T + 1 else 0)  # targets only
            lane.offset += take
            need -= take
        assert lane is not None  # need >= 1: the loop opened one
        lane.offset -= 1
        return (np.concatenate(parts), np.concatenate(ids)) if parts else (None, None)

    def documents(self) -> Iterator[StreamDoc]:
        """The documents in the order packing opens them (sizes from the tokenizer, else UTF-8 bytes)."""
        self.opened = []
        T = self.ds.seq_len or SIZE_ONLY_SEQ_LEN
        while True:
            self.sequence(T)
            yield from self.opened
            self.opened.clear()


def make_mixer(ds: StreamSet, g: int, G: int, state: dict, *, tokenize: bool) -> DocumentMixer | TokenMixer:
    cls = TokenMixer if weighting_of(state) == "tokens" else DocumentMixer
    return cls(ds, g, G, state, tokenize=tokenize)
