"""IncrementalDetokenizer on the default model's real tokenizer (byte-level BPE)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from serving.engine.sampling.detokenizer import IncrementalDetokenizer

REPLACEMENT_CHAR = "\ufffd"
IM_START, IM_END = 1, 2  # <|im_start|>, <|im_end|> of SmolLM2

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 42, isn't it?",
    "code": "def f(x):\n\tif x:\n\t\treturn x  # ok\n\n    y = {'a': [1, 2]}\r\n",
    "emoji": "Hi 👋 there 😀😃",
    "emoji_zwj": "family 👨‍👩‍👧‍👦 and coder 👩‍💻 and 🏳️‍🌈",
    "flags": "🇯🇵🇫🇷🇩🇪 flags",
    "cjk": "日本語のテキストと中文文本，还有한국어",
    "accented": "naïve façade résumé Ångström crème brûlée",
    "mixed": "Price: 5€ → ≈ ¥700 ✓ 日本 🎉 done.\n  — end",
    "spaces": "  leading   and trailing   \n\n",
}




@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A tiny Llama-2-style tokenizer: Metaspace pieces plus SentencePiece byte fallback, so
    every character outside its 100-piece vocabulary becomes a run of `<0xXX>` tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def stream(tokenizer, ids, *, skip_special_tokens=True, chunk_sizes=None):
    """Feed `ids` to a fresh detokenizer; return (per-step deltas, flush text, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = []
    i = 0
    while i < len(ids):
        size = 1 if chunk_sizes is None else chunk_sizes[len(deltas) % len(chunk_sizes)]
        deltas.append(detok.step(ids[i : i + size]))
        i += size
    return deltas, detok.flush(), detok


def test_exact_deltas_hold_back_split_emoji(tokenizer):
    ids = tokenizer.encode("Hi 👋 there")
    assert ids == [26843, 15107, 235, 229, 665]  # "👋" is 4 bytes over 3 tokens
    deltas, tail, detok = stream(tokenizer, ids)
    assert deltas == ["Hi", " ", "", "👋", " there"]
    assert tail == ""
    assert detok.text == "Hi 👋 there"


def test_exact_deltas_cjk(tokenizer):
    ids = tokenizer.encode("日本")
    assert ids == [23274, 115, 40993]
    deltas, tail, _ = stream(tokenizer, ids)
    assert deltas == ["", "日", "本"]
    assert tail == ""


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_one_token_at_a_time_matches_decode_and_never_emits_fffd(tokenizer, name):
    text = TEXTS[name]
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text  # sanity: the text round-trips
    detok = IncrementalDetokenizer(tokenizer)
    for k in range(1, len(ids) + 1):
        delta = detok.step([ids[k - 1]])
        assert REPLACEMENT_CHAR not in delta
        # Tight lag: everything is out except an unfinished character's trailing U+FFFD.
        assert detok.text == tokenizer.decode(ids[:k]).rstrip(REPLACEMENT_CHAR)
    assert detok.flush() == ""
    assert detok.text == text


@pytest.mark.parametrize("chunk_sizes", [[2], [3], [1, 4, 2], [7]])
@pytest.mark.parametrize("name", ["emoji_zwj", "cjk", "mixed", "code"])
def test_multi_token_steps_match_decode(tokenizer, name, chunk_sizes):
    ids = tokenizer.encode(TEXTS[name])
    deltas, tail, detok = stream(tokenizer, ids, chunk_sizes=chunk_sizes)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) + tail == TEXTS[name]
    assert detok.text == TEXTS[name]


def test_output_starting_mid_word_after_prompt(tokenizer):
    ids = tokenizer.encode("Detokenization is unbelievably tricky")
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "Det", "oken", "ization", "Ġis", "Ġunbelie", "v", "ably", "Ġtricky",
    ]  # fmt: skip
    for split in (1, 2, 5, 6):  # the output starts inside a word
        output = ids[split:]
        deltas, tail, _ = stream(tokenizer, output)
        assert "".join(deltas) + tail == tokenizer.decode(output)
    deltas, tail, _ = stream(tokenizer, ids[5:])
    assert deltas == ["v", "ably", " tricky"]


