"""Speculative decoding with n-gram drafts (--speculative-config, vLLM's `ngram` method).

The scheduler's own tests (rust/scheduler/tests/speculation.rs, ahead.rs) pin the plan a step
with drafts gets and what commit keeps. Here: the flag's rules, the metrics, and the whole
engine on the default model (GGUF blocks, the Rust decode path): a step that checks drafts
computes each token as the decode step after it would, so greedy and seeded output, logprobs
included, is the same bit for bit with speculation as without, while drafts are confirmed."""

from __future__ import annotations

import json

import pytest

from llmserve.config import SchedulerConfig
from llmserve.engine.metrics import Metrics


@pytest.mark.parametrize("given, read", [
    ({"method": "ngram", "num_speculative_tokens": 4}, (4, 5, 5)),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, (3, 4, 4)),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}, (3, 2, 2)),
    ({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}, (2, 1, 3)),
])
def test_the_flag_reads_as_vllm_reads_it(given, read):
    got = SchedulerConfig(speculative_config=json.dumps(given)).speculation()
    assert (got["num_tokens"], got["lookup_min"], got["lookup_max"]) == read
    assert SchedulerConfig().speculation() is None


@pytest.mark.parametrize("given, says", [
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    # (one range in every message: a step checks all its drafts, 64 at most)
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a whole number from 1 to 64, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "must be a whole number"),
    ({"method": "ngram", "num_speculative_tokens": 65}, "num_speculative_tokens must be a whole number from 1 to 64, got 65"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be a whole number from 1 to 2147483647"),
    ({"num_speculative_tokens": 4, "prompt_lookup_max": 3}, "`method` is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "only \"ngram\" (prompt lookup) is served"),
    ({"model": "org/draft", "num_speculative_tokens": 2}, "there is no draft model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4},
     "disable_by_batch_size: the n-gram method reads only"),
    ([1], "must be a JSON object"),
])
def test_a_bad_flag_is_named(given, says):
    with pytest.raises(ValueError, match="--speculative-config") as err:
        SchedulerConfig(speculative_config=json.dumps(given))
    assert says in str(err.value)


def test_the_spec_decode_counters_follow_the_engines_counts():
    m = Metrics()
    m.bind("m")
    base = {"running": 1, "waiting": 0, "kv_cache_usage": 0.1, "preemptions": 0, "prefix_hit_tokens": 0,
            "prefix_query_tokens": 0}
    m.on_step({**base, "spec_drafts": 2, "spec_draft_tokens": 6, "spec_accepted_tokens": 3,
               "spec_accepted_per_pos": [2, 1, 0]}, 0.01)
    m.on_step({**base, "spec_drafts": 3, "spec_draft_tokens": 9, "spec_accepted_tokens": 5,
               "spec_accepted_per_pos": [3, 1, 1]}, 0.01)
    value = lambda name, **labels: m.registry.get_sample_value(name, {"model_name": "m", **labels})  # noqa: E731
    assert value("llmserve:spec_decode_num_drafts_total") == 3
    assert value("llmserve:spec_decode_num_draft_tokens_total") == 9
    assert value("llmserve:spec_decode_num_accepted_tokens_total") == 5
    assert [value("llmserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(3)] == [3, 1, 1]


# Text the answer copies (drafts come from the prompt) and repeats (drafts from the output).
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
PEOPLE = {"type": "array", "minItems": 4, "maxItems": 4, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"cities": {"type": "array", "items": {"type": "string"}}},
    "required": ["cities"]}}}
REQUESTS = [
    # (kind, body)
    ("chat", {"messages": [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}],
              "max_tokens": 60, "temperature": 0, "logprobs": True, "top_logprobs": 3}),
    ("chat", {"messages": [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}],
              "max_tokens": 60, "temperature": 0.7, "top_p": 0.9, "seed": 11, "n": 2, "logprobs": True}),
    ("chat", {"messages": [{"role": "user", "content": "Count: one two three one two three one two"}],
              "max_tokens": 40, "temperature": 0, "frequency_penalty": 0.3, "repetition_penalty": 1.05,
              "min_tokens": 5, "logit_bias": {"28": -2}}),
    ("completion", {"prompt": CODE + CODE + "def add(a, b):\n", "max_tokens": 50, "temperature": 0,
                    "stop": ["def mul"], "logprobs": 2}),
    ("completion", {"prompt": "a b c a b c a b c a b", "max_tokens": 30, "temperature": 0.9, "seed": 5,
                    "bad_words": ["c a"], "min_p": 0.05}),
    # grammars: each draft row is masked after the drafts before it (a schema whose output repeats
    # itself confirms drafts; a forced call's arguments)
    ("chat", {"messages": [{"role": "user", "content": "Give me a JSON object with a key a."}],
              "max_tokens": 30, "temperature": 0, "response_format": {"type": "json_object"}}),
    ("chat", {"messages": [{"role": "user", "content": "List four people with their name and age as JSON."}],
              "max_tokens": 80, "temperature": 0, "logprobs": True, "response_format": {
                  "type": "json_schema", "json_schema": {"name": "people", "schema": PEOPLE}}}),
    ("chat", {"messages": [{"role": "user", "content": "What is the weather in Paris and in Rome?"}],
              "max_tokens": 60, "temperature": 0.6, "seed": 3, "tools": [WEATHER],
              "tool_choice": {"type": "function", "function": {"name": "weather"}}}),
]


