"""Fill-in-the-middle end to end: on a tiny model whose vocabulary has StarCoder's FIM tokens,
completions' `suffix` lays the prompt out `<fim_prefix>{prompt}<fim_suffix>{suffix}<fim_middle>`
(ids checked against the `tokenizers` package), the answer is the one the laid-out ids give
as a plain prompt, streamed or not, and the vocabulary's end-of-infill token stops it. The
default model has no FIM tokens: `suffix` is a 400 there (test_contract_errors)."""

from __future__ import annotations

import httpx
import pytest
from openai import BadRequestError, OpenAI

from server import ServerProcess

FIM = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>"]
PROMPT, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory):
    from tokenizers import Tokenizer

    from tiny import build_tiny_llama

    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny-fim"), vocab_size=392)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(FIM)
    tok.save(str(folder / "tokenizer.json"))
    server = ServerProcess(str(folder), "--served-model-name", "tiny")
    yield server, tok
    server.stop()


def test_a_suffix_is_laid_out_for_the_middle(fim_server):
    server, tok = fim_server
    with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        pre, suf, mid, pad = (tok.token_to_id(t) for t in FIM)
        want = [pre, *tok.encode(PROMPT).ids, suf, *tok.encode(SUFFIX).ids, mid]

        r = client.completions.create(model="tiny", prompt=PROMPT, suffix=SUFFIX, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["prompt_token_ids"] == want
        # the same as the laid-out ids sent as a plain prompt, which also stop at <fim_pad>
        plain = client.completions.create(model="tiny", prompt=want, max_tokens=12, temperature=0,
                                          extra_body={"stop_token_ids": [pad]})
        assert r.choices[0].text == plain.choices[0].text
        assert r.choices[0].finish_reason == plain.choices[0].finish_reason
        streamed = client.completions.create(model="tiny", prompt=PROMPT, suffix=SUFFIX, max_tokens=12,
                                             temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text

        rendered = httpx.post(server.url + "/v1/completions/render", timeout=30,
                              json={"model": "tiny", "prompt": PROMPT, "suffix": SUFFIX}).json()
        assert rendered["prompts"][0]["prompt_token_ids"] == want


def test_the_end_of_infill_token_stops_it(fim_server):
    """A bias that makes <fim_pad> the likeliest token: the infill ends there, `stop`, with no
    text, as at EOS; with `ignore_eos` it does not stop."""
    server, tok = fim_server
    with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        pad = tok.token_to_id("<fim_pad>")
        r = client.completions.create(model="tiny", prompt=PROMPT, suffix=SUFFIX, max_tokens=5, temperature=0,
                                      logit_bias={str(pad): 100})
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)
        r = client.completions.create(model="tiny", prompt=PROMPT, suffix=SUFFIX, max_tokens=5, temperature=0,
                                      logit_bias={str(pad): 100}, extra_body={"ignore_eos": True})
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 5)


def test_a_suffix_with_echo_is_a_400(fim_server):
    server, _ = fim_server
    with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(BadRequestError) as e:
            client.completions.create(model="tiny", prompt=PROMPT, suffix=SUFFIX, echo=True, max_tokens=4)
        assert e.value.body["param"] == "echo"
