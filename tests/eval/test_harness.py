"""eval/harness.py: FocusedLM's scores against hand computations from the model's logits, rolling
windows that score every token once, generate_until's stops and budgets, offline lm_eval runs on
the local task files, and one-line ConfigErrors for bad input."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval")

from core.errors import ConfigError
from eval.harness import (
    SOURCES,
    TASKS,
    FocusedLM,
    evaluate,
    flatten_for_metrics,
    render_tasks,
)
from model.config import ModelConfig
from model.transformer import build_model

MAX_LEN = 16


class CharTokenizer:
    """One token per character; id 0 is EOS, so every token is easy to name in a test."""

    alphabet = "abcdefghijklmnopqrstuvwxyz .,"
    eos_id, bos_id = 0, None
    vocab_size = len(alphabet) + 1

    def encode(self, text: str) -> list[int]:
        return [self.alphabet.index(c) + 1 for c in text]

    def decode(self, ids) -> str:
        return "".join(self.alphabet[i - 1] for i in ids if i > 0)


def tiny_model(vocab: int = CharTokenizer.vocab_size, max_seq_len: int = MAX_LEN, dtype=torch.float64):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, max_seq_len=max_seq_len)
    return build_model(cfg).to(dtype).eval()


def hand_score(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """One unpadded forward of the request: sum of the continuation's log-probs, greedy or not."""
    full = (context + continuation)[-(MAX_LEN + 1) :]
    with torch.no_grad():
        logits = model(torch.tensor([full[:-1]])).logits[0]
    logprobs = torch.log_softmax(logits, dim=-1)[-len(continuation) :]
    target = torch.tensor(continuation)
    return float(logprobs[torch.arange(len(target)), target].sum()), bool((logprobs.argmax(-1) == target).all())


def greedy_tokens(model, context: list[int], n: int) -> list[int]:
    ids = list(context)
    for _ in range(n):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(context) :]


def test_loglikelihood_tokens_match_hand_computation_in_request_order():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)

    def rand(n):
        return torch.randint(1, CharTokenizer.vocab_size, (n,), generator=g).tolist()

    ctx = rand(4)
    requests = [
        (("r0", ""), rand(3), rand(1)),
        (("r1", ""), rand(5), rand(4)),
        (("r2", ""), rand(10), rand(2)),
        (("r3", ""), rand(20), rand(5)),
        (("r4", ""), rand(1), rand(1)),
        (("r5", ""), rand(2), rand(7)),
        (("r6", ""), ctx, greedy_tokens(model, ctx, 3)),
    ]
    expected = [hand_score(model, c, x) for _, c, x in requests]
    for batch_size in (1, 3):
        got = FocusedLM(model, CharTokenizer(), batch_size=batch_size)._loglikelihood_tokens(
            requests, disable_tqdm=True
        )
        assert [g_ for _, g_ in got] == [e for _, e in expected]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in expected], rel=1e-10, abs=1e-10)
    assert expected[6][1] and not all(greedy for _, greedy in expected)
    # r3 does not fit: its context is cut from the left so that context + continuation = max_length + 1.
    _, c3, x3 = requests[3]
    assert got[3][0] == pytest.approx(hand_score(model, c3[-(MAX_LEN + 1 - len(x3)) :], x3)[0], rel=1e-10)


def test_loglikelihood_text_api_splits_context_and_continuation_tokens():
    model = tiny_model()
    lm = FocusedLM(model, CharTokenizer(), batch_size=2)
    reqs = [SimpleNamespace(args=("the cat", " sat")), SimpleNamespace(args=("a", "b.c"))]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    tok = CharTokenizer()
    assert got[0][0] == pytest.approx(hand_score(model, tok.encode("the cat"), tok.encode(" sat"))[0], rel=1e-10)
    assert got[1][0] == pytest.approx(hand_score(model, tok.encode("a"), tok.encode("b.c"))[0], rel=1e-10)


