"""StopChecker: stop tokens, stop strings with hold-back, min_tokens and max_tokens."""

from __future__ import annotations

import random

import pytest

from serving.engine.params import SamplingParams
from serving.engine.sampling.detokenizer import IncrementalDetokenizer
from serving.engine.sampling.stop_checker import StopChecker, StopResult

EOS = 2  # <|im_end|> of SmolLM2
TEXT_TOKEN = 100  # any id that is neither eos nor a stop token




def make_checker(*, max_tokens: int = 100, eos: tuple[int, ...] = (EOS,), **params) -> StopChecker:
    return StopChecker.for_params(SamplingParams(**params), eos, max_tokens)


def feed(checker: StopChecker, steps: list[str | tuple[int, str]]) -> list[StopResult]:
    """Feed text pieces (or (token id, text) pairs) until the checker finishes."""
    results = []
    for n, step in enumerate(steps, start=1):
        token_id, text = step if isinstance(step, tuple) else (TEXT_TOKEN, step)
        results.append(checker.check(token_id, text, n))
        if results[-1].finish_reason is not None:
            break
    return results


def deltas(results: list[StopResult]) -> list[str]:
    return [r.text for r in results]


def test_stop_string_split_across_three_tokens_is_never_streamed():
    checker = make_checker(stop=["STOP"])
    results = feed(checker, ["Hello S", "TO", "P! more", "never read"])
    assert deltas(results) == ["Hello ", "", ""]
    assert results[-1] == StopResult("stop", "STOP", "")
    assert checker.text == "Hello "
    assert checker.flush() == ""


def test_include_stop_str_in_output_keeps_the_match():
    checker = make_checker(stop=["STOP"], include_stop_str_in_output=True)
    results = feed(checker, ["Hello S", "TO", "P! more"])
    assert deltas(results) == ["Hello ", "", "STOP"]
    assert results[-1] == StopResult("stop", "STOP", "STOP")
    assert checker.text == "Hello STOP"


@pytest.mark.parametrize("stop", [["world", "lo w"], ["lo w", "world"]])
def test_two_stop_strings_earliest_match_wins(stop):
    checker = make_checker(stop=stop)
    results = feed(checker, ["hello world"])
    assert results == [StopResult("stop", "lo w", "hel")]


@pytest.mark.parametrize("stop", [["abc", "ab"], ["ab", "abc"]])
def test_tie_on_start_goes_to_the_string_that_ends_first(stop):
    checker = make_checker(stop=stop, include_stop_str_in_output=True)
    assert feed(checker, ["xabcd"]) == [StopResult("stop", "ab", "xab")]


def test_match_spanning_held_text_and_new_text_beats_later_match():
    checker = make_checker(stop=["<end>", "d>"])
    results = feed(checker, ["a <e", "nd>"])  # "<end>" starts 2 chars earlier than "d>"
    assert deltas(results) == ["a ", ""]
    assert results[-1].stop_reason == "<end>"
    assert checker.text == "a "


def test_partial_prefix_is_held_then_released_when_match_fails():
    checker = make_checker(stop=["ab"])
    assert feed(checker, ["a", "c"]) == [StopResult(None, None, ""), StopResult(None, None, "ac")]
    assert checker.text == "ac"


def test_held_prefix_is_the_longest_suffix_that_starts_a_stop_string():
    checker = make_checker(stop=["</end>", "xyz"])
    results = feed(checker, ["Hi <", "/e", "x", "</", "end>"])
    assert deltas(results) == ["Hi ", "", "</e", "x", ""]
    assert checker.text == "Hi </ex"
    assert results[-1] == StopResult("stop", "</end>", "")


def test_overlapping_prefix_candidates_hold_just_enough():
    checker = make_checker(stop=["aab"])
    results = feed(checker, ["a", "a", "a", "c", "aab"])
    assert deltas(results) == ["", "", "a", "aac", ""]
    assert results[-1].stop_reason == "aab"
    assert checker.text == "aaac"


