"""Completions `echo` with `logprobs` returns the prompt tokens' logprobs too (OpenAI's shape):
the first prompt token has null logprob and null top_logprobs, every later one the log-softmax
of the model's raw logits given the tokens before it. Checked against an independent
computation: transformers' LlamaForCausalLM on the tiny model folder's weights."""

from __future__ import annotations

import json

import httpx
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog. Hello, world!"
K = 2
MAX_TOKENS = 3


def _post(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _tokenize(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def reference(tiny_model, tiny_server):
    """(prompt ids, logprob of each prompt token given the ones before it, top-K logprobs per
    position) from transformers, in float32."""
    import torch
    from transformers import LlamaForCausalLM

    ids = _tokenize(tiny_server, PROMPT)
    model = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    target = lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    top = lp[:-1].topk(K, dim=-1).values
    return ids, target.tolist(), top.tolist()


def _body(prompt, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "echo": True, "logprobs": K,
            "ignore_eos": True, **extra}


def _check_against_reference(lp: dict, reference) -> None:
    ids, target, top = reference
    n = len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + MAX_TOKENS
    assert len(lp["text_offset"]) == n + MAX_TOKENS
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == pytest.approx(target, abs=1e-4)
    for i in range(1, n + MAX_TOKENS):
        alts = lp["top_logprobs"][i]
        # Same shape as the generated tokens': at most K alternatives, most likely first, and
        # the token itself when they lack it (OpenAI: up to K + 1 entries).
        assert 1 <= len(alts) <= K + 1 and lp["tokens"][i] in alts
        values = list(alts.values())
        assert values == sorted(values, reverse=True)
        if i < n:
            # Two ids with one text keep the likelier one, so compare the best alternative.
            assert values[0] == pytest.approx(top[i - 1][0], abs=1e-4)
            assert lp["token_logprobs"][i] <= values[0] + 1e-4
    # The generated tokens keep their logprobs.
    assert all(isinstance(x, float) for x in lp["token_logprobs"][n:])


def test_prompt_logprobs_match_transformers(tiny_server, reference):
    ids = reference[0]
    r = _post(tiny_server, _body(ids))
    _check_against_reference(r["choices"][0]["logprobs"], reference)
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["usage"]["completion_tokens"] == MAX_TOKENS


def test_text_prompt_offsets_count_from_the_prompt_start(tiny_server, reference):
    ids = reference[0]
    n = len(ids)
    c = _post(tiny_server, _body(PROMPT))["choices"][0]
    lp = c["logprobs"]
    _check_against_reference(lp, reference)
    assert c["text"].startswith(PROMPT)
    assert "".join(lp["tokens"][:n]) == PROMPT
    assert lp["text_offset"][0] == 0
    for i in range(n):
        assert c["text"][lp["text_offset"][i]:].startswith(lp["tokens"][i])
    assert lp["text_offset"][n] == len(PROMPT), "completion offsets continue after the prompt"
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_prompt_logprobs_survive_the_prefix_cache_and_n(tiny_server, reference):
    # The same prompt again: its blocks are in the prefix cache, but the logprobs must still
    # cover every position (and n > 1 repeats them for each choice).
    r = _post(tiny_server, _body(reference[0], n=2))
    assert len(r["choices"]) == 2
    for c in r["choices"]:
        _check_against_reference(c["logprobs"], reference)


def test_streamed_prompt_logprobs_come_with_the_echo(tiny_server, reference):
    ids = reference[0]
    n = len(ids)
    plain = _post(tiny_server, _body(PROMPT))["choices"][0]
    with httpx.stream("POST", tiny_server.url + "/v1/completions",
                      json={"model": "tiny", "stream": True, **_body(PROMPT)}, timeout=60) as r:
        assert r.status_code == 200
        text = r.read().decode()
    frames = [f.removeprefix("data: ") for f in text.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f)["choices"][0] for f in frames[:-1]]
    first = chunks[0]
    assert first["text"].startswith(PROMPT)
    assert len(first["logprobs"]["tokens"]) >= n
    assert first["logprobs"]["token_logprobs"][0] is None
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.get("logprobs"):
            for key in merged:
                merged[key].extend(c["logprobs"][key])
    assert merged == plain["logprobs"]
    assert "".join(c["text"] for c in chunks) == plain["text"]


def test_chunked_prompt_lists_every_position_once(tiny_model, reference):
    # In process, with a small token budget: the prompt runs in several chunks, each giving the
    # logprobs of its own positions (the last one predicts the first chunk of the next).
    from llmserve.engine.offline import LLM

    llm = LLM(str(tiny_model), num_kv_blocks=64, max_num_batched_tokens=8)
    ids = reference[0]
    assert len(ids) > 16, "the prompt must span several chunks"
    params = {k: v for k, v in _body(ids).items() if k != "prompt"}
    out = llm.generate([ids, ids[:5]], params)
    _check_against_reference(out[0].body["choices"][0]["logprobs"], reference)
    short = out[1].body["choices"][0]["logprobs"]
    assert short["token_logprobs"][1:5] == pytest.approx(reference[1][:4], abs=1e-4)


def test_echo_with_max_tokens_0_returns_the_prompt_alone(tiny_server, reference):
    """Prompt scoring (vLLM, OpenAI's legacy API): `echo` and `max_tokens: 0` give the prompt,
    its logprobs when asked, and no completion; without `echo` (or on chat) 0 is a 400."""
    ids, target, _ = reference
    n = len(ids)
    r = _post(tiny_server, _body(PROMPT, max_tokens=0))
    c = r["choices"][0]
    assert (c["text"], c["finish_reason"]) == (PROMPT, "length")
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["text_offset"]) == n and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(target, abs=1e-4)
    assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) == (n, 0)
    with httpx.stream("POST", tiny_server.url + "/v1/completions",
                      json={"model": "tiny", "stream": True, **_body(PROMPT, max_tokens=0, n=2)},
                      timeout=60) as s:
        frames = [f.removeprefix("data: ") for f in s.read().decode().split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f)["choices"][0] for f in frames[:-1]]
    for i in (0, 1):
        mine = [ch for ch in chunks if ch["index"] == i]
        assert "".join(ch["text"] for ch in mine) == PROMPT
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]
    plain = _post(tiny_server, {"prompt": PROMPT, "echo": True, "max_tokens": 0})
    assert plain["choices"][0]["text"] == PROMPT and plain["choices"][0]["logprobs"] is None
    for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})):
        e = httpx.post(tiny_server.url + path, json={"model": "tiny", **body}, timeout=60)
        assert e.status_code == 400 and e.json()["error"]["param"] == "max_tokens", e.text


