"""Reasoning output end to end: a tiny model whose template opens a `<think>` block and whose
tokenizer has `<think>`/`</think>` as single tokens. Its thinking must come back as
`reasoning_content` and only the rest as `content`, streamed and not alike, and exactly the
split of the raw text the same sampling produces on /v1/completions (which is unaffected).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from server import ServerProcess
from tiny import CHATML, build_tokenizer

# Qwen3's shape: the generation prompt opens the think block unless enable_thinking is false,
# which closes an empty one instead.
THINK_TEMPLATE = CHATML.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}",
)
MESSAGES = [{"role": "user", "content": "Hello"}]


def _build(folder):
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    build_tokenizer(path)
    tok = Tokenizer.from_file(str(path))
    # Not special: like Qwen3's, they stay in the text with skip_special_tokens.
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.save(str(path))
    eos = tok.token_to_id("<|im_end|>")
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, rope_theta=10000.0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "chat_template": THINK_TEMPLATE,
    }))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder, tok.token_to_id("</think>")


@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    folder, close_id = _build(tmp_path_factory.mktemp("tiny-think"))
    server = ServerProcess(str(folder), "--served-model-name", "tiny", "--num-kv-blocks", "100")
    server.close_id = close_id
    yield server
    server.stop()


def _post(server, route, body):
    r = httpx.post(server.url + route, json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _stream(server, body):
    reasoning, content, usage = "", "", None
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "stream": True,
                            "stream_options": {"include_usage": True}, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                # (vLLM's current name and DeepSeek's: the same text under both)
                assert c["delta"].get("reasoning") == c["delta"].get("reasoning_content"), chunk
                reasoning += c["delta"].get("reasoning_content") or ""
                content += c["delta"].get("content") or ""
            usage = chunk.get("usage") or usage
    return reasoning, content, usage


def test_thinking_is_split_from_content(think_server):
    prompt = _post(think_server, "/v1/chat/completions/render", {"messages": MESSAGES}).json()["prompt"]
    assert prompt.endswith("<think>\n")
    sampling = {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True,
                "logit_bias": {str(think_server.close_id): 5}}
    # A seed whose raw output closes the block with text on both sides (the model is random).
    for seed in range(40):
        completion = _post(think_server, "/v1/completions",
                           {"prompt": prompt, "seed": seed, "logprobs": 0, **sampling}).json()
        raw = completion["choices"][0]["text"]
        before, sep, after = raw.partition("</think>")
        if sep and before and after:
            break
    else:
        pytest.fail("no seed closed the think block")
    assert "completion_tokens_details" not in completion["usage"]     # no parser on completions
    # the reasoning tokens: those before the one that closes the block (the prompt opened it)
    thinking = completion["choices"][0]["logprobs"]["tokens"].index("</think>")
    body = {"messages": MESSAGES, "seed": seed, **sampling}
    r = _post(think_server, "/v1/chat/completions", body).json()
    msg = r["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (before, after)
    assert msg["reasoning"] == msg["reasoning_content"]
    assert r["usage"]["completion_tokens"] == 12
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": thinking}
    reasoning, content, usage = _stream(think_server, body)
    assert (reasoning, content) == (before, after)
    assert usage["completion_tokens"] == 12
    assert usage["completion_tokens_details"] == {"reasoning_tokens": thinking}
    # every chunk's usage counts the tokens it carries, reasoning ones among them
    usages = []
    with httpx.stream("POST", think_server.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "stream": True, **body,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                usages.append(json.loads(line[6:])["usage"])
    counts = [(u["completion_tokens"], u["completion_tokens_details"]["reasoning_tokens"]) for u in usages]
    assert all(r <= c for c, r in counts), counts
    assert counts == sorted(counts) and counts[-1] == (12, thinking)
    # a stop string that begins like `</think>` holds text back without changing the count
    # (its text never comes: this random model's vocabulary has no `</a`)
    held = _post(think_server, "/v1/chat/completions", {**body, "stop": ["</answer>"]}).json()
    assert held["choices"][0]["message"] == msg
    assert held["usage"]["completion_tokens_details"] == {"reasoning_tokens": thinking}
    # vLLM's include_reasoning: false returns the same answer without its thinking, which
    # still counts; the logprobs list the answer's tokens alone
    hidden = {**body, "include_reasoning": False}
    resp = _post(think_server, "/v1/chat/completions", {**hidden, "logprobs": True})
    assert "llmserve-ignored-fields" not in resp.headers
    quiet = resp.json()
    assert quiet["choices"][0]["message"] == {**msg, "reasoning": None, "reasoning_content": None}
    assert quiet["usage"] == r["usage"]
    # (the answer's tokens: those after the one that closed the block)
    assert len(quiet["choices"][0]["logprobs"]["content"]) == 12 - thinking - 1
    assert _stream(think_server, hidden) == ("", after, usage)


def test_unterminated_thinking_is_all_reasoning(think_server):
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(think_server.close_id): -100}}
    r = _post(think_server, "/v1/chat/completions", {**body, "n": 2}).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"] is None   # no answer yet: null, as vLLM
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 12}   # both choices
    # an eos while thinking has no text, but it was generated inside the block
    eos = _post(think_server, "/tokenize", {"prompt": "<|im_end|>"}).json()["tokens"]
    assert len(eos) == 1
    r = _post(think_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6,
                                                     "logit_bias": {str(eos[0]): 100}}).json()
    assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == ("stop", 1)
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 1}
    assert _stream(think_server, body)[:2] == (msg["reasoning_content"], "")


def test_enable_thinking_false_reaches_the_template(think_server):
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    prompt = _post(think_server, "/v1/chat/completions/render", body).json()["prompt"]
    assert prompt.endswith("<think>\n\n</think>\n\n")
    # The block is closed in the prompt: output is content (no <think> can open one here).
    gen = {**body, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
           "logit_bias": {str(think_server.close_id - 1): -100}}
    r = _post(think_server, "/v1/chat/completions", gen).json()
    msg = r["choices"][0]["message"]
    assert msg["content"] and msg["reasoning_content"] is None
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_reasoning_effort_none_switches_the_thinking_off(think_server):
    # OpenAI's "no reasoning" is the template's own switch (Qwen3's enable_thinking: false)
    from openai import OpenAI

    with OpenAI(base_url=think_server.url + "/v1", api_key="x", max_retries=0) as client:
        render = _post(think_server, "/v1/chat/completions/render", {"messages": MESSAGES, "reasoning_effort": "none"})
        assert render.json()["prompt"].endswith("<think>\n\n</think>\n\n")
        gen = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0,
               "extra_body": {"ignore_eos": True, "logit_bias": {str(think_server.close_id - 1): -100}}}
        raw = client.chat.completions.with_raw_response.create(reasoning_effort="none", **gen)
        off = raw.parse()
        assert raw.headers.get("llmserve-ignored-fields") is None
        assert off.choices[0].message.content and off.usage.completion_tokens_details.reasoning_tokens == 0
        # the same tokens as the template's own switch
        switched = client.chat.completions.create(**{**gen, "extra_body": {
            **gen["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}})
        assert off.choices[0].message.content == switched.choices[0].message.content
        # a level thinks as the model does, and is reported: no amount of thinking follows from it
        raw = client.chat.completions.with_raw_response.create(reasoning_effort="low", **gen)
        assert raw.headers.get("llmserve-ignored-fields") == "reasoning_effort"
        assert raw.parse().usage.completion_tokens_details.reasoning_tokens == 6
        # Responses' reasoning.effort alike: no reasoning item
        resp = client.responses.create(model="tiny", input="Hello", max_output_tokens=6, temperature=0,
                                       reasoning={"effort": "none"},
                                       extra_body={"ignore_eos": True,
                                                   "logit_bias": {str(think_server.close_id - 1): -100}})
        assert [item.type for item in resp.output] == ["message"]
        assert resp.output_text == off.choices[0].message.content


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("thinking", [True, False])
def test_grammar_applies_after_the_reasoning(think_server, thinking):
    # The schema has no strings, so `</think>` can only close the thinking; the bias makes
    # the random model close it within a few tokens. The thinking is free text, the answer
    # after it must validate. Several seeds: some think for a while, some close at once.
    thought = False
    for seed in range(4):
        body = {"messages": MESSAGES, "max_tokens": 96, "temperature": 1.0, "seed": seed,
                "logit_bias": {str(think_server.close_id): 3},
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
        if not thinking:
            # The prompt closed an empty block; the model may not open another.
            body["chat_template_kwargs"] = {"enable_thinking": False}
            body["logit_bias"][str(think_server.close_id - 1)] = -100
        r = _post(think_server, "/v1/chat/completions", body).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        msg = choice["message"]
        jsonschema.validate(json.loads(msg["content"]), SCHEMA)
        if not thinking:
            assert msg["reasoning_content"] is None
        thought = thought or bool(msg["reasoning_content"])
        reasoning, content, _ = _stream(think_server, body)
        assert (reasoning or None, content) == (msg["reasoning_content"], msg["content"])
    assert thought == thinking


def _ids(server, text):
    return _post(server, "/tokenize", {"prompt": text}).json()["tokens"]


def test_thinking_token_budget_closes_the_block(think_server):
    # The bias keeps the random model from ever closing the block itself.
    close = think_server.close_id
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(close): -100}, "return_token_ids": True}
    free = _post(think_server, "/v1/chat/completions", body).json()
    assert close not in free["choices"][0]["token_ids"]
    r = _post(think_server, "/v1/chat/completions", {**body, "thinking_token_budget": 4})
    assert "llmserve-ignored-fields" not in r.headers
    bounded = r.json()
    choice, usage = bounded["choices"][0], bounded["usage"]
    # four tokens of thought (the unbounded run's first four), then `</think>`, then the answer
    ids = choice["token_ids"]
    assert ids[:4] == free["choices"][0]["token_ids"][:4] and ids[4] == close and close not in ids[5:]
    assert usage["completion_tokens"] == 10 and usage["completion_tokens_details"] == {"reasoning_tokens": 4}
    msg = choice["message"]
    assert _ids(think_server, msg["reasoning_content"]) == ids[:4]
    assert msg["content"]
    reasoning, content, streamed_usage = _stream(think_server, {**body, "thinking_token_budget": 4})
    assert (reasoning, content) == (msg["reasoning_content"], msg["content"])
    assert streamed_usage["completion_tokens_details"] == {"reasoning_tokens": 4}
    # 0: the block closes at once
    zero = _post(think_server, "/v1/chat/completions", {**body, "thinking_token_budget": 0}).json()
    assert zero["choices"][0]["token_ids"][0] == close
    assert zero["choices"][0]["message"]["reasoning_content"] is zero["choices"][0]["message"]["reasoning"] is None
    assert zero["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    # a budget the thinking never reaches changes nothing
    roomy = _post(think_server, "/v1/chat/completions", {**body, "thinking_token_budget": 10}).json()
    assert roomy["choices"] == free["choices"]
    # each sampled choice has its own budget
    sampled = {**body, "n": 3, "temperature": 1.0, "seed": 7, "thinking_token_budget": 2}
    r = _post(think_server, "/v1/chat/completions", sampled).json()
    assert [c["token_ids"][2] for c in r["choices"]] == [close] * 3
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}


def test_thinking_token_budget_with_a_grammar_and_a_step_planned_ahead(think_server, tmp_path):
    # The forced `</think>` is one the thinking's grammar allows, and the answer after it must
    # still validate. With --async-scheduling the next step is planned before this one's token
    # is known: a step that may be forced must wait for it, so the tokens are the same.
    close = think_server.close_id
    bodies = [{"messages": MESSAGES, "max_tokens": 64, "temperature": t, "seed": 3, "thinking_token_budget": b,
               "logit_bias": {str(close): -100}, "return_token_ids": True,
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
              for t, b in [(0, 3), (1.0, 5), (1.0, 0)]]
    bodies.append({"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "n": 2,
                   "thinking_token_budget": 1, "logit_bias": {str(close): -100}, "return_token_ids": True})
    answers = [_post(think_server, "/v1/chat/completions", b).json() for b in bodies]
    for body, r in zip(bodies, answers):
        budget = body["thinking_token_budget"]
        for c in r["choices"]:
            assert c["token_ids"][budget] == close, c
        if "response_format" in body:
            c = r["choices"][0]
            assert c["finish_reason"] == "stop"
            jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
            assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": budget}
    ahead = ServerProcess(str(think_server.model), "--served-model-name", "tiny", "--num-kv-blocks", "100",
                          "--async-scheduling", "on")
    try:
        for body, r in zip(bodies, answers):
            assert _post(ahead, "/v1/chat/completions", body).json()["choices"] == r["choices"]
    finally:
        ahead.stop()


def test_default_chat_template_kwargs_reach_every_chat_render(think_server, caplog):
    # (offline, one thread, beside the idle server: the flag's path from the config to the
    # router is the one `llmserve run` takes)
    from llmserve import LLM

    with caplog.at_level("INFO", logger="llmserve.engine"):
        llm = LLM(str(think_server.model), served_model_name=("tiny",), threads=1, num_kv_blocks=64,
                  default_chat_template_kwargs='{"enable_thinking": false, "nobody_reads": 1}')
    assert "the chat template never reads nobody_reads" in caplog.text
    params = {"max_tokens": 6, "temperature": 0, "ignore_eos": True,
              "logit_bias": {str(think_server.close_id - 1): -100}}
    off = llm.chat(MESSAGES, params)
    assert off.body["choices"][0]["message"]["reasoning_content"] is None and off.ignored_fields == ()
    closed = _post(think_server, "/v1/chat/completions", {"messages": MESSAGES, **params,
                                                         "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert (off.text, off.usage["prompt_tokens"]) == (closed["choices"][0]["message"]["content"],
                                                      closed["usage"]["prompt_tokens"])
    # the request's own value wins
    on = llm.chat(MESSAGES, {**params, "chat_template_kwargs": {"enable_thinking": True}})
    assert on.usage["prompt_tokens"] < off.usage["prompt_tokens"] and on.body["choices"][0]["message"]["reasoning"]
