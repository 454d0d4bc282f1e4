"""The contract's request semantics over HTTP on the tiny random model: n, seed, penalties,
top_k / top_p / min_p, min_tokens, ignore_eos, logit_bias, stop strings and stop token ids,
special tokens, logprobs in both shapes, echo, prompt shapes and streaming usage; vLLM's
sampling extensions (bad_words, allowed_token_ids) and its beam search.

The model is random, so assertions are about structure and accounting, or compare one
request against another (greedy vs. a setting that must equal or must change greedy).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server import ServerProcess

EOS = 2  # <|im_end|> in tests/tiny.py
IM_START = 1


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)


def _ok(server, path: str, body: dict) -> dict:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def _tokenize(server, text: str) -> list[int]:
    return _ok(server, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]


def _stream_chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={"model": "tiny", "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200
        text = r.read().decode()
    frames = [f.removeprefix("data: ") for f in text.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def _greedy_chat(server, **extra) -> dict:
    return _ok(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "logprobs": True, **extra})


def _token_bytes(chat_body: dict) -> list[tuple]:
    return [tuple(e["bytes"]) for e in chat_body["choices"][0]["logprobs"]["content"]]


# -- n and seed ----------------------------------------------------------------------------

def test_n_streams_end_each_choice_with_exactly_one_finish_chunk(tiny_server):
    chunks = _stream_chunks(tiny_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "n": 3, "max_tokens": 5, "temperature": 0.9,
        "ignore_eos": True, "stream_options": {"include_usage": True}})
    finishes: dict[int, list[str]] = {}
    roles: dict[int, int] = {}
    for ch in chunks:
        for c in ch["choices"]:
            if c["finish_reason"]:
                finishes.setdefault(c["index"], []).append(c["finish_reason"])
            if c["delta"].get("role") == "assistant":
                roles[c["index"]] = roles.get(c["index"], 0) + 1
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert roles == {0: 1, 1: 1, 2: 1}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 15
    # OpenAI documents `usage: null` on every chunk before the usage chunk
    assert all("usage" in ch and ch["usage"] is None for ch in chunks[:-1])
    comp = _stream_chunks(tiny_server, "/v1/completions", {
        "prompt": ["Hello", "Numbers"], "n": 2, "max_tokens": 4, "ignore_eos": True})
    ends = sorted(c["index"] for ch in comp for c in ch["choices"] if c["finish_reason"])
    assert ends == [0, 1, 2, 3]


def test_seed_reproducible_in_chat_with_n(tiny_server):
    body = {"messages": [{"role": "user", "content": "Tell"}], "n": 2, "max_tokens": 12, "temperature": 1.0,
            "seed": 77, "ignore_eos": True, "logprobs": True}
    a = _ok(tiny_server, "/v1/chat/completions", body)
    b = _ok(tiny_server, "/v1/chat/completions", body)
    runs = [[tuple(e["bytes"]) for c in r["choices"] for e in c["logprobs"]["content"]] for r in (a, b)]
    assert runs[0] == runs[1]
    # The forks of one seeded request draw different streams.
    assert a["choices"][0]["logprobs"]["content"] != a["choices"][1]["logprobs"]["content"]


# -- penalties and truncation --------------------------------------------------------------

@pytest.mark.parametrize("field,bad,good", [
    ("presence_penalty", 2.5, 1.5), ("frequency_penalty", -2.5, -1.0), ("repetition_penalty", 0, 1.3),
    ("top_k", -2, 5), ("min_p", 1.5, 0.1), ("top_p", 1.1, 0.0), ("temperature", -0.1, 0.0),
])
def test_sampling_ranges_are_validated(tiny_server, field, bad, good):
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = _post(tiny_server, "/v1/chat/completions", {**base, field: bad})
    assert r.status_code == 400
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (field, "invalid_value")
    assert _post(tiny_server, "/v1/chat/completions", {**base, field: good}).status_code == 200


def test_penalties_change_greedy_output(tiny_server):
    plain = _token_bytes(_greedy_chat(tiny_server))
    assert len(set(plain)) < len(plain), "the greedy baseline repeats a token"
    # A penalty of 2 outweighs the tiny model's logit spread: no token may come twice.
    for field in ("frequency_penalty", "presence_penalty"):
        toks = _token_bytes(_greedy_chat(tiny_server, **{field: 2.0}))
        assert len(set(toks)) == len(toks), field
    assert _token_bytes(_greedy_chat(tiny_server, repetition_penalty=50.0)) != plain


def test_top_k_1_min_p_1_and_top_p_0_are_greedy(tiny_server):
    greedy = _token_bytes(_greedy_chat(tiny_server))
    hot = _token_bytes(_greedy_chat(tiny_server, temperature=1.5))
    assert hot != greedy  # sampling at 1.5 on a flat distribution really samples
    for extra in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 0.0}):
        assert _token_bytes(_greedy_chat(tiny_server, temperature=1.5, **extra)) == greedy, extra


# -- stopping ------------------------------------------------------------------------------

def test_eos_ignore_eos_and_min_tokens(tiny_server):
    force_eos = {"logit_bias": {str(EOS): 100}, "max_tokens": 10}
    msgs = {"messages": [{"role": "user", "content": "Hi"}]}
    r = _ok(tiny_server, "/v1/chat/completions", {**msgs, **force_eos})
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1
    r = _ok(tiny_server, "/v1/chat/completions", {**msgs, **force_eos, "ignore_eos": True})
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 10
    # min_tokens bans eos (even a +100-biased one) until 4 tokens exist; then it fires.
    r = _ok(tiny_server, "/v1/chat/completions", {**msgs, **force_eos, "min_tokens": 4})
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 5


def test_stop_token_ids_and_min_tokens(tiny_server):
    tok = _tokenize(tiny_server, "Hello")[0]
    body = {"prompt": "Numbers", "logit_bias": {str(tok): 100}, "stop_token_ids": [tok], "max_tokens": 10,
            "ignore_eos": True}
    r = _ok(tiny_server, "/v1/completions", body)
    c = r["choices"][0]
    assert (c["finish_reason"], r["usage"]["completion_tokens"]) == ("stop", 1)
    assert c["text"] == ""  # a stop token's text is not output
    assert c["stop_reason"] == tok  # the id, as vLLM reports it
    r = _ok(tiny_server, "/v1/completions", {**body, "min_tokens": 3})
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 4
    assert r["choices"][0]["stop_reason"] == tok
    # eos ends a sequence without a stop_reason, even when also listed.
    eos = _tokenize(tiny_server, "<|im_end|>")[0]
    r = _ok(tiny_server, "/v1/completions", {"prompt": "Numbers", "logit_bias": {str(eos): 100},
                                             "stop_token_ids": [eos], "max_tokens": 10})
    assert (r["choices"][0]["finish_reason"], r["choices"][0]["stop_reason"]) == ("stop", None)


def _spanning_stop(server, prompt: str) -> tuple[str, str]:
    """The greedy text of `prompt` and a 2-character stop string made of the last character of
    one token and the first of the next (so it spans tokens and is really hit)."""
    r = _ok(server, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                        "ignore_eos": True, "logprobs": 0})
    text = r["choices"][0]["text"]
    lp = r["choices"][0]["logprobs"]
    # (offsets count from the start of the prompt: OpenAI's legacy completions)
    toks, offs = lp["tokens"], [o - len(prompt) for o in lp["text_offset"]]
    for i in range(1, len(toks)):
        a, b = toks[i - 1], toks[i]
        clean = all(s and s.isascii() and s.isprintable() for s in (a, b))
        if clean and offs[i] == offs[i - 1] + len(a) and text[offs[i]:offs[i] + len(b)] == b:
            return text, a[-1] + b[0]
    raise AssertionError(f"no clean token boundary in {toks!r}")


@pytest.mark.parametrize("prompt", ["Hello world", "Numbers: 1 2", "def add"])
def test_stop_string_spanning_tokens(tiny_server, prompt):
    text, stop = _spanning_stop(tiny_server, prompt)
    cut = text.index(stop)
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    c = _ok(tiny_server, "/v1/completions", body)["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == (text[:cut], "stop", stop)
    chunks = _stream_chunks(tiny_server, "/v1/completions", body)
    pieces = [ch["choices"][0]["text"] for ch in chunks if ch["choices"]]
    assert "".join(pieces) == text[:cut]
    assert not any(stop[0] in p and stop in p for p in pieces)
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "stop"
    kept = _ok(tiny_server, "/v1/completions", {**body, "include_stop_str_in_output": True})
    assert kept["choices"][0]["text"] == text[:cut] + stop
    kept_stream = _stream_chunks(tiny_server, "/v1/completions", {**body, "include_stop_str_in_output": True})
    assert "".join(ch["choices"][0]["text"] for ch in kept_stream if ch["choices"]) == text[:cut] + stop
    # text_offset counts the untrimmed text, as vLLM does: the same tokens get the same
    # offsets whether or not a stop string held their text back or trimmed it.
    full = _ok(tiny_server, "/v1/completions", {**body, "stop": None, "logprobs": 0})["choices"][0]["logprobs"]
    cut_lp = _ok(tiny_server, "/v1/completions", {**body, "logprobs": 0})["choices"][0]["logprobs"]
    n = len(cut_lp["tokens"])
    assert cut_lp["tokens"] == full["tokens"][:n]
    assert cut_lp["text_offset"] == full["text_offset"][:n]


def test_skip_special_tokens(tiny_server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "logit_bias": {str(IM_START): 100}}
    shown = _ok(tiny_server, "/v1/chat/completions", {**body, "skip_special_tokens": False})
    assert shown["choices"][0]["message"]["content"] == "<|im_start|>" * 3
    hidden = _ok(tiny_server, "/v1/chat/completions", body)
    assert hidden["choices"][0]["message"]["content"] == ""
    assert hidden["usage"]["completion_tokens"] == 3


# -- logit_bias ----------------------------------------------------------------------------

def test_logit_bias_bans_and_forces(tiny_server):
    # Find a prompt whose greedy first token is a clean single token we can name by id.
    for prompt in ("Hello world", "The quick brown fox", "Numbers: 1 2", "def add", "user assistant"):
        first = _ok(tiny_server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                     "logprobs": 0})["choices"][0]["logprobs"]["tokens"][0]
        ids = _tokenize(tiny_server, first) if first.isascii() and first.isprintable() else []
        if len(ids) == 1:
            break
    else:
        raise AssertionError("no prompt with a clean greedy first token")
    banned = _ok(tiny_server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                  "logprobs": 0, "logit_bias": {str(ids[0]): -100}})
    assert banned["choices"][0]["logprobs"]["tokens"][0] != first
    forced_id = _tokenize(tiny_server, "fox")[0]
    forced_text = _ok(tiny_server, "/detokenize", {"tokens": [forced_id]})["prompt"]
    forced = _ok(tiny_server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 1.0,
                                                  "ignore_eos": True, "logit_bias": {str(forced_id): 100}})
    assert forced["choices"][0]["text"] == forced_text * 4
    for bad, param in (({"5": 101}, "logit_bias.5"), ({"99999": 1}, "logit_bias.99999"),
                       ({"x": 1}, "logit_bias.x")):
        r = _post(tiny_server, "/v1/completions", {"prompt": "x", "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param


# -- logprobs, echo and prompt shapes --------------------------------------------------------

def test_chat_logprobs_limits(tiny_server):
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = _ok(tiny_server, "/v1/chat/completions", {**base, "logprobs": True, "top_logprobs": 20})
    for e in r["choices"][0]["logprobs"]["content"]:
        assert len(e["top_logprobs"]) == 20
        assert {"token", "logprob", "bytes", "top_logprobs"} <= set(e)
        lps = [t["logprob"] for t in e["top_logprobs"]]
        assert lps == sorted(lps, reverse=True)
    for extra, param in (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"top_logprobs": 2}, "top_logprobs"),
                         ({"logprobs": False, "top_logprobs": 2}, "top_logprobs")):
        e = _post(tiny_server, "/v1/chat/completions", {**base, **extra})
        assert e.status_code == 400 and e.json()["error"]["param"] == param, extra
    plain = _ok(tiny_server, "/v1/chat/completions", base)
    assert plain["choices"][0]["logprobs"] is None


def test_completion_logprobs_shape_and_text_offset(tiny_server):
    r = _ok(tiny_server, "/v1/completions", {"prompt": "The quick", "max_tokens": 8, "logprobs": 3,
                                             "ignore_eos": True, "temperature": 0})
    c = r["choices"][0]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 8
    # offsets index prompt + text, echoed or not, as OpenAI's legacy completions count them
    assert lp["text_offset"][0] == len("The quick")
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] <= len("The quick" + c["text"])
    echoed = _ok(tiny_server, "/v1/completions", {"prompt": "The quick", "max_tokens": 8, "logprobs": 3,
                                                  "ignore_eos": True, "echo": True, "temperature": 0})
    echoed = echoed["choices"][0]["logprobs"]
    assert echoed["text_offset"][-8:] == lp["text_offset"]
    chunks = _stream_chunks(tiny_server, "/v1/completions", {"prompt": "The quick", "max_tokens": 8, "logprobs": 3,
                                                             "ignore_eos": True, "temperature": 0})
    streamed = [o for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]
                for o in ch["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == lp["text_offset"]
    # the 3 likeliest, and the token itself when it is not among them (OpenAI: logprobs + 1)
    assert all(1 <= len(t) <= 4 for t in lp["top_logprobs"])
    assert all(tok in top for tok, top in zip(lp["tokens"], lp["top_logprobs"]))
    zero = _ok(tiny_server, "/v1/completions", {"prompt": "The quick", "max_tokens": 4, "logprobs": 0,
                                                "ignore_eos": True})["choices"][0]["logprobs"]
    assert [list(t) for t in zero["top_logprobs"]] == [[tok] for tok in zero["tokens"]]
    e = _post(tiny_server, "/v1/completions", {"prompt": "x", "logprobs": 21})
    assert e.status_code == 400 and e.json()["error"]["param"] == "logprobs"


def test_echo_prepends_prompt_with_prompt_logprobs(tiny_server):
    r = _ok(tiny_server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 3, "echo": True,
                                             "ignore_eos": True})
    assert r["choices"][0]["text"].startswith("Hello world")
    # With logprobs the prompt tokens come first (the first one without a logprob), as OpenAI.
    n = len(_tokenize(tiny_server, "Hello world"))
    r = _ok(tiny_server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 3, "echo": True,
                                             "logprobs": 1, "ignore_eos": True})
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"][:n]) == "Hello world"


def test_list_of_token_id_prompts_usage(client, tiny_server):
    a, b = _tokenize(tiny_server, "Hello world"), _tokenize(tiny_server, "def add(a, b)")
    r = client.completions.create(model="tiny", prompt=[a, b], max_tokens=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.prompt_tokens == len(a) + len(b)
    assert r.usage.completion_tokens == 6


# -- streaming -----------------------------------------------------------------------------

def test_continuous_usage_stats(tiny_server):
    chunks = _stream_chunks(tiny_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert all(ch.get("usage") for ch in chunks)
    prompt = {ch["usage"]["prompt_tokens"] for ch in chunks}
    assert len(prompt) == 1
    done = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert done == sorted(done) and done[-1] == 6
    assert all(ch["usage"]["total_tokens"] == ch["usage"]["prompt_tokens"] + ch["usage"]["completion_tokens"]
               for ch in chunks)
    assert chunks[-1]["choices"] == []
    no_usage = _stream_chunks(tiny_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert not any(ch.get("usage") for ch in no_usage)


def test_completion_stream_equals_non_stream_greedy_with_n(tiny_server):
    body = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "n": 2, "ignore_eos": True}
    whole = _ok(tiny_server, "/v1/completions", body)
    texts = {c["index"]: c["text"] for c in whole["choices"]}
    streamed: dict[int, str] = {0: "", 1: ""}
    for ch in _stream_chunks(tiny_server, "/v1/completions", body):
        for c in ch["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == texts


def test_best_of_returns_the_likeliest_of_its_candidates(client):
    """`best_of` above `n` runs best_of choices and returns the n with the highest mean
    logprob per sampled token. A seed fixes each choice's tokens whatever else is asked, so
    the candidates are the choices of the same request with `n` = best_of: the ones returned
    are its likeliest (here every token is listed: no eos is sampled, `max_tokens` ends each)."""
    req = dict(model="tiny", prompt="The sky is", max_tokens=6, temperature=1.0, seed=11,
               extra_body={"ignore_eos": True})
    candidates = client.completions.create(**req, n=4, logprobs=0).choices
    mean = {c.text: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in candidates}
    assert len(set(mean.values())) == 4, "four different candidates"
    best = sorted(candidates, key=lambda c: -mean[c.text])[:2]

    r = client.completions.create(**req, n=2, best_of=4)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [c.text for c in best]
    assert all(c.logprobs is None for c in r.choices), "not asked for: computed only to rank"
    assert r.usage.completion_tokens == 4 * 6, "every candidate is counted, as OpenAI bills them"
    shown = client.completions.create(**req, n=1, best_of=4, logprobs=1)
    assert shown.choices[0].text == best[0].text
    assert shown.choices[0].logprobs.token_logprobs == best[0].logprobs.token_logprobs
    # greedy candidates are all one, computed once, yet each is counted as OpenAI bills it
    greedy = client.completions.create(**{**req, "temperature": 0}, n=1, best_of=3)
    alone = client.completions.create(**{**req, "temperature": 0}, n=1)
    assert [c.text for c in greedy.choices] == [c.text for c in alone.choices]
    assert greedy.usage.completion_tokens == 3 * 6


def _holds(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_bad_words_are_never_generated(tiny_server, tiny_model):
    """vLLM's `bad_words`: each tokenization vLLM bans (the word alone, and after a space),
    computed here with `tokenizers`, never appears in the output, whatever would come
    otherwise."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))

    def bans(word):
        alone = tok.encode(word.lstrip(), add_special_tokens=False).ids
        inside = tok.encode(" " + word.lstrip(), add_special_tokens=False).ids
        return [alone] + ([inside] if len(inside) == len(alone) and inside[0] != alone[0] else [])

    # one token: the greedy answer's first token that a word spells again (a random model
    # writes pieces of characters too, which no text tokenizes back to)
    body = {"prompt": "The quick brown", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    greedy = _ok(tiny_server, "/v1/completions", body)["choices"][0]["token_ids"]
    word, banned = next((w, b) for t in greedy for w in [tok.decode([t])] for b in [bans(w)] if [t] in b)
    for route, extra in (("/v1/completions", {"prompt": "The quick brown"}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "The quick brown"}]})):
        req = {**{k: v for k, v in body.items() if k != "prompt"}, **extra, "bad_words": [word]}
        out = _ok(tiny_server, route, req)["choices"][0]["token_ids"]
        assert not any(_holds(out, seq) for seq in banned), (out, banned)
    out = _ok(tiny_server, "/v1/completions", {**body, "bad_words": [word]})["choices"][0]["token_ids"]
    assert out != greedy

    # two tokens ("mo" "dels"; after a space "Ġmo" "dels" too): pushed up, sampled in turn, so
    # they follow each other unless banned
    banned = bans("models")
    assert [len(b) for b in banned] == [2, 2], banned
    (first, second), (spaced, _) = banned
    pushed = {"prompt": "The", "max_tokens": 24, "temperature": 1.0, "seed": 3, "ignore_eos": True,
              "return_token_ids": True, "logit_bias": {str(first): 100, str(second): 100, str(spaced): 100}}
    free = _ok(tiny_server, "/v1/completions", pushed)["choices"][0]["token_ids"]
    assert _holds(free, [first, second]) or _holds(free, [spaced, second]), free
    ids = _ok(tiny_server, "/v1/completions", {**pushed, "bad_words": ["models"]})["choices"][0]["token_ids"]
    assert not any(_holds(ids, seq) for seq in banned) and second in ids, ids
    # streamed: the same tokens, each step planned once the last token is known
    chunks = _stream_chunks(tiny_server, "/v1/completions",
                            {**pushed, "bad_words": ["models"], "stream": True})
    assert [t for c in chunks for t in c["choices"][0].get("token_ids") or []] == ids