def test_eos_stops_drops_its_text_and_releases_held_text():
    checker = make_checker(stop=["ab"])
    results = feed(checker, ["x", "a", (EOS, "<|im_end|>"), "never read"])
    assert deltas(results) == ["x", "", "a"]
    assert results[-1] == StopResult("stop", None, "a")
    assert checker.text == "xa"
    assert checker.flush() == ""


def test_ignore_eos_continues_until_length():
    checker = make_checker(ignore_eos=True, max_tokens=4)
    results = feed(checker, ["a", (EOS, ""), "b", (EOS, "")])
    assert [r.finish_reason for r in results] == [None, None, None, "length"]
    assert checker.text == "ab"


def test_stop_token_ids_report_the_id_and_ignore_eos_does_not_disable_them():
    checker = make_checker(stop_token_ids=[13], ignore_eos=True)
    results = feed(checker, ["a", (EOS, ""), (13, "."), "never read"])
    assert results[-1] == StopResult("stop", 13, "")
    assert checker.text == "a"


def test_min_tokens_delays_eos_and_stop_tokens():
    checker = make_checker(min_tokens=3, stop_token_ids=[13])
    results = feed(checker, ["a", (EOS, ""), (EOS, "")])
    assert [r.finish_reason for r in results] == [None, None, "stop"]
    checker = make_checker(min_tokens=3, stop_token_ids=[13])
    results = feed(checker, [(13, "."), (13, "."), (13, ".")])
    assert results[-1] == StopResult("stop", 13, "")
    assert checker.text == ".."


def test_min_tokens_delays_stop_strings():
    checker = make_checker(stop=["x"], min_tokens=2)
    results = feed(checker, ["x", "yxz", "x"])
    assert deltas(results) == ["x", "y"]
    assert results[-1] == StopResult("stop", "x", "y")
    assert checker.text == "xy"


def test_stop_string_straddling_min_tokens_boundary_was_held():
    # "ab" arrives before min_tokens: it is not checked, but it is held, so the match that
    # completes after min_tokens may still cut it.
    checker = make_checker(stop=["abc"], min_tokens=2)
    results = feed(checker, ["ab", "c"])
    assert results == [StopResult(None, None, ""), StopResult("stop", "abc", "")]
    # A match wholly before min_tokens never counts.
    checker = make_checker(stop=["abc"], min_tokens=3)
    results = feed(checker, ["ab", "c", "d", "abc"])
    assert deltas(results) == ["", "abc", "d", ""]
    assert results[-1].stop_reason == "abc"
    assert checker.text == "abcd"


def test_max_tokens_gives_length_and_releases_held_text():
    checker = make_checker(stop=["ab"], max_tokens=2)
    results = feed(checker, ["x", "ya", "never read"])
    assert deltas(results) == ["x", "ya"]
    assert results[-1] == StopResult("length", None, "ya")


def test_stop_checks_come_before_length_on_the_last_token():
    checker = make_checker(stop=["ab"], max_tokens=2)
    assert feed(checker, ["a", "bc"])[-1] == StopResult("stop", "ab", "")
    checker = make_checker(max_tokens=2)
    assert feed(checker, ["a", (EOS, "")])[-1] == StopResult("stop", None, "")


def test_flush_on_abort_releases_held_text_and_check_after_finish_raises():
    checker = make_checker(stop=["abc"])
    assert feed(checker, ["x", "ab"])[-1] == StopResult(None, None, "")
    assert checker.flush() == "ab"
    assert checker.finish_reason is None  # decided by the caller, not by check()
    assert checker.text == "xab"
    with pytest.raises(RuntimeError, match="after the sequence finished"):
        checker.check(TEXT_TOKEN, "z", 3)


