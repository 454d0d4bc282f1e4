"""Structured outputs and forced tool calls over HTTP on the default SmolLM2-135M model.

A 135M model does not write valid JSON for a schema on its own; these tests pass only
because decoding is grammar-constrained. Schemas bound every string, array and number so
that each answer completes within a small `max_tokens` (the suite generates well under
1,500 tokens); requests run concurrently so the server batches them.
"""

from __future__ import annotations

import enum
import json
import re
import warnings
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(smol):
    with openai.OpenAI(base_url=smol.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _name(n: int) -> str:
    return f"s{n}"


def _s(max_len: int = 12) -> dict:
    return {"type": "string", "maxLength": max_len}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person named Alice who is 30.", _obj({"name": _s(), "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("Is the sky blue?", _obj({"answer": {"type": "boolean"}})),
    ("Pick a unit.", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("List up to three fruits.", _obj({"fruits": {"type": "array", "items": _s(10), "minItems": 1, "maxItems": 3}})),
    ("Give a city and its country.", _obj({"city": _s(), "country": _s()})),
    ("Rate this movie from 1 to 5.", _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "ok": {"type": "boolean"}})),
    ("Describe a book.", _obj({"book": _obj({"title": _s(), "year": {"type": "integer", "minimum": 1000, "maximum": 2100}})})),
    ("Give a point.", _obj({"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}})),
    ("Status?", _obj({"status": {"const": "ok"}, "code": {"type": "integer", "enum": [200, 404]}})),
    ("A user record.", _obj({"id": {"type": "integer", "minimum": 1, "maximum": 99}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}})),
    ("Optional fields.", _obj({"name": _s(8), "nick": _s(8)}, required=["name"])),
    ("A value that is a number or null.", _obj({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}})),
    ("Nested list of pairs.", _obj({"pairs": {"type": "array", "maxItems": 2, "items": _obj({"k": _s(4), "v": {"type": "integer", "minimum": 0, "maximum": 9}})}})),
    ("A top-level array of small integers.", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3}),
    ("Name a planet.", _obj({"planet": {"enum": ["Mercury", "Venus", "Earth", "Mars"]}, "moons": {"type": "integer", "minimum": 0, "maximum": 99}})),
    ("An address.", _obj({"address": _obj({"street": _s(12), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("A temperature reading.", _obj({"celsius": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"const": "C"}})),
    ("Two short words.", _obj({"words": {"type": "array", "items": _s(6), "minItems": 2, "maxItems": 2}})),
    ("A flag and a note.", _obj({"flag": {"type": "boolean"}, "note": {"anyOf": [_s(10), {"type": "null"}]}})),
    ("A matrix of digits.", _obj({"rows": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}})),
]


def _ask(client, prompt: str, schema: dict, i: int, max_tokens: int = 64):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
        max_tokens=max_tokens, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": _name(i), "schema": schema, "strict": True}},
    )


def test_json_schema_outputs_validate(client):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        futures = [pool.submit(_ask, client, p, s, i) for i, (p, s) in enumerate(SCHEMAS)]
        results = [f.result() for f in futures]
    for (prompt, schema), r in zip(SCHEMAS, results):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, schema)


def test_open_keys_are_not_repeated(client):
    # Keys a pattern allows are a repetition to the grammar, which cannot say they differ: left
    # to it, this model writes "a" three times, one key to a JSON parser (the last value wins),
    # short of minProperties. Each object's keys are kept distinct while generating.
    schema = {"type": "object", "patternProperties": {"^a+$": {"type": "integer"}}, "additionalProperties": False,
              "minProperties": 3, "maxProperties": 3}
    for i, prompt in enumerate(["Count the a's.", "Give a map of words to counts."]):
        choice = _ask(client, prompt, schema, 50 + i).choices[0]
        keys: list[list[str]] = []
        value = json.loads(choice.message.content,
                           object_pairs_hook=lambda pairs: keys.append([k for k, _ in pairs]) or dict(pairs))
        assert choice.finish_reason == "stop" and all(len(set(k)) == len(k) for k in keys), choice.message.content
        jsonschema.validate(value, schema)