def test_output_starting_inside_a_character_after_prompt(tokenizer):
    ids = tokenizer.encode("Hi 👋 there")
    output = ids[3:]  # the prompt before it holds the emoji's first 3 bytes
    deltas, tail, _ = stream(tokenizer, output)
    assert "".join(deltas) + tail == tokenizer.decode(output)
    # A lone continuation byte is held (it ends in U+FFFD) until the next token shows it final.
    assert deltas == ["", REPLACEMENT_CHAR + " there"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_skipped_or_kept(tokenizer, skip_special_tokens):
    ids = (
        [IM_START]
        + tokenizer.encode("assistant\nHello 👋")
        + [IM_END]
        + tokenizer.encode("\n日本")
        + [IM_END, IM_END]
    )
    deltas, tail, _ = stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + tail == expected
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    if skip_special_tokens:
        assert expected == "assistant\nHello 👋\n日本"
    else:
        assert expected == "<|im_start|>assistant\nHello 👋<|im_end|>\n日本<|im_end|><|im_end|>"


def test_special_token_inside_split_character(tokenizer):
    # A special token between the bytes of one emoji: skipping it joins the bytes back.
    ids = tokenizer.encode("👋")
    assert len(ids) == 3
    ids = ids[:1] + [IM_END] + ids[1:]
    for skip in (True, False):
        deltas, tail, _ = stream(tokenizer, ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "👋"


def test_unfinished_character_is_released_by_flush(tokenizer):
    ids = tokenizer.encode("ok 👋")[:-1]  # the emoji's last byte never comes
    deltas, tail, detok = stream(tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert deltas[-2:] == [" ", ""]  # the space before the unfinished emoji is not held
    assert "".join(deltas) == "ok "
    assert tail == REPLACEMENT_CHAR
    assert detok.text == tokenizer.decode(ids) == "ok " + REPLACEMENT_CHAR


def test_literal_replacement_char_in_text_is_kept(tokenizer):
    text = "a\ufffdb \ufffd"
    ids = tokenizer.encode(text)
    deltas, tail, _ = stream(tokenizer, ids)
    assert "".join(deltas) + tail == text


def test_window_stays_bounded_on_long_output(tokenizer):
    ids = tokenizer.encode(" ".join(TEXTS.values()) * 20)
    assert len(ids) > 2000
    detok = IncrementalDetokenizer(tokenizer)
    max_window = 0
    for token_id in ids:
        detok.step([token_id])
        max_window = max(max_window, detok.num_window_tokens)
    detok.flush()
    assert detok.text == tokenizer.decode(ids)
    # The longest run of tokens without a complete character here is a ZWJ emoji's bytes.
    assert max_window <= 8


def test_step_after_flush_raises(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    detok.step(tokenizer.encode("hi"))
    assert detok.flush() == ""
    assert detok.flush() == ""
    with pytest.raises(RuntimeError, match="after flush"):
        detok.step([42])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fuzz_random_ids_concatenation_equals_decode(tokenizer, seed, skip_special_tokens):
    rng = random.Random(seed)
    vocab_size = len(tokenizer)
    # Mix in raw byte tokens (ids < ~260 are single bytes) so split characters are common.
    ids = [
        rng.randrange(3, 260) if rng.random() < 0.5 else rng.randrange(vocab_size)
        for _ in range(300)
    ]
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    for k, token_id in enumerate(ids, start=1):
        detok.step([token_id])
        # Nothing emitted is ever taken back: it is a prefix of every later decode.
        assert tokenizer.decode(ids[:k], skip_special_tokens=skip_special_tokens).startswith(
            detok.text
        )
    tail = detok.flush()
    assert detok.text == full
    assert REPLACEMENT_CHAR in full  # the fuzz does exercise invalid bytes
    assert REPLACEMENT_CHAR not in tail or full.endswith(tail)


@pytest.mark.parametrize("seed", [3, 4])
def test_fuzz_random_ids_every_prefix_flushes_to_its_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(3, 260) if rng.random() < 0.7 else rng.randrange(3, 50_000 - 1)
           for _ in range(60)]  # fmt: skip
    ids = [i % len(tokenizer) for i in ids]
    for k in range(len(ids) + 1):
        deltas, tail, _ = stream(tokenizer, ids[:k], chunk_sizes=[1, 2])
        assert "".join(deltas) + tail == tokenizer.decode(ids[:k], skip_special_tokens=True)


def test_byte_fallback_run_is_held_until_a_non_byte_token(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    ids = tok.encode("日本 x", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == [
        "▁", "<0xE6>", "<0x97>", "<0xA5>", "<0xE6>", "<0x9C>", "<0xAC>", "▁", "x",
    ]  # fmt: skip
    deltas, tail, _ = stream(tok, ids)
    # A later invalid byte would turn the whole run into U+FFFD, "日" included, so the run
    # only comes out once "▁" closes it.
    assert deltas == ["", "", "", "", "", "", "", "日本 ", "x"]
    assert tail == ""


def test_byte_fallback_cut_inside_a_character_matches_decode(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    ids = tok.encode("ok 日本", add_special_tokens=False)[:-1]  # "本" loses its last byte
    deltas, tail, _ = stream(tok, ids)
    assert "".join(deltas) == "ok "
    assert tail == REPLACEMENT_CHAR * 5  # one per byte of the broken run, 日's bytes too
    assert tok.decode(ids) == "ok " + tail


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_byte_fallback_texts_match_decode_from_every_start(byte_fallback_tokenizer, name):
    tok = byte_fallback_tokenizer
    ids = tok.encode(TEXTS[name], add_special_tokens=False)
    for start in range(0, len(ids), 3):  # also outputs that start mid-word or mid-character
        deltas, tail, _ = stream(tok, ids[start:])
        assert "".join(deltas) + tail == tok.decode(ids[start:], skip_special_tokens=True)
    deltas, tail, _ = stream(tok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) + tail == tok.decode(ids)  # Metaspace drops a leading space


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_fallback_fuzz_random_ids(byte_fallback_tokenizer, skip_special_tokens):
    tok = byte_fallback_tokenizer
    rng = random.Random(5)
    for _ in range(30):
        # Special ids (0..2) between byte tokens: skipping them joins byte runs.
        ids = [rng.randrange(len(tok)) if rng.random() < 0.6 else rng.randrange(3)
               for _ in range(60)]  # fmt: skip
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        for k, token_id in enumerate(ids, start=1):
            detok.step([token_id])
            decoded = tok.decode(ids[:k], skip_special_tokens=skip_special_tokens)
            assert decoded.startswith(detok.text)
        detok.flush()
        assert detok.text == tok.decode(ids, skip_special_tokens=skip_special_tokens)