def hand_rolling(model, tokens: list[int], eos: int) -> tuple[float, int]:
    """Chunks of max_length predictions; each chunk sees the max_length tokens before its end
    (EOS first), so the last chunk keeps a full context. Returns (sum of log-probs, tokens scored)."""
    seq = [eos] + tokens  # seq[i] predicts tokens[i]
    total, scored = 0.0, 0
    for start in range(0, len(tokens), MAX_LEN):
        end = min(len(tokens), start + MAX_LEN)
        inputs = seq[max(0, end - MAX_LEN) : end]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([inputs])).logits[0], dim=-1)
        n = end - start
        target = torch.tensor(tokens[start:end])
        total += float(logprobs[-n:][torch.arange(n), target].sum())
        scored += n
    return total, scored


def test_loglikelihood_rolling_scores_every_token_once():
    model = tiny_model()
    tok = CharTokenizer()
    lm = FocusedLM(model, tok, batch_size=3)
    long_text = "the quick brown fox jumps over the lazy dog, twice."  # 51 tokens > max_length 16
    short_text = "a dog."
    windows = []
    inner = lm._loglikelihood_tokens
    lm._loglikelihood_tokens = lambda reqs, **kw: (windows.extend(reqs), inner(reqs, **kw))[1]
    got = lm.loglikelihood_rolling(
        [SimpleNamespace(args=(long_text,)), SimpleNamespace(args=(short_text,))], disable_tqdm=True
    )

    expected_long, scored = hand_rolling(model, tok.encode(long_text), tok.eos_id)
    assert scored == len(tok.encode(long_text)) == 51
    assert got[0] == pytest.approx(expected_long, rel=1e-10)
    assert got[1] == pytest.approx(hand_rolling(model, tok.encode(short_text), tok.eos_id)[0], rel=1e-10)
    # Every token predicted exactly once, no window wider than the model's context.
    assert sum(len(pred) for _, _, pred in windows) == len(tok.encode(long_text)) + len(tok.encode(short_text))
    assert all(len(ctx) + len(pred) <= MAX_LEN + 1 for _, ctx, pred in windows)
    assert windows[0][1][0] == tok.eos_id


class CountingModel(torch.nn.Module):
    """Stands in for a greedy model: always emits the character after the last one."""

    def __init__(self, max_seq_len: int = MAX_LEN):
        super().__init__()
        self.cfg = SimpleNamespace(max_seq_len=max_seq_len)
        self.prompts: list[list[int]] = []
        self.emitted: list[int] = []

    def generate(self, idx, max_new_tokens, *, stop=None, **_):
        self.prompts.append(idx[0].tolist())
        last, new = int(idx[0, -1]), []
        for _ in range(max_new_tokens):
            last = last % (CharTokenizer.vocab_size - 1) + 1  # never EOS
            new.append(last)
            if stop is not None and stop(torch.tensor([new])):
                break
        self.emitted.append(len(new))
        return torch.cat([idx, torch.tensor([new])], dim=1)


def test_generate_until_stops_at_stop_strings_and_respects_max_gen_toks():
    model = CountingModel()
    lm = FocusedLM(model, CharTokenizer())
    reqs = [
        ("abc", {"until": ["g", "x"], "max_gen_toks": 10}),
        ("abc", {"until": [], "max_gen_toks": 3}),
        ("abc", {"until": "e", "max_gen_toks": 10}),
        ("abcdefghijklmnopqrstuvwxyz", {"until": ["\n\n"], "max_gen_toks": 4}),
    ]
    out = lm.generate_until([SimpleNamespace(args=a) for a in reqs], disable_tqdm=True)
    assert out == ["def", "def", "d", " .,a"]
    assert model.emitted == [4, 3, 2, 4]  # decoding ended at the stop string, not at the budget
    # The long prompt is left-truncated so that prompt + max_gen_toks fits max_length.
    assert model.prompts[3] == CharTokenizer().encode("abcdefghijklmnopqrstuvwxyz")[-(MAX_LEN - 4) :]


def test_generate_until_with_the_real_model_keeps_its_budget():
    lm = FocusedLM(tiny_model(dtype=torch.float32), CharTokenizer())
    out = lm.generate_until(
        [SimpleNamespace(args=("the cat", {"until": ["."], "max_gen_toks": 5}))] * 2, disable_tqdm=True
    )
    assert len(out) == 2 and out[0] == out[1]
    assert len(out[0]) <= 5 and "." not in out[0]