def _answers(requests=REQUESTS, **options) -> tuple[list[dict], dict]:
    from llmserve import LLM

    llm = LLM(None, threads=1, max_model_len=512, num_kv_blocks=128, **options)
    bodies = []
    for kind, body in requests:
        result = (llm.chat(body["messages"], {k: v for k, v in body.items() if k != "messages"}) if kind == "chat"
                  else llm.generate(body["prompt"], {k: v for k, v in body.items() if k != "prompt"})[0])
        for call in (c for choice in result.body["choices"] for c in (choice.get("message") or {}).get("tool_calls") or []):
            call["id"] = "call"     # (random)
        bodies.append({"choices": result.body["choices"], "usage": result.body["usage"]})
    return bodies, llm.engine.core.stats()


def test_speculation_changes_no_output_on_the_default_model():
    plain, _ = _answers()
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                       "prompt_lookup_min": 1})
    drafted, stats = _answers(speculative_config=spec)
    for (kind, body), a, b in zip(REQUESTS, plain, drafted):
        assert a == b, (kind, body)
    assert stats["spec_drafts"] > 20 and stats["spec_accepted_tokens"] > 20, stats
    assert stats["spec_accepted_tokens"] == sum(stats["spec_accepted_per_pos"])
    assert stats["used_blocks"] == 0


def test_a_grammar_request_confirms_drafts():
    """A schema's answer that repeats its own structure confirms drafts (each draft row masked
    after the drafts before it), and is the answer without them."""
    people = [r for r in REQUESTS if "json_schema" in str(r[1].get("response_format"))]
    plain, _ = _answers(people)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    drafted, stats = _answers(people, speculative_config=spec)
    assert drafted == plain
    assert json.loads(plain[0]["choices"][0]["message"]["content"])
    assert stats["spec_accepted_tokens"] > 20, stats


def _batch(**options) -> list[dict]:
    from llmserve import LLM

    # (a small token budget: long prompts are computed in chunks while the others decode, so
    # steps hold prompt tokens beside generated ones and drafts)
    llm = LLM(None, threads=1, max_model_len=512, num_kv_blocks=128, max_num_batched_tokens=16, **options)
    convs = [[{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE * k}] for k in (1, 2, 3)]
    results = llm.chat(convs, {"max_tokens": 48, "temperature": 0, "logprobs": True})
    return [r.body["choices"] for r in results]


def test_drafts_beside_prompt_chunks_change_no_output():
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                       "prompt_lookup_min": 1})
    assert _batch() == _batch(speculative_config=spec)


def test_a_predicted_output_drafts_without_changing_the_answer():
    """Chat's `prediction` (OpenAI's Predicted Outputs): with no --speculative-config the
    engine drafts from it, the answer is the one without it, and usage counts the
    prediction's tokens the answer holds (accepted) and the rest (rejected)."""
    from llmserve import LLM

    llm = LLM(None, threads=1, max_model_len=512, num_kv_blocks=128)
    messages = [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}]
    params = {"max_tokens": 60, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    plain = llm.chat(messages, params)
    before = llm.engine.core.stats()["spec_accepted_tokens"]
    # (what the model writes is the exact prediction: its copy of the code differs with the
    # CPU's arithmetic, AVX512-BF16 prompt steps or not)
    exact = plain.text
    third = len(exact) // 3
    edited = exact[:third] + "# an edit the answer does not hold\n" + exact[third:]
    answers = {}
    for name, prediction in (("exact", exact), ("edited", edited), ("unrelated", "Bonjour, le monde !"),
                             ("parts", [{"type": "text", "text": exact[:20]}, {"type": "text", "text": exact[20:]}])):
        result = llm.chat(messages, {**params, "prediction": {"type": "content", "content": prediction}})
        assert result.body["choices"] == plain.body["choices"], name
        assert result.usage["completion_tokens"] == plain.usage["completion_tokens"]
        answers[name] = result.usage["completion_tokens_details"]
    exact_len = answers["exact"]["accepted_prediction_tokens"] + answers["exact"]["rejected_prediction_tokens"]
    assert answers["parts"] == answers["exact"]
    assert answers["exact"]["rejected_prediction_tokens"] <= 2 < answers["exact"]["accepted_prediction_tokens"]
    assert answers["edited"]["rejected_prediction_tokens"] > answers["exact"]["rejected_prediction_tokens"]
    assert answers["unrelated"]["accepted_prediction_tokens"] <= 2
    assert exact_len > 40
    assert "completion_tokens_details" not in plain.usage
    stats = llm.engine.core.stats()
    assert stats["spec_accepted_tokens"] - before > 20, stats
    assert stats["used_blocks"] == 0