def test_an_unbounded_integer_closes(client):
    # JSON's grammar limits no digits: left to it, this model writes "age": 1000000000... until
    # max_output_tokens cuts the JSON off. An integer with an open side is bounded at
    # ±(2**53 - 1) (RFC 8259's interoperable range), so the number ends and the object closes.
    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int

    model = client.models.list().data[0].id
    r = client.responses.parse(model=model, input="Make a person", text_format=Person, max_output_tokens=64,
                               temperature=0)
    assert r.status == "completed", r.output_text
    assert abs(r.output_parsed.age) <= 2**53 - 1
    chat = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Make a person"}],
                                         response_format=Person, max_tokens=64, temperature=0)
    assert chat.choices[0].finish_reason == "stop", chat.choices[0].message.content


def test_fractional_seconds_end(client):
    # the date-time and time formats allow any number of digits after the seconds' point: left
    # to them, this model wrote "at": "1234-12-12T00:00:00.0000000000... until max_tokens cut the
    # JSON off. The fraction is held to nine digits (nanoseconds), so a pydantic datetime parses.
    import datetime as dt

    class When(BaseModel):
        at: dt.datetime
        t: dt.time

    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "Reply with JSON only."}, {"role": "user", "content": "Give an example"}]
    r = client.chat.completions.parse(model=model, messages=messages, response_format=When, max_tokens=64,
                                      temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.parsed is not None
    fractions = re.findall(r"\.([0-9]+)", r.choices[0].message.content)
    assert all(len(f) <= 9 for f in fractions), r.choices[0].message.content


def test_a_parsed_reply_goes_back_as_it_came(client):
    # the SDK's usual loop appends the parse() reply to the messages; its `parsed` (the content
    # again, as an object) is sent along and means nothing new: it is not reported
    class Pick(BaseModel):
        unit: Unit

    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Pick a unit."}]
    r = client.chat.completions.parse(model=model, messages=messages, response_format=Pick, max_tokens=16,
                                      temperature=0)
    assert r.choices[0].message.parsed is not None
    messages += [r.choices[0].message, {"role": "user", "content": "Again."}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # (pydantic's, on the SDK serializing `parsed`)
        raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=1)
    assert "parsed" not in raw.headers.get("llmserve-ignored-fields", ""), raw.headers.get("llmserve-ignored-fields")


def test_every_number_ends(smol, client):
    # JSON's number grammar limits neither digits nor exponent: this model once wrote
    # "ratio": 0.2976500155266768E3128138884... until max_tokens cut the JSON off. A bias that
    # makes "1" its choice wherever the grammar allows one shows the limits: each part of a
    # number ends (integer part and fraction 17 digits, exponent 3 digits and at most 290: a
    # finite double), and the object closes.
    model = client.models.list().data[0].id
    one = httpx.post(smol.url + "/tokenize", json={"model": model, "prompt": "1"}).json()["tokens"]
    assert len(one) == 1
    schema = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
              "required": ["x", "y"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give a point as JSON."}], max_tokens=120,
        temperature=0, logit_bias={str(one[0]): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "point", "schema": schema}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    point = json.loads(choice.message.content)
    assert set(point) == {"x", "y"}
    for number in re.findall(r"-?[0-9][0-9.eE+-]*", choice.message.content):
        mantissa, _, exponent = number.lstrip("-").lower().partition("e")
        whole, _, fraction = mantissa.partition(".")
        exponent = exponent.lstrip("+-")
        assert len(whole) <= 17 and len(fraction) <= 17 and len(exponent) <= 3, number
        assert not exponent or int(exponent) <= 290, number
    assert "1" * 17 in choice.message.content, "the bias reached a limit"


def test_json_object_parses(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give a JSON object with a key name set to Bob."}],
        max_tokens=48, temperature=0, response_format={"type": "json_object"},
    )
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:   # the object did not close in time: what came is still a JSON object's prefix
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_a_schema_description_no_prompt_holds_is_reported(client):
    # OpenAI shows `json_schema.description` to the model (LangChain sends a Pydantic model's
    # docstring there); no prompt here holds it, so the client is told. The schema still rules.
    schema = _obj({"answer": _s(8)})
    raw = client.chat.completions.with_raw_response.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Say hi in JSON."}], max_tokens=24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "reply", "description": "A reply in French.", "schema": schema}},
    )
    assert raw.headers.get("llmserve-ignored-fields") == "response_format.json_schema.description"
    choice = raw.parse().choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_length_inside_the_object_is_length(client):
    r = _ask(client, "Describe a person.", _obj({"name": _s(40), "bio": _s(200)}), 99, max_tokens=6)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("{")
    assert r.usage.completion_tokens == 6


def test_a_grammar_completed_on_the_last_token_allowed_stops(client):
    # The same tokens end the same way whether or not max_tokens left room for more: the
    # output is complete, not cut off (as a stop string on the last token allowed).
    model = client.models.list().data[0].id
    ask = dict(model=model, messages=[{"role": "user", "content": "Give a phone number."}], temperature=0,
               response_format={"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"})
    roomy = client.chat.completions.create(max_tokens=20, **ask)
    used = roomy.usage.completion_tokens
    exact = client.chat.completions.create(max_tokens=used, **ask)
    assert (exact.choices[0].message.content, exact.choices[0].finish_reason) == (roomy.choices[0].message.content, "stop")
    assert exact.usage.completion_tokens == used
    short = client.chat.completions.create(max_tokens=used - 1, **ask)
    assert short.choices[0].finish_reason == "length"
    streamed = [c.choices[0].finish_reason for c in client.chat.completions.create(max_tokens=used, stream=True, **ask)
                if c.choices]
    assert streamed[-1] == "stop"


def test_streamed_json_equals_non_streamed(client):
    prompt, schema = SCHEMAS[0]
    model = client.models.list().data[0].id
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    msgs = [{"role": "user", "content": prompt + " Answer in JSON."}]
    whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=64, temperature=0,
                                           response_format=rf).choices[0].message.content
    parts, finish = [], None
    for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=64, temperature=0,
                                                response_format=rf, stream=True):
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == whole and finish == "stop"
    jsonschema.validate(json.loads(whole), schema)