def test_registered_and_data_parallel_settings():
    from lm_eval.api.registry import get_model

    assert get_model("focused") is FocusedLM
    lm = FocusedLM(tiny_model(), CharTokenizer(), rank=1, world_size=2)
    assert (lm.rank, lm.world_size) == (0, 1)  # lm_eval never splits requests: every rank runs them all
    assert not lm.reports and FocusedLM(tiny_model(), CharTokenizer()).reports


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda d: render_tasks(d, ["piqa"]), ["piqa", "piqa/plain_text/validation"]),
        (lambda d: render_tasks(d, ["hellaswag"]), ["hellaswag", "hellaswag_val_full.jsonl.gz"]),
        (lambda d: render_tasks(d, ["squad"]), ["tasks", "squad", "hellaswag"]),
        (lambda d: render_tasks(d / "nowhere", ["piqa"]), ["data_dir", "nowhere"]),
        (lambda d: FocusedLM.create_from_arg_string("device=cpu"), ["checkpoint=DIR", "run=DIR"]),
        (lambda d: FocusedLM.create_from_arg_string("checkpoint=/x,colour=red"), ["colour", "allowed"]),
        (lambda d: FocusedLM(tiny_model(), CharTokenizer(), batch_size=0), ["batch_size", ">= 1"]),
    ],
)
def test_bad_input_is_a_one_line_config_error(tmp_path, call, words):
    with pytest.raises(ConfigError) as err:
        call(tmp_path)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_missing_data_file_stops_evaluate_before_lm_eval_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("FOCUSED_PRETRAIN_EVAL_DATA", raising=False)
    lm = FocusedLM(tiny_model(), CharTokenizer())
    with pytest.raises(ConfigError, match=r"^data_dir: not given"):
        evaluate(lm, ["piqa"], limit=1)
    (tmp_path / "lambada_openai").mkdir()
    (tmp_path / "lambada_openai" / "lambada_test.jsonl").write_text('{"text": "a b"}\n')
    with pytest.raises(
        ConfigError, match=r"^data_dir: task 'wikitext' needs <data_dir>/wikitext2_raw_test/wiki.test.raw$"
    ):
        evaluate(lm, ["lambada_openai", "wikitext"], limit=1, data_dir=tmp_path)


# ---- against the shared offline data ----------------------------------------------------------

EXPECTED = {
    "hellaswag": {"acc", "acc_norm"},
    "arc_easy": {"acc", "acc_norm"},
    "arc_challenge": {"acc", "acc_norm"},
    "piqa": {"acc", "acc_norm"},
    "winogrande": {"acc"},
    "boolq": {"acc"},
    "social_iqa": {"acc"},
    "lambada_openai": {"perplexity", "acc"},
    "wikitext": {"word_perplexity", "byte_perplexity", "bits_per_byte"},
}


@pytest.fixture(scope="module")
def gpt2_lm(shared_data):
    from data.tokenizer import load_tokenizer

    tok = load_tokenizer(shared_data / "gpt2_bpe" / "gpt2_tokenizer.json")
    return FocusedLM(tiny_model(vocab=tok.vocab_size, max_seq_len=128, dtype=torch.float32), tok, batch_size=8)


def test_model_args_load_a_checkpoint_with_its_tokenizer(shared_data, tmp_path):
    import shutil

    from lm_eval.api.registry import get_model
    from safetensors.torch import save_model

    from pretrain.checkpoint import MODEL_FILE, save_checkpoint
    from run.config import run_config_from_dict

    # A preset: a config saved with preset = "" does not load back (model.preset must name one).
    cfg = run_config_from_dict(
        {
            "model": {
                "preset": "tiny",
                "vocab_size": 50257,
                "d_model": 32,
                "n_layers": 2,
                "n_heads": 2,
                "max_seq_len": 32,
            }
        }
    )
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()

    def write(directory):
        save_model(model, str(directory / MODEL_FILE))
        shutil.copyfile(shared_data / "gpt2_bpe" / "gpt2_tokenizer.json", directory / "tokenizer.json")

    path = save_checkpoint(
        tmp_path, 7, write_engine_state=write, trainer_state={"step": 7, "config": cfg.to_toml()}, keep=0
    )
    by_run = get_model("focused").create_from_arg_string(f"run={tmp_path},device=cpu,batch_size=2")
    by_dir = FocusedLM.create_from_arg_string(f"checkpoint={path}", {"device": "cpu", "batch_size": None})
    assert (by_run.batch_size, by_run.max_length, by_run.eot_token_id, by_dir.batch_size) == (2, 32, 50256, 8)
    context, continuation = by_run.tok_encode("Hello"), by_run.tok_encode(" world")
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([context])).logits[0, -1], -1)[continuation[0]]
    got = by_run._loglikelihood_tokens([(None, context, continuation)], disable_tqdm=True)[0][0]
    assert got == pytest.approx(float(expected), rel=1e-5)