def reference_final_text(pieces: list[str], stops: list[str], include: bool) -> str:
    """Non-incremental reference for min_tokens=0: stop at the first piece that completes a
    match; among the matches completing there, the earliest start (then the shortest)."""
    text = ""
    for piece in pieces:
        old_len = len(text)
        text += piece
        matches = []
        for stop in stops:
            for start in range(len(text) - len(stop) + 1):
                if text.startswith(stop, start) and start + len(stop) > old_len:
                    matches.append((start, len(stop)))
        if matches:
            start, length = min(matches)
            return text[: start + length] if include else text[:start]
    return text


@pytest.mark.parametrize("seed", range(6))
def test_fuzz_streamed_text_is_never_taken_back(seed):
    rng = random.Random(seed)
    for _ in range(200):
        alphabet = "ab<>/ "
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5)))
                 for _ in range(rng.randrange(1, 4))]  # fmt: skip
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 8))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        include = rng.random() < 0.5
        checker = make_checker(stop=stops, include_stop_str_in_output=include)
        streamed = ""
        received = ""
        for n, piece in enumerate(pieces, start=1):
            result = checker.check(TEXT_TOKEN, piece, n)
            received += piece
            streamed += result.text
            if result.finish_reason is not None:
                break
            assert received.startswith(streamed)
            # Held text is exactly the longest suffix that is a proper prefix of a stop string.
            held = received[len(streamed) :]
            assert not held or any(stop.startswith(held) and stop != held for stop in stops)
            assert all(
                not received.endswith(stop[:k])
                for stop in stops
                for k in range(len(held) + 1, len(stop))
            )
        else:
            streamed += checker.flush()
        expected = reference_final_text(pieces, stops, include)
        assert streamed == expected == checker.text


def run_with_detokenizer(tokenizer, ids, params, *, max_tokens=100):
    """The engine's loop for one sequence: detokenize, check, stream."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
    checker = StopChecker.for_params(params, (EOS,), max_tokens)
    streamed = []
    result = None
    for n, token_id in enumerate(ids, start=1):
        result = checker.check(token_id, detok.step([token_id]), n)
        streamed.append(result.text)
        assert "".join(streamed) == checker.text
        if result.finish_reason is not None:
            if not isinstance(result.stop_reason, str):
                streamed.append(detok.flush())
            break
    return streamed, result


def test_with_detokenizer_stop_string_over_real_tokens(tokenizer):
    ids = tokenizer.encode("The answer is 42.\nUser: thanks")
    assert ids == [504, 2988, 314, 216, 36, 34, 30, 198, 11126, 42, 6954]
    streamed, result = run_with_detokenizer(tokenizer, ids, SamplingParams(stop=["\nUser:"]))
    assert result == StopResult("stop", "\nUser:", "")
    assert "".join(streamed) == "The answer is 42."
    assert streamed == ["The", " answer", " is", " ", "4", "2", ".", "", "", ""]


def test_with_detokenizer_emoji_stop_string_split_over_byte_tokens(tokenizer):
    ids = tokenizer.encode("Go 🛑 no")
    streamed, result = run_with_detokenizer(
        tokenizer, ids, SamplingParams(stop=["🛑"], include_stop_str_in_output=True)
    )
    assert result.finish_reason == "stop" and result.stop_reason == "🛑"
    assert "".join(streamed) == "Go 🛑"
    assert all("\ufffd" not in s for s in streamed)


def test_with_detokenizer_eos_and_length(tokenizer):
    text = "Hello 👋 world"
    ids = tokenizer.encode(text)
    streamed, result = run_with_detokenizer(tokenizer, [*ids, EOS], SamplingParams())
    assert result == StopResult("stop", None, "")
    assert "".join(streamed) == text

    streamed, result = run_with_detokenizer(
        tokenizer, ids, SamplingParams(stop=["wor"]), max_tokens=3
    )
    assert result.finish_reason == "length"
    # Cut inside the emoji: the unfinished character comes out of the detokenizer's flush.
    assert "".join(streamed) == tokenizer.decode(ids[:3]) == "Hello \ufffd"