def test_regex_and_grammar_extensions(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give a phone number."}], max_tokens=20, temperature=0,
        response_format={"type": "regex", "regex": "[0-9]{3}-[0-9]{4}"},
    )
    import re
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop"
    # \d is [0-9], as in a JSON schema's pattern (Rust's Unicode \d gave "🯸🯸🯸-🯸🯸🯸" here)
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Phone number?"}], max_tokens=20, temperature=0,
        response_format={"type": "regex", "regex": r"\d{3}-\d{4}"},
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].message.content), r.choices[0].message.content
    r = client.completions.create(
        model=model, prompt="Is water wet? Answer:", max_tokens=8, temperature=0,
        extra_body={"response_format": {"type": "grammar", "grammar": 'start: " yes" | " no"'}},
    )
    assert r.choices[0].text in (" yes", " no")


def test_vllm_structured_outputs_and_guided_fields(client):
    """Clients written for vLLM send `structured_outputs` (or, before vLLM 0.12, `guided_*`)
    in `extra_body`: the same grammars as `response_format`."""
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    for extra in ({"structured_outputs": {"choice": ["Certainly", "No way"]}},
                  {"guided_choice": ["Certainly", "No way"]}):
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=10, temperature=0,
                                           extra_body=extra)
        assert r.choices[0].message.content in ("Certainly", "No way"), extra
        assert r.choices[0].finish_reason == "stop"
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}
    r = client.completions.create(model=model, prompt="A number in JSON:", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"json": schema}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=msgs, max_tokens=10, temperature=0,
        extra_body={"guided_regex": "(yes|no)", "guided_decoding_backend": "xgrammar"})
    assert raw.parse().choices[0].message.content in ("yes", "no")
    assert raw.headers["llmserve-ignored-fields"] == "guided_decoding_backend"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msgs, max_tokens=10,
                                       response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": {"regex": "a"}})
    assert e.value.body["param"] == "structured_outputs.regex"


# vLLM's structured-outputs documentation writes its grammar example in GBNF (its default
# backend's EBNF), indented, with blank lines between rules.
_SQL_GBNF = """
    root ::= select_statement

    select_statement ::= "SELECT " column " from " table " where " condition

    column ::= "col_1 " | "col_2 "
    table ::= "table_1 " | "table_2 "  # comments are dropped
    condition ::= column "= " number
    number ::= [1-9] [0-9]{0,2} " "
"""
_SQL = r"SELECT (col_1|col_2)  from (table_1|table_2)  where (col_1|col_2) = [1-9][0-9]{0,2} "


