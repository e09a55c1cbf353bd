"""The grammar module (serving/engine/sampling/grammar.py) and GuidedSpec: what each kind of spec compiles
to, token by token, against the default model's real 49,152-token vocabulary.

Expected masks come from a definition, not from the backend: a token may come first in a choice
exactly when its text is a non-empty prefix of an option; once an option is complete and nothing
can follow, only EOS may.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from serving.engine.errors import InvalidRequestError
from serving.engine.params import GuidedSpec, SamplingParams
from serving.engine.sampling.grammar import GrammarCompileError, GrammarCompiler, PendingGrammars, allocate_bitmask, compiler_for

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,))
    yield compiler
    compiler.shutdown()


def allowed(matcher) -> set[int]:
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    bits = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(VOCAB)]
    return {t for t, b in enumerate(bits) if b}


def prefix_tokens(tokenizer, options: list[str]) -> set[int]:
    """Every non-special token whose text is a non-empty prefix of an (ASCII) option."""
    special = set(tokenizer.all_special_ids)
    found = set()
    for token_id in range(VOCAB):
        text = tokenizer.decode([token_id])
        if token_id not in special and text and any(o.startswith(text) for o in options):
            found.add(token_id)
    return found


def feed(matcher, token_ids: list[int]) -> None:
    for token_id in token_ids:
        assert matcher.accept(token_id), token_id


# ---- GuidedSpec ------------------------------------------------------------------------------
def test_specs_of_equal_schemas_are_equal_and_hash_alike():
    a = GuidedSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = GuidedSpec.json_schema(json.loads('{"type": "object", "properties": {"x": {"type": "integer"}}}'))
    assert a == b and hash(a) == hash(b)
    assert a.value == '{"type":"object","properties":{"x":{"type":"integer"}}}'
    assert GuidedSpec.choice(["a", "ü"]).value == '["a", "ü"]'


@pytest.mark.parametrize("kind, value, message", [
    ("xml", "", "kind must be one of json_schema, json_object, regex, choice, grammar, got 'xml'"),
    ("json_schema", "{", "the JSON schema is not valid JSON"),
    ("json_schema", "[1]", "a JSON schema is an object or a boolean, got list"),
    ("choice", "[]", "choice is a JSON array of one or more non-empty strings"),
    ("choice", '["a", ""]', "choice is a JSON array of one or more non-empty strings"),
    ("choice", '"a"', "choice is a JSON array of one or more non-empty strings"),
    ("regex", "", "the regex must not be empty"),
    ("grammar", "", "the grammar must not be empty"),
])
def test_a_malformed_spec_is_refused_naming_guided(kind, value, message):
    with pytest.raises(InvalidRequestError) as info:
        GuidedSpec(kind, value)
    assert info.value.param == "guided"
    assert info.value.message.startswith(message)


@pytest.mark.parametrize("field, value", [("min_tokens", 2), ("ignore_eos", True)])
def test_min_tokens_and_ignore_eos_cannot_be_combined_with_a_structured_output(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(guided=GuidedSpec("json_object"), **{field: value})
    assert info.value.param == field


# ---- compiling and matching ----------------------------------------------------------------
def test_a_choice_allows_exactly_the_prefixes_of_its_options_then_only_eos(compiler, tokenizer):
    options = ["yes", "no", "maybe so"]
    compiled = compiler.compile(GuidedSpec.choice(options))
    matcher = compiler.matcher(compiled)
    first = allowed(matcher)
    assert first == prefix_tokens(tokenizer, options)
    assert tokenizer.convert_tokens_to_ids("yes") in first and EOS not in first

    feed(matcher, tokenizer("maybe", add_special_tokens=False).input_ids)
    assert allowed(matcher) == prefix_tokens(tokenizer, [" so"])
    feed(matcher, tokenizer(" so", add_special_tokens=False).input_ids)
    assert allowed(matcher) == {EOS}
    assert not matcher.is_terminated
    assert matcher.accept(EOS) and matcher.is_terminated


def test_a_token_the_grammar_does_not_allow_is_refused_and_changes_nothing(compiler, tokenizer):
    matcher = compiler.matcher(compiler.compile(GuidedSpec("regex", "[0-9]+")))
    before = allowed(matcher)
    assert not matcher.accept(tokenizer.convert_tokens_to_ids("yes"))
    assert allowed(matcher) == before
    assert EOS not in before  # nothing yet: the regex needs a digit


def test_special_tokens_are_never_allowed_inside_an_output(compiler, tokenizer):
    matcher = compiler.matcher(compiler.compile(GuidedSpec("json_object")))
    feed(matcher, tokenizer('{"a": "', add_special_tokens=False).input_ids)
    inside_a_string = allowed(matcher)
    assert len(inside_a_string) > 40000  # almost any text may go in a string ...
    assert not inside_a_string & set(tokenizer.all_special_ids)  # ... but no special token


def test_json_schema_output_is_compact_and_strict(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    matcher = compiler.matcher(compiler.compile(GuidedSpec.json_schema(schema)))
    assert allowed(matcher) == prefix_tokens(tokenizer, ['{"a": '])  # no leading whitespace, no other key
    feed(matcher, tokenizer('{"a": 12', add_special_tokens=False).input_ids)
    after = allowed(matcher)
    assert tokenizer.convert_tokens_to_ids("}") in after and tokenizer.convert_tokens_to_ids(",") not in after


def test_replaying_prior_tokens_continues_the_grammar_where_they_left_it(compiler, tokenizer):
    compiled = compiler.compile(GuidedSpec.choice(["yes", "no", "maybe so"]))
    prior = tokenizer("maybe", add_special_tokens=False).input_ids
    replayed = compiler.matcher(compiled, replay=prior)
    fed = compiler.matcher(compiled)
    feed(fed, prior)
    assert allowed(replayed) == allowed(fed) == prefix_tokens(tokenizer, [" so"])
    with pytest.raises(InvalidRequestError) as info:
        compiler.matcher(compiled, replay=prior + [tokenizer.convert_tokens_to_ids("yes")])
    assert info.value.param == "prior_output_token_ids"
    assert info.value.message == f"token {tokenizer.convert_tokens_to_ids('yes')} at position {len(prior)} does not follow the request's grammar"


def test_an_ebnf_and_a_lark_grammar_compile_alike(compiler, tokenizer):
    ebnf = compiler.matcher(compiler.compile(GuidedSpec("grammar", 'root ::= "yes" | "no"')))
    lark = compiler.matcher(compiler.compile(GuidedSpec("grammar", 'start: "yes" | "no"')))
    assert allowed(ebnf) == allowed(lark) == prefix_tokens(tokenizer, ["yes", "no"])


@pytest.mark.parametrize("spec, reason", [
    (GuidedSpec("regex", "a(b"), "Regex parsing error at position 4: The parenthesis is not closed."),
    (GuidedSpec("regex", "(?=a)a"), "Regex parsing error at position 3: Lookahead is not supported yet."),
    (GuidedSpec.json_schema({"type": "strin"}), 'Unsupported type "strin"'),
    (GuidedSpec.json_schema({"$ref": "#/$defs/X"}), "Cannot find field $defs in #/$defs/X"),
    (GuidedSpec("grammar", "root ::= foo"), 'EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
])
def test_a_spec_that_does_not_compile_raises_the_backends_reason(compiler, spec, reason):
    with pytest.raises(GrammarCompileError) as info:
        compiler.compile(spec)
    assert info.value.param == "guided"
    assert info.value.message == f"cannot be compiled: {reason}"


def test_each_spec_compiles_once_in_the_compilers_own_threads(tokenizer, monkeypatch):
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), max_cached=2)
    threads = []
    compile_one = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda spec: threads.append(threading.current_thread().name) or compile_one(spec))
    a, b, c = GuidedSpec("regex", "a+"), GuidedSpec("regex", "b+"), GuidedSpec("regex", "c+")
    first = compiler.submit(a)
    assert compiler.submit(a) is first  # shared while it compiles, and after
    first.result()
    assert compiler.submit(a) is first and compiler.num_compiled == 1
    compiler.compile(b)
    compiler.compile(c)  # the cache holds 2: `a`, the least recently used, goes
    assert compiler.num_compiled == 3
    assert compiler.submit(a) is not first and compiler.num_compiled == 4
    compiler.submit(a).result()
    assert len(threads) == 4 and all(name.startswith("kvrelay-grammar") for name in threads)
    compiler.shutdown()


def test_a_failed_compile_is_cached_with_its_error(compiler):
    spec = GuidedSpec("regex", "x(")
    before = compiler.num_compiled
    for _ in range(2):
        with pytest.raises(GrammarCompileError):
            compiler.compile(spec)
    assert compiler.num_compiled == before + 1


def test_one_compiler_per_tokenizer_and_logits_width(tokenizer):
    assert compiler_for(tokenizer, VOCAB, (EOS,)) is compiler_for(tokenizer, VOCAB, (EOS,))
    assert compiler_for(tokenizer, VOCAB + 64, (EOS,)) is not compiler_for(tokenizer, VOCAB, (EOS,))


def test_padding_beyond_the_tokenizers_vocabulary_is_never_allowed(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB + 64, (EOS,))
    matcher = compiler.matcher(compiler.compile(GuidedSpec("json_object")))
    feed(matcher, tokenizer('{"a": "', add_special_tokens=False).input_ids)
    bitmask = allocate_bitmask(1, VOCAB + 64)
    matcher.fill_bitmask(bitmask, 0)
    assert bitmask.shape == (1, (VOCAB + 64) // 32)
    assert bitmask[0, VOCAB // 32:].tolist() == [0, 0]
    compiler.shutdown()


def test_pending_grammars_say_when_one_is_ready():
    from concurrent.futures import Future

    pending = PendingGrammars()
    woken = []
    pending.on_ready = lambda: woken.append(True)
    a, b = Future(), Future()
    pending.add("a", a)
    pending.add("b", b)
    assert pending.take_ready() == [] and len(pending) == 2
    b.set_result("compiled b")
    assert woken == [True]
    assert pending.take_ready() == [("b", b)] and len(pending) == 1
    pending.discard("a")
    a.set_result("compiled a")  # discarded: nothing waits for it
    assert pending.take_ready() == [] and len(pending) == 0


def test_the_bitmask_is_int32_words_with_one_bit_per_token():
    bitmask = allocate_bitmask(3, 100)
    assert bitmask.dtype == torch.int32 and tuple(bitmask.shape) == (3, 4)


def test_json_grammars_never_allow_a_raw_control_character(compiler, tokenizer):
    """Valid JSON escapes them; xgrammar's length-bounded strings would let them through."""
    control = {t for t in range(VOCAB) if any(ord(c) < 0x20 for c in tokenizer.decode([t]))}
    assert control  # the vocabulary has such tokens (\\n, \\t, \\x1b, ...)
    for spec, prefix in (
        (GuidedSpec.json_schema({"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}}, "required": ["a"]}), '{"a": "'),
        (GuidedSpec("json_object"), '{"a": "'),
    ):
        matcher = compiler.matcher(compiler.compile(spec))
        feed(matcher, tokenizer(prefix, add_special_tokens=False).input_ids)
        assert not allowed(matcher) & control
    regex = compiler.matcher(compiler.compile(GuidedSpec("regex", "a[\\n\\t]b")))  # a regex may ask for them
    feed(regex, tokenizer("a", add_special_tokens=False).input_ids)
    assert allowed(regex) & control