def test_evaluate_offline_on_every_task(gpt2_lm, shared_data, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("FOCUSED_PRETRAIN_EVAL_DATA", str(shared_data))  # the default data dir
    assert set(EXPECTED) == set(TASKS)
    results = evaluate(gpt2_lm, ["hellaswag", "arc_easy", "lambada_openai"], limit=5)
    results |= evaluate(gpt2_lm, ["wikitext"], limit=2)
    results |= evaluate(gpt2_lm, ["boolq", "piqa", "winogrande", "social_iqa", "arc_challenge"], limit=3)
    assert {task: set(metrics) for task, metrics in results.items()} == EXPECTED
    flat = flatten_for_metrics(results)
    assert len(flat) == sum(map(len, EXPECTED.values())) and "eval/wikitext/bits_per_byte" in flat
    assert all(math.isfinite(v) for v in flat.values()), flat
    for task in ("hellaswag", "arc_easy", "piqa", "boolq"):
        assert 0.0 <= results[task]["acc"] <= 1.0
    assert results["lambada_openai"]["perplexity"] > 1.0


def test_local_documents_match_lm_eval_formats(shared_data, tmp_path):
    """The documents lm_eval builds from the local files: full split sizes and the built-in prompts."""
    from lm_eval.tasks import TaskManager

    from eval.harness import LM_EVAL_PREFIX

    include = render_tasks(shared_data, ["hellaswag", "arc_easy", "winogrande", "boolq", "wikitext"], out_dir=tmp_path)
    tasks = TaskManager(include_path=str(include), include_defaults=False).load(
        [LM_EVAL_PREFIX + t for t in ("hellaswag", "arc_easy", "winogrande", "boolq", "wikitext")]
    )["tasks"]
    hella, arc, wino, boolq, wiki = (
        tasks[LM_EVAL_PREFIX + t] for t in ("hellaswag", "arc_easy", "winogrande", "boolq", "wikitext")
    )
    doc = hella.eval_docs[1]
    # lm_eval capitalises ctx_b ("the lady" -> "The lady"); the klosax file keeps the source's case.
    assert (
        hella.doc_to_text(doc)
        == "Clean and jerk: A lady walks to a barbell. She bends down and grabs the pole. The lady"
    )
    assert (hella.doc_to_target(doc), len(hella.eval_docs)) == (3, 10042)
    doc = arc.eval_docs[0]
    assert (
        arc.doc_to_text(doc)
        == "Question: Which statement best explains why photosynthesis is the foundation of most food webs?\nAnswer:"
    )
    assert (arc.doc_to_target(doc), len(arc.eval_docs)) == (0, 2376)  # lm_eval scores ARC's test split
    doc = wino.eval_docs[0]
    assert wino.doc_to_text(doc) == 1 and wino.doc_to_choice(doc)[1].endswith("so Maria")
    assert boolq.doc_to_target(boolq.eval_docs[0]) == 0 and boolq.doc_to_text(boolq.eval_docs[0]).endswith("?\nAnswer:")
    pages = wiki.eval_docs["page"]
    # WikiText-2 test: 62 articles; 245,569 tokens counting one end-of-line per line (4,358 lines),
    # so 241,211 words, plus the empty string at each end of every page that lm_eval's split counts.
    assert len(pages) == 62 and pages[0].startswith(" = Robert Boulter = \n \n Robert Boulter is")
    assert sum(len(page.split()) for page in pages) == 241_211
    assert sorted(SOURCES) == sorted(TASKS)