def test_a_gbnf_grammar_as_vllms_docs_write_it(client):
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Generate an SQL query."}]
    for extra in ({"structured_outputs": {"grammar": _SQL_GBNF}}, {"guided_grammar": _SQL_GBNF},
                  {"response_format": {"type": "grammar", "grammar": _SQL_GBNF}}):
        for seed in (1, 2):
            r = client.chat.completions.create(model=model, messages=msgs, max_tokens=40, temperature=1,
                                               seed=seed, extra_body=extra)
            assert re.fullmatch(_SQL, r.choices[0].message.content), (extra, r.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msgs, max_tokens=4,
                                       extra_body={"structured_outputs": {"grammar": 'root ::= "a" | b'}})
    assert e.value.body["param"] == "structured_outputs.grammar"
    assert "rule `root` uses `b` (line 1, column 16), which no rule defines" in e.value.body["message"]


_CITY = _obj({"city": _s(16)})


def _tagged(text: str) -> list[tuple[str, dict]]:
    """The `<function=NAME>{json}</function>` tags in `text`, each parsed."""
    found = re.findall(r"<function=(\w+)>(.*?)</function>", text, flags=re.S)
    return [(name, json.loads(body)) for name, body in found]


def test_structural_tags(client):
    """vLLM's `structural_tag` (xgrammar's format): free text in which each trigger opens a
    tag whose content follows its schema; streamed as it is not; the legacy shape and
    `structured_outputs.structural_tag` (JSON text) too."""
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    one_call = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<function="], "at_least_one": True, "stop_after_first": True,
        "tags": [{"begin": "<function=get_weather>", "content": {"type": "json_schema", "json_schema": _CITY},
                  "end": "</function>"}]}}
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=40, temperature=0,
                                       response_format=one_call)
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", content
    assert content.startswith("<function=get_weather>") and content.endswith("</function>"), content
    [(name, args)] = _tagged(content)
    jsonschema.validate(args, _CITY)
    streamed = client.chat.completions.create(model=model, messages=msgs, max_tokens=40, temperature=0,
                                              response_format=one_call, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content

    # free text around the tags: whatever a sampled model writes, every tag it opens is whole
    legacy = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "schema": _CITY, "end": "</function>"}]}
    prompt = "Call <function=get_weather>{\"city\": \"Rome\"}</function> for Rome's weather, then say thanks."
    for seed in range(3):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=48, temperature=1.0, seed=seed, response_format=legacy)
        text = r.choices[0].message.content
        closed = text if r.choices[0].finish_reason == "stop" else text.rsplit("<function=", 1)[0]
        for name, args in _tagged(closed):
            assert name == "get_weather"
            jsonschema.validate(args, _CITY)
        assert closed.count("<function=") == len(_tagged(closed)), text

    r = client.completions.create(model=model, prompt="The weather call:", max_tokens=40, temperature=0,
                                  extra_body={"structured_outputs": {"structural_tag": json.dumps(one_call)}})
    assert [name for name, _ in _tagged(r.choices[0].text)] == ["get_weather"], r.choices[0].text

    # a think block of free text, then an answer from a regex
    think = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"},
        {"type": "const_string", "value": "Answer: "}, {"type": "regex", "pattern": "(yes|no)"}]}}
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is Paris in France?"}],
                                       max_tokens=120, temperature=0, response_format=think)
    text = r.choices[0].message.content
    assert text.startswith("<think>"), text
    # (cut off by max_tokens, it is a beginning of that shape)
    _, closed, answer = text.partition("</think>")
    assert not closed or any(a.startswith(answer) for a in ("Answer: yes", "Answer: no")), text
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"<think>.*?</think>Answer: (yes|no)", text, flags=re.S), text

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=msgs, max_tokens=5, response_format={
            "type": "structural_tag", "triggers": ["<call="], "structures": [
                {"begin": "<function=get_weather>", "schema": _CITY, "end": "</function>"}]})
    assert e.value.body["param"] == "response_format.structures[0].begin"


@pytest.mark.parametrize("regex", ["a{100000}", "a{1000000}"])
def test_a_huge_counted_repetition_is_followed(client, regex):
    """Its forced text runs llguidance's lexer out of budget when computed at once; that
    must not leave the grammar failing at its first token (the lexer is shared)."""
    model = client.models.list().data[0].id
    for _ in range(2):   # compiled, then from the cache
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Write a's."}], max_tokens=6,
            temperature=0, response_format={"type": "regex", "regex": regex})
        assert r.choices[0].finish_reason == "length"
        assert set(r.choices[0].message.content) == {"a"} and len(r.choices[0].message.content) >= 6


