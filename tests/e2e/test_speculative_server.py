"""`llmserve run --speculative-config` (n-gram drafts) on the default model, through the
official `openai` SDK: answers that copy their prompt confirm drafts (the spec_decode metrics
count them), a streamed answer is the answer sent whole (a step may now bring several tokens,
one chunk for them, and `--stream-interval 3` makes each chunk after the first wait for 3),
logprobs list every token once and in order, and stop strings, max_tokens and n end a choice
where they would without drafts. (tests/unit/test_speculation.py checks that the output is
the same bit for bit as without speculation.)"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server import ServerProcess

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
MESSAGES = [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smol():
    server = ServerProcess(None, "--max-model-len", "2048", "--kv-cache-memory", "256MiB",
                           "--speculative-config", json.dumps(SPEC), "--stream-interval", "3")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(smol):
    with openai.OpenAI(base_url=smol.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    return sum(values)


def test_a_streamed_answer_is_the_whole_one_and_drafts_are_confirmed(smol, client):
    before = _metric(smol, "llmserve:spec_decode_num_accepted_tokens_total")
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                           logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_lp = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    choice = whole.choices[0]
    assert text == choice.message.content
    # (the model copies the prompt's code, in its own words on some CPUs: drafts have something
    # to confirm, which the metrics below show)
    assert "(a, b):" in text, text
    assert [(t.token, t.logprob) for t in streamed_lp] == [(t.token, t.logprob) for t in choice.logprobs.content]
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # the first token goes at once, then each chunk waits for 3 (a step brings up to 5), the last
    # one brings the rest
    sizes = [len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs]
    assert sizes[0] == 1 and min(sizes[1:-1]) >= 3 and sum(sizes) == len(choice.logprobs.content), sizes
    # CONTRACT.md's stream shape holds with several tokens a step: one id, one finish chunk
    assert len({c.id for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert _metric(smol, "llmserve:spec_decode_num_accepted_tokens_total") > before
    drafts = _metric(smol, "llmserve:spec_decode_num_draft_tokens_total")
    assert drafts >= _metric(smol, "llmserve:spec_decode_num_accepted_tokens_total")
    per_pos = _metric(smol, "llmserve:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == _metric(smol, "llmserve:spec_decode_num_accepted_tokens_total")


def test_stops_and_lengths_end_a_choice_where_they_would(smol, client):
    # a stop string inside the copied code (a run of confirmed drafts): the text ends before it
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0)
    text = plain.choices[0].message.content
    second = text.find("def ", text.find("def ") + 1)     # (the second function the model wrote)
    assert second > 0, text
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                       stop=[text[second:second + 7]])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:second], (text, r.choices[0].message.content)
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3,"
    # max_tokens is exact however many drafts a step confirms
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=23, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 23
    assert r.choices[0].text.startswith(" 1, 2, 3, 1, 2, 3,")
    # a stop token id ends the choice at its first sample, not before min_tokens (banned until
    # then, in draft rows too)
    comma = httpx.post(smol.url + "/tokenize", json={"model": MODEL, "prompt": ","},
                       timeout=30).json()["tokens"][-1]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"stop_token_ids": [comma]})
    assert (r.choices[0].finish_reason, r.choices[0].text) == ("stop", " 1")
    # (a bias makes the comma the likeliest token at every sample: the fifth ends the choice)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                  logit_bias={str(comma): 100},
                                  extra_body={"stop_token_ids": [comma], "min_tokens": 4})
    assert r.choices[0].finish_reason == "stop" and "," not in r.choices[0].text
    assert r.usage.completion_tokens == 5
    # seeded choices, each its own sequence with its own drafts
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0.8, seed=3, n=3)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0.8, seed=3, n=3)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    assert r.usage.completion_tokens <= 90


def test_a_prediction_through_the_sdk(client):
    """OpenAI's Predicted Outputs: the SDK's `prediction` argument; the answer is the one
    without it, and usage counts the prediction's tokens it holds."""
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0)
    exact = plain.choices[0].message.content     # (what the model writes, on this CPU's arithmetic)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                       prediction={"type": "content", "content": exact})
    assert r.choices[0].message.content == plain.choices[0].message.content
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 40 and details.rejected_prediction_tokens <= 2
    assert plain.usage.completion_tokens_details is None
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, stream=True,
        stream_options={"include_usage": True}, prediction={"type": "content", "content": exact}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == details.accepted_prediction_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       prediction={"type": "content"})
    assert err.value.body["param"] == "prediction.content"


def test_a_schema_answer_drafts_inside_its_grammar(smol, client):
    """Drafts for a constrained answer: each draft row is masked after the drafts before it, so
    the answer validates, streamed or not, and its repeated structure confirms drafts."""
    schema = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}}
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "List four people with their name and age."}],
               max_tokens=100, temperature=0,
               response_format={"type": "json_schema", "json_schema": {"name": "people", "schema": schema}})
    before = _metric(smol, "llmserve:spec_decode_num_accepted_tokens_total")
    whole = client.chat.completions.create(**ask)
    people = json.loads(whole.choices[0].message.content)
    assert len(people) == 4 and all(set(p) == {"name", "age"} and isinstance(p["age"], int) for p in people)
    with client.chat.completions.create(**ask, stream=True) as stream:
        streamed = "".join(c.choices[0].delta.content or "" for c in stream)
    assert streamed == whole.choices[0].message.content
    assert _metric(smol, "llmserve:spec_decode_num_accepted_tokens_total") - before > 20