def test_a_continuation_the_model_ends_scores_with_its_eos(tiny_model, tiny_server, reference):
    """lm-eval's `local-completions` loglikelihood: `echo`, `max_tokens: 1`, and the last entry
    read as the sampled token (it sums `token_logprobs[ctxlen:-1]`). A sampled EOS is that
    entry (vLLM's and OpenAI's legacy completions list it), with the model's raw logprob, at
    the end of the text; usage counts it."""
    import torch
    from transformers import LlamaForCausalLM

    from tiny import SPECIALS

    ids = reference[0]
    eos = SPECIALS.index("<|im_end|>")
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0,
            "logit_bias": {str(eos): 100}}
    r = _post(tiny_server, body)
    c = r["choices"][0]
    lp = c["logprobs"]
    assert (c["text"], c["finish_reason"], r["usage"]["completion_tokens"]) == (PROMPT, "stop", 1)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids) + 1
    assert lp["tokens"][-1] == "<|im_end|>" and lp["text_offset"][-1] == len(PROMPT)
    model = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        last = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    assert lp["token_logprobs"][-1] == pytest.approx(last[eos].item(), abs=1e-4)   # (before logit_bias)
    with httpx.stream("POST", tiny_server.url + "/v1/completions",
                      json={"model": "tiny", "stream": True, **body}, timeout=60) as s:
        frames = [f.removeprefix("data: ") for f in s.read().decode().split("\n\n") if f.startswith("data: {")]
    streamed = [t for f in frames for ch in json.loads(f)["choices"] for t in ch["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


def test_prompt_scoring_may_fill_the_context(tiny_server):
    """`echo` + `max_tokens: 0` asks for no completion, so a prompt of exactly max_model_len
    (512 here) tokens is scored; one token more, or any completion, is over the limit."""
    ids = [(7 * i) % 200 + 10 for i in range(512)]
    r = _post(tiny_server, {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 1})
    c = r["choices"][0]
    assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"], c["finish_reason"]) == (512, 0, "length")
    assert len(c["logprobs"]["token_logprobs"]) == 512 and c["logprobs"]["token_logprobs"][0] is None
    for prompt, max_tokens in ((ids, 1), (ids + [10], 0)):
        e = httpx.post(tiny_server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "echo": True, "max_tokens": max_tokens})
        assert e.status_code == 400 and e.json()["error"]["code"] == "context_length_exceeded", e.text
    assert httpx.get(tiny_server.url + "/load").json()["running"] == 0


def test_prompt_offsets_of_multibyte_characters(tiny_model, tiny_server):
    """A character that takes several byte-level tokens: each of its tokens starts where the
    character does (its text is decoded only once whole), so the offsets index the echoed
    text and never go backwards; a token holding a space and a character's first byte starts
    at the space. Checked against the `tokenizers` package's decode of each token's prefix."""
    from tokenizers import Tokenizer

    prompt = "a😀🎉 日本語 b"
    ids = _tokenize(tiny_server, prompt)
    assert len(ids) > len(prompt), "the characters must span several tokens"
    c = _post(tiny_server, {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 2, "ignore_eos": True})["choices"][0]
    offsets = c["logprobs"]["text_offset"]
    assert len(offsets) == len(ids) + 2
    assert offsets == sorted(offsets)
    assert all(o < len(prompt) for o in offsets[:len(ids)])
    assert offsets[len(ids)] == len(prompt)
    # whole-character tokens sit where their text is
    tokens = c["logprobs"]["tokens"][:len(ids)]
    whole = [(t, o) for t, o in zip(tokens, offsets) if "\ufffd" not in t]
    assert len(whole) >= 3 and all(c["text"][o:].startswith(t) for t, o in whole), list(zip(tokens, offsets))
    # (the text before a token, less the U+FFFD of a character it is inside of)
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    assert offsets[:len(ids)] == [len(tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]


@pytest.fixture(scope="module")
def ranked(tiny_model):
    """A function: prompt ids -> per position after the first, (logprob of the token, its rank,
    top-K (id, logprob)) from transformers in float32; the rank counts the tokens at least as
    likely as it, itself included (vLLM's)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()

    def run(ids: list[int]) -> list[tuple[float, int, list[tuple[int, float]]]]:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]
        target = lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1))
        ranks = (lp >= target).sum(dim=1)
        top = lp.topk(K, dim=-1)
        return [(t, int(r), list(zip(i, v))) for t, r, i, v in
                zip(target.squeeze(1).tolist(), ranks.tolist(), top.indices.tolist(), top.values.tolist())]
    return run


def _check_prompt_logprobs(entries: list, ids: list[int], expected) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for entry, token, (target, rank, top) in zip(entries[1:], ids[1:], expected):
        keys = list(entry)
        assert keys[0] == str(token), "the prompt token comes first"
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(target, abs=1e-4)
        # (a near-tie may rank differently in another float order)
        assert abs(own["rank"] - rank) <= 1, (own, rank)
        assert isinstance(own["decoded_token"], str)
        for r, (tid, value) in enumerate(top, 1):
            if tid != token:
                assert entry[str(tid)]["logprob"] == pytest.approx(value, abs=1e-4)
                assert entry[str(tid)]["rank"] == r
        assert len(entry) in (K, K + 1)


def test_vllm_prompt_logprobs_match_transformers(tiny_server, reference, ranked):
    """vLLM's `prompt_logprobs` k, without `echo`: each choice (completions) or the body (chat)
    lists null, then per prompt token its logprob, rank and decoded text, and k alternatives
    with theirs; also when the prompt's blocks are already cached, and on a chat prompt."""
    ids = reference[0]
    expected = ranked(ids)
    for _ in range(2):          # the second time the prefix cache holds the prompt
        r = _post(tiny_server, {"prompt": ids, "max_tokens": 2, "prompt_logprobs": K, "n": 2, "temperature": 0})
        for c in r["choices"]:
            _check_prompt_logprobs(c["prompt_logprobs"], ids, expected)
            assert c["logprobs"] is None and c["text"] and not c["text"].startswith(PROMPT)
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    chat_ids = httpx.post(tiny_server.url + "/tokenize", json={"model": "tiny", "messages": messages},
                          timeout=60).json()["tokens"]
    r = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": 2, "prompt_logprobs": K}).json()
    _check_prompt_logprobs(r["prompt_logprobs"], chat_ids, ranked(chat_ids))
    e = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "prompt_logprobs": 1, "stream": True})
    assert e.status_code == 400 and e.json()["error"]["param"] == "prompt_logprobs", e.text