def _ref_chain(links, mark, spell):
    """`links` `$defs`, each an object whose property refers to the next, marked by `mark(i)`
    and referred to as `spell(i)`: a thousand links overflowed the grammar engine's stack."""
    defs = {f"A{i}": {**mark(i), "type": "object", "properties": {"a": {"$ref": spell(i + 1)}}, "required": ["a"]}
            for i in range(links)}
    defs[f"A{links}"] = {**mark(links), "type": "integer"}
    return {"$defs": defs, "$ref": spell(0)}


@pytest.mark.parametrize("body, param", [
    # chains followed by anchor and by `$id`, as the engine follows them (they ended the process)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _ref_chain(
        1000, lambda i: {"$anchor": f"a{i}"}, lambda i: f"#a{i}")}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": _ref_chain(1000, lambda i: {"$id": f"urn:x:a{i}"}, lambda i: f"urn:x:a{i}")}},
     "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "regex", "regex": "(unclosed"}}, "response_format.regex"),
    # a lone backslash at the end is no regex (llguidance's rewrite would drop it silently)
    ({"structured_outputs": {"regex": "[0-9]+\\"}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "[A-Z]+\\"}}}}}},
     "response_format.json_schema.schema"),
    # they compile, but admit no text at all
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "grammar", "grammar": "start: a\na: a"}}, "response_format.grammar"),
    # past the lexer's budget at the first token, whatever is generated (it was a 500 there)
    ({"structured_outputs": {"regex": "(.{1,999}){1,999}"}}, "structured_outputs.regex"),
    # more literals than compile in time (100,000 took 22 s of a prepare worker)
    ({"structured_outputs": {"grammar": "start: " + " ".join(f"r{j}" for j in range(21)) + "\n" + "".join(
        f"r{j}: " + " | ".join(f'"w{j}x{i}"' for i in range(1000)) + "\n" for j in range(21))}},
     "structured_outputs.grammar"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": f"w{i}"} for i in range(20001)]}}}, "response_format"),
])
def test_bad_schema_is_400(smol, body, param):
    model = httpx.get(smol.url + "/v1/models").json()["data"][0]["id"]
    r = httpx.post(smol.url + "/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    keyword = {"uniqueItems": "uniqueItems", "not": "not"}
    for k in keyword:
        if k in json.dumps(body):
            assert k in err["message"]


def test_a_grammar_past_the_engines_limits_later_in_its_output_is_400(smol):
    """A grammar that starts but runs past llguidance's lexer budget after its first tokens
    fails so in every run of the request: a 400 at its field (a 500 made the SDK retry it
    twice), or streamed, an error frame saying the same, then [DONE]."""
    model = httpx.get(smol.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Say a"}], "max_tokens": 20,
            "response_format": {"type": "regex", "regex": "a(.{1,999}){1,999}"}}
    r = httpx.post(smol.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_value", "response_format.regex")
    assert err["message"].startswith("The grammar ran past the grammar engine's limits while generating (lexer error")
    streamed = httpx.post(smol.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60).text
    frames = [f.removeprefix("data: ") for f in streamed.split("\n\n") if f]
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["param"] == "response_format.regex"
    # the routes that translate to chat name the field in their own terms, as their other errors do
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a(.{1,999}){1,999}$"}},
              "required": ["s"]}
    for route, extra, param in (
            ("/v1/responses", {"input": "Say a", "max_output_tokens": 20,
                               "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}},
             "text.format.schema"),
            ("/v1/messages", {"messages": [{"role": "user", "content": "Say a"}], "max_tokens": 20,
                              "output_config": {"format": {"type": "json_schema", "schema": schema}}},
             "output_config.format.schema")):
        r = httpx.post(smol.url + route, json={"model": model, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.text)
    assert httpx.get(smol.url + "/load").json()["running"] == 0


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": _obj({"city": _s(16), "unit": {"enum": ["c", "f"]}})}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": _obj({"tz": _s(12)})}}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def _check_calls(calls, names: set[str]):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


def test_tool_choice_required_and_named(client):
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]

    def call(**kw):
        return client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, TIME],
                                              max_tokens=60, temperature=0, **kw)

    with ThreadPoolExecutor(3) as pool:
        req, named, single = pool.map(lambda kw: call(**kw), [
            {"tool_choice": "required"},
            {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            {"tool_choice": "required", "parallel_tool_calls": False},
        ])
    # A named function forced finishes "stop", as OpenAI's; required finishes "tool_calls".
    for r, want in ((req, "tool_calls"), (named, "stop"), (single, "tool_calls")):
        assert r.choices[0].finish_reason == want, r.choices[0].message
        assert not r.choices[0].message.content
    _check_calls(req.choices[0].message.tool_calls, {"get_weather", "get_time"})
    _check_calls(named.choices[0].message.tool_calls, {"get_time"})
    assert len(named.choices[0].message.tool_calls) == 1
    _check_calls(single.choices[0].message.tool_calls, {"get_weather", "get_time"})
    assert len(single.choices[0].message.tool_calls) == 1
    # Allowing one call does not change a model's one call: the default JSON format forces a
    # list of one, the form the model writes (forced into a bare object, SmolLM2 wrote worse
    # arguments: audit 77).
    assert len(req.choices[0].message.tool_calls) == 1   # (the default model calls once here)
    ours, theirs = single.choices[0].message.tool_calls[0], req.choices[0].message.tool_calls[0]
    assert (ours.function.name, ours.function.arguments) == (theirs.function.name, theirs.function.arguments)


def test_tool_calls_streamed(client):
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0,
        stream=True,
    )
    pieces, finish, content = [], None, None
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content is not None:
                content = (content or "") + c.delta.content
            pieces.extend(c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    # forced calls have no content: none streams, not even the role chunk's "" (as non-streamed)
    assert finish == "stop" and content is None
    head = pieces[0]
    assert head.index == 0 and head.id.startswith("call_") and head.function.name == "get_weather"
    fragments = [p.function.arguments for p in pieces[1:]]
    assert len(fragments) > 1, "arguments should stream as they are generated"
    args = "".join(fragments)
    jsonschema.validate(json.loads(args), TOOL_SCHEMAS["get_weather"])
    assert all(p.index == 0 for p in pieces)
    whole = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0,
    )
    assert whole.choices[0].message.tool_calls[0].function.arguments == args
    assert whole.choices[0].message.content is None