def test_allowed_token_ids_are_the_only_tokens_sampled(tiny_server):
    """vLLM's `allowed_token_ids`: every sampled token is one of them, on both routes,
    streamed or not (the end-of-turn token is not among them, so `max_tokens` ends each)."""
    allowed = [40, 41, 42, 97]
    body = {"max_tokens": 16, "temperature": 1.0, "seed": 5, "return_token_ids": True, "allowed_token_ids": allowed}
    for route, extra in (("/v1/completions", {"prompt": "The quick brown"}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        choice = _ok(tiny_server, route, {**body, **extra})["choices"][0]
        assert set(choice["token_ids"]) <= set(allowed) and len(choice["token_ids"]) == 16, choice
        assert choice["finish_reason"] == "length"
        chunks = _stream_chunks(tiny_server, route, {**body, **extra, "stream": True})
        assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == choice["token_ids"]
    free = _ok(tiny_server, "/v1/completions", {**body, "prompt": "The quick brown", "allowed_token_ids": None})
    assert not set(free["choices"][0]["token_ids"]) <= set(allowed)


# vLLM's beam search (`use_beam_search`), checked against an independent search written here
# the way vLLM's frontend runs it: one `max_tokens: 1` completion per beam and step, whose
# top logprobs rank the candidates.

def _next_tokens(server, ids: list[int], k: int) -> list[tuple[int, float]]:
    """The k likeliest next tokens after `ids` with their logprobs, most likely first."""
    body = _ok(server, "/v1/completions", {
        "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": k, "ignore_eos": True,
        "return_tokens_as_token_ids": True})
    top = body["choices"][0]["logprobs"]["top_logprobs"][0]
    pairs = [(int(t.removeprefix("token_id:")), lp) for t, lp in top.items()]
    return sorted(pairs, key=lambda p: -p[1])


def _reference(server, prompt: list[int], width: int, max_tokens: int, penalty: float) -> list[tuple[list[int], float]]:
    """vLLM's beam search: (output ids, score) of the best `width`, best first."""
    live = [([], 0.0)]
    done = []
    for step in range(max_tokens):
        candidates = []
        for out, cum in live:
            for t, lp in _next_tokens(server, prompt + out, 2 * width):
                if t == EOS:
                    done.append((out + [t], cum + lp, len(prompt) + len(out)))
                else:
                    candidates.append((out + [t], cum + lp))
        candidates.sort(key=lambda c: -c[1])
        live = candidates[:width]
    done += [(out, cum, len(prompt) + len(out)) for out, cum in live]
    ranked = sorted(done, key=lambda d: -d[1] / d[2] ** penalty)
    return [(out, cum / length ** penalty) for out, cum, length in ranked[:width]]


@pytest.mark.parametrize(("width", "max_tokens", "penalty"), [(3, 5, 1.0), (3, 5, 0.0), (2, 8, 2.0)])
def test_beams_are_those_of_an_independent_search(tiny_server, width, max_tokens, penalty):
    prompt = [5, 17, 33, 9, 61]
    body = _ok(tiny_server, "/v1/completions", {
        "prompt": prompt, "max_tokens": max_tokens, "n": width, "use_beam_search": True,
        "length_penalty": penalty, "return_token_ids": True, "logprobs": 1,
        "include_stop_str_in_output": True})
    want = _reference(tiny_server, prompt, width, max_tokens, penalty)
    got = [c["token_ids"] for c in body["choices"]]
    assert got == [out for out, _ in want]
    for choice, (out, _) in zip(body["choices"], want):
        assert choice["finish_reason"] == ("stop" if out[-1] == EOS else "length")
        assert len(choice["logprobs"]["token_logprobs"]) == len(out)
    assert body["usage"]["completion_tokens"] == sum(len(out) for out, _ in want)
    assert body["usage"]["prompt_tokens"] == len(prompt)


@pytest.fixture(scope="module")
def cramped_server(tiny_model):
    """Two sequences a step and KV blocks for about three beams of 16 tokens."""
    server = ServerProcess(str(tiny_model), "--served-model-name", "tiny", "--max-num-seqs", "2",
                           "--num-kv-blocks", "4", "--block-size", "16", "--max-model-len", "32")
    yield server
    server.stop()


def test_beams_that_wait_for_a_place_or_blocks_search_as_the_others(tiny_server, cramped_server):
    # 4 beams on a server that runs 2 sequences a step and has blocks for fewer: each step's
    # beams run over several steps, forks wait for blocks, beams that gave their rows make
    # room; the search is the one an uncramped run makes
    prompt = [5, 17, 33, 9, 61]
    body = _ok(cramped_server, "/v1/completions", {
        "prompt": prompt, "max_tokens": 8, "n": 4, "use_beam_search": True, "return_token_ids": True,
        "include_stop_str_in_output": True})
    want = _reference(tiny_server, prompt, 4, 8, 1.0)
    assert [c["token_ids"] for c in body["choices"]] == [out for out, _ in want]
    load = httpx.get(cramped_server.url + "/load", timeout=10).json()
    assert (load["running"], load["waiting"], load["kv_blocks_used"], load["requests"]) == (0, 0, 0, 0)
    metrics = httpx.get(cramped_server.url + "/metrics", timeout=10).text
    preempted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("llmserve:num_preemptions_total"))
    assert preempted > 0, "beams that gave their rows made room for waiting ones"


def test_chat_beams_stream_as_one_answer_and_match_the_body(tiny_server):
    request = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "n": 2,
               "use_beam_search": True}
    body = _ok(tiny_server, "/v1/chat/completions", request)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(model="tiny", stream=True, **{
            k: v for k, v in request.items() if k != "use_beam_search"}, extra_body={"use_beam_search": True})
        texts = ["", ""]
        finishes = [None, None]
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c["message"]["content"] for c in body["choices"]]
    assert finishes == [c["finish_reason"] for c in body["choices"]]


