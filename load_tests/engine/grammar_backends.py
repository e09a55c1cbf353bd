"""xgrammar against llguidance on this CPU: the measurement that chose serving/engine/sampling/grammar.py's
backend (docs/benchmarks.md). Not a `kvrelay bench` target: llguidance is not a dependency; put
it on the path to compare (`pip install --target DIR llguidance==1.9.1`, PYTHONPATH=DIR).

    python -m load_tests.engine.grammar_backends [xgrammar|llguidance ...]

For each backend, with the default model's tokenizer (49,152 tokens) on one thread:

    compile_ms        three JSON schemas (flat, with an array of objects and a pattern, nested
                      with a format and bounds) and JSON mode: median of 3 cold compiles
    mask_step_ms_bN   N matchers (the schemas in turn), each advanced along a valid document of
                      its schema, token by token: the time to fill all N bitmask rows at one
                      step, median (and p90) over the steps

Both lay the bitmask out alike (int32 words, bit j of word w = token 32 w + j) and both use
compact separators (`, ` and `: `), so they fill the same masks.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

__all__ = ["SCHEMAS", "DOCUMENTS", "measure"]

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["sku", "qty"],
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}}}},
        "status": {"enum": ["new", "paid", "shipped"]}, "note": {"type": ["string", "null"]}},
        "required": ["id", "items", "status"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "required": ["email"], "properties": {
            "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5}}},
        "score": {"type": "number", "minimum": 0, "maximum": 1}, "ok": {"type": "boolean"}},
        "required": ["user", "score", "ok"]},
}
DOCUMENTS = {  # one valid document per schema, in the backends' compact form
    "person": '{"name": "Alice Wonderland the third of her name", "age": 42}',
    "order": '{"id": "ABC-1234", "items": [{"sku": "x-1", "qty": 2, "price": 3.5}, {"sku": "y-22", "qty": 1}], "status": "paid", "note": null}',
    "nested": '{"user": {"email": "a@b.co", "tags": ["one", "two", "three"]}, "score": 0.25, "ok": true}',
}
VOCAB = 49152


def _xgrammar(tokenizer):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)

    def compile_schema(schema):
        return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(json.dumps(schema), any_whitespace=False)

    def json_mode():
        return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_builtin_json_grammar()

    def matcher(compiled):
        return xgrammar.GrammarMatcher(compiled)

    def fill(m, bitmask, i):
        m.fill_next_token_bitmask(bitmask, i)

    return compile_schema, json_mode, matcher, fill, lambda m, t: m.accept_token(t)


def _llguidance(tokenizer):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
    compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def compile_schema(schema):  # llguidance computes masks lazily: building the matcher is its compile
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=compact))
        assert not m.is_error(), m.get_error()
        return m

    def json_mode():
        return compile_schema({"type": "object"})

    def matcher(compiled):
        return compiled.deep_copy()

    return compile_schema, json_mode, matcher, llguidance.torch.fill_next_token_bitmask, lambda m, t: m.consume_token(t)


def measure(backend: str, tokenizer) -> dict:
    import torch

    compile_schema, json_mode, new_matcher, fill, accept = (_xgrammar if backend == "xgrammar" else _llguidance)(tokenizer)
    result: dict = {"compile_ms": {}}
    compiled = {}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(3):
            start = time.perf_counter()
            compiled[name] = compile_schema(schema)
            times.append(time.perf_counter() - start)
        result["compile_ms"][name] = round(statistics.median(times) * 1e3, 2)
    start = time.perf_counter()
    json_mode()
    result["compile_ms"]["json_object"] = round((time.perf_counter() - start) * 1e3, 2)
    names = list(SCHEMAS)
    for batch in (8, 32):
        rows = [(new_matcher(compiled[names[i % 3]]), tokenizer(DOCUMENTS[names[i % 3]], add_special_tokens=False).input_ids)
                for i in range(batch)]
        bitmask = torch.full((batch, (VOCAB + 31) // 32), -1, dtype=torch.int32)
        step_s = []
        for step in range(min(len(ids) for _, ids in rows)):
            start = time.perf_counter()
            for i, (m, _) in enumerate(rows):
                fill(m, bitmask, i)
            step_s.append(time.perf_counter() - start)
            for m, ids in rows:
                assert accept(m, ids[step]), (backend, step)
        step_s.sort()
        result[f"mask_step_ms_b{batch}"] = round(statistics.median(step_s) * 1e3, 3)
        result[f"mask_step_ms_b{batch}_p90"] = round(step_s[int(0.9 * len(step_s))] * 1e3, 3)
    return result


def main(argv: list[str]) -> int:
    import torch

    from serving.engine.modeling.loader import load_tokenizer, resolve_model_dir

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(resolve_model_dir("smollm2-135m-instruct"))
    for backend in argv or ["xgrammar", "llguidance"]:
        print(backend, json.dumps(measure(backend, tokenizer)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