def test_auto_without_a_format_is_text(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


class Unit(str, enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Place(BaseModel):
    city: str = Field(max_length=12)
    country: str = Field(max_length=12)


class GetForecast(BaseModel):
    """The forecast for a place."""
    place: Place
    unit: Unit
    days: int = Field(ge=1, le=7)


def test_sdk_pydantic_tool_with_refs_parses(client):
    """openai.pydantic_function_tool puts nested models and enums under `$defs`, referred to by
    `$ref`: a forced call follows them (they once failed to compile inside the call object),
    and the SDK's parse() fills `parsed_arguments`."""
    model = client.models.list().data[0].id
    tool = openai.pydantic_function_tool(GetForecast)
    assert "$defs" in tool["function"]["parameters"]
    for choice in ({"type": "function", "function": {"name": "GetForecast"}}, "required"):
        r = client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": "Forecast for Oslo, Norway, 3 days."}],
            tools=[tool], tool_choice=choice, parallel_tool_calls=False, max_tokens=120, temperature=0)
        call = r.choices[0].message.tool_calls[0]
        assert isinstance(call.function.parsed_arguments, GetForecast), call.function.arguments


def test_forced_arguments_hold_only_listed_keys(client):
    """A schema that lists its properties and says nothing of others gets only those (as
    vLLM's default grammar backend does): JSON Schema would let the model invent keys the
    function cannot take. Likewise for response_format."""
    model = client.models.list().data[0].id
    params = {"type": "object", "properties": {"city": _s(), "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city"]}
    tool = {"type": "function", "function": {"name": "forecast", "parameters": params}}
    prompts = ["Weather in Paris, and also the season, country and wind?", "Forecast for Rome, in detail."]
    for prompt in prompts:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], tools=[tool],
            tool_choice={"type": "function", "function": {"name": "forecast"}}, max_tokens=60, temperature=0.7, seed=1)
        args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
        assert set(args) <= {"city", "days"} and "city" in args, args
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt + " Answer in JSON."}], max_tokens=60,
            temperature=0.7, seed=1, response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": params}})
        value = json.loads(r.choices[0].message.content)
        assert set(value) <= {"city", "days"} and "city" in value, value