def test_a_beam_search_leaves_no_block_behind(tiny_server):
    for _ in range(3):
        _ok(tiny_server, "/v1/completions", {"prompt": "a b c", "max_tokens": 8, "n": 4, "use_beam_search": True})
    load = httpx.get(tiny_server.url + "/load", timeout=10).json()
    assert (load["running"], load["waiting"], load["kv_blocks_used"], load["requests"]) == (0, 0, 0, 0)


def test_fields_beam_search_cannot_honour_are_refused(tiny_server):
    r = _post(tiny_server, "/v1/completions", {"prompt": "a", "use_beam_search": True, "logit_bias": {"5": 3}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "logit_bias"
    r = _post(tiny_server, "/v1/completions", {"prompt": "a", "max_tokens": 2, "use_beam_search": True,
                                               "temperature": 0.5})
    assert r.status_code == 200
    assert r.headers["llmserve-ignored-fields"] == "temperature"


def test_a_prompt_only_request_ignores_the_search(tiny_server):
    body = _ok(tiny_server, "/v1/completions", {"prompt": "a b", "max_tokens": 0, "echo": True, "n": 2,
                                                "use_beam_search": True})
    assert [c["text"] for c in body["choices"]] == ["a b", "a b"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]


def test_a_stop_string_cuts_a_beam_as_it_cuts_a_sample(tiny_server):
    request = {"prompt": [5, 17, 33, 9, 61], "max_tokens": 5, "n": 2, "use_beam_search": True}
    full = _ok(tiny_server, "/v1/completions", request)["choices"][0]["text"]
    stop = full[len(full) // 2:][:2]
    assert stop, full
    cut = _ok(tiny_server, "/v1/completions", {**request, "stop": [stop]})["choices"][0]
    assert cut["text"] == full[:full.index(stop)]
    assert cut["finish_reason"] == "stop"


# vLLM's `repetition_detection`: a choice ends once its output ends in `min_count` back-to-back
# copies of one pattern of `min_pattern_size..max_pattern_size` tokens.

def _repetition_end(ids: list[int], smallest: int, largest: int, count: int, min_tokens: int = 0) -> int | None:
    """How many of `ids` a choice keeps under the rule (vLLM's check after each token), or
    None when it never fires."""
    for n in range(max(min_tokens, 1), len(ids) + 1):
        for k in range(max(smallest, 1), largest + 1):
            if k * count > n:
                break
            tail = ids[n - k * count:n]
            if all(t == tail[i % k] for i, t in enumerate(tail)):
                return n
    return None


def test_repetition_detection_cuts_greedy_loops_where_an_independent_check_does(tiny_server):
    rule = {"min_pattern_size": 1, "max_pattern_size": 8, "min_count": 3}
    fired = 0
    for prompt in ("The quick brown", "a b c", "Once upon a time", "1 2 3 4", "hello there"):
        body = {"prompt": prompt, "max_tokens": 96, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        free = _ok(tiny_server, "/v1/completions", body)["choices"][0]
        end = _repetition_end(free["token_ids"], 1, 8, 3)
        r = _post(tiny_server, "/v1/completions", {**body, "repetition_detection": rule})
        assert r.status_code == 200 and "llmserve-ignored-fields" not in r.headers
        cut = r.json()["choices"][0]
        if end is None:
            assert (cut["finish_reason"], cut["token_ids"]) == ("length", free["token_ids"])
            continue
        fired += 1
        # the repeated tokens are kept, up to the one that completed the repetition
        assert cut["token_ids"] == free["token_ids"][:end], (prompt, end)
        assert (cut["finish_reason"], cut["stop_reason"]) == ("repetition", "repetition_detected")
        assert free["text"].startswith(cut["text"])
        assert r.json()["usage"]["completion_tokens"] == end
        chunks = _stream_chunks(tiny_server, "/v1/completions", {**body, "repetition_detection": rule})
        assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == cut["text"]
        assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["repetition"]
    assert fired, "no greedy output of the tiny model looped: the test checks nothing"


def test_repetition_detection_on_chat_with_min_tokens_and_n(client, tiny_server):
    token = _tokenize(tiny_server, "a")[0]
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}
    one = {"allowed_token_ids": [token], "return_token_ids": True}
    rule = {"max_pattern_size": 1, "min_count": 5}
    r = client.chat.completions.create(**base, extra_body={**one, "repetition_detection": rule})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("repetition", 5)
    assert r.choices[0].model_extra["stop_reason"] == "repetition_detected"
    # a run of one token is also a run of its pairs: three pairs take six tokens
    pairs = {"min_pattern_size": 2, "max_pattern_size": 2, "min_count": 3}
    r = client.chat.completions.create(**base, extra_body={**one, "repetition_detection": pairs})
    assert r.usage.completion_tokens == 6
    # not before min_tokens (as vLLM, which checks nothing earlier)
    r = client.chat.completions.create(**base, extra_body={**one, "repetition_detection": rule, "min_tokens": 9})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("repetition", 9)
    # max_tokens on the same token wins
    r = client.chat.completions.create(**{**base, "max_tokens": 5}, extra_body={**one, "repetition_detection": rule})
    assert r.choices[0].finish_reason == "length"
    # each sampled choice is watched on its own; streamed alike
    r = client.chat.completions.create(**base, n=3, temperature=1.0, seed=3,
                                       extra_body={**one, "repetition_detection": rule})
    assert [(c.finish_reason, len(c.model_extra["token_ids"])) for c in r.choices] == [("repetition", 5)] * 3
    stream = client.chat.completions.create(**base, n=2, stream=True, extra_body={**one, "repetition_detection": rule})
    ends = [(c.index, c.finish_reason, c.model_extra.get("stop_reason")) for chunk in stream for c in chunk.choices
            if c.finish_reason]
    assert sorted(ends) == [(0, "repetition", "repetition_detected"), (1, "repetition", "repetition_detected")]
    load = httpx.get(tiny_server.url + "/load", timeout=10).json()
    assert (load["running"], load["waiting"], load["kv_blocks_used"]) == (0, 0, 0)


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/completions", {"prompt": "a", "repetition_detection": {"min_pattern_size": 2}},
     "repetition_detection.min_pattern_size"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "repetition_detection": {"max_pattern_size": 4, "min_count": 1}},
     "repetition_detection.min_count"),
    ("/v1/completions", {"prompt": "a", "repetition_detection": {"max_pattern_size": -1}},
     "repetition_detection.max_pattern_size"),
    ("/v1/completions", {"prompt": "a", "repetition_detection": [4, 2]}, "repetition_detection"),
    ("/v1/completions", {"prompt": "a", "n": 2, "use_beam_search": True,
                         "repetition_detection": {"max_pattern_size": 4, "min_count": 2}}, "repetition_detection"),
    ("/v1/responses", {"input": "a", "repetition_detection": {"max_pattern_size": 4, "min_count": 2}},
     "repetition_detection"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "a"}],
                      "repetition_detection": {"max_pattern_size": 4, "min_count": 2}}, "repetition_detection"),
])
def test_repetition_detection_is_checked(tiny_server, route, body, param):
    r = _post(tiny_server, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
