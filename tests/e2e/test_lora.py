"""LoRA adapters end to end: `llmserve run MODEL --lora-modules a=PATH b=PATH` serves each
adapter as a model of its own name beside the base model. Each name's greedy tokens equal
transformers' on the base weights with that adapter merged into them by hand (W + scale B A),
whether the requests run alone or side by side in the same steps, streamed or not; so do
those of adapters loaded while the server runs (vLLM's /v1/load_lora_adapter)."""

from __future__ import annotations

import concurrent.futures
import shutil

import httpx
import pytest
from openai import NotFoundError, OpenAI

from server import ServerProcess

PROMPT = [5, 17, 42, 99, 7, 63, 12, 250]
STEPS = 10


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    import torch

    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out[len(ids):]


def _merged_greedy(folder, adapters: list[tuple[dict, float]]) -> list[list[int]]:
    """transformers' greedy tokens on the base model, then on the base with each adapter
    (its (A, B) pairs by module, and its scaling) merged into the weights."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in base.state_dict().items()}
    tokens = [_greedy(base, PROMPT, STEPS)]
    for pairs, scale in adapters:
        base.load_state_dict(original)
        state = base.state_dict()
        with torch.no_grad():
            for module, (a, b) in pairs.items():
                state[module + ".weight"] += scale * (b @ a)
        tokens.append(_greedy(base, PROMPT, STEPS))
    return tokens


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    import json

    from tiny import build_tiny_llama, write_peft_adapter

    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny-lora"))
    config = json.loads((folder / "config.json").read_text())
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    path_a, path_b = tmp_path_factory.mktemp("adapter-a"), tmp_path_factory.mktemp("adapter-b")
    pairs_a = write_peft_adapter(path_a, config, every, r=4, alpha=8.0, seed=1)
    pairs_b = write_peft_adapter(path_b, config, ["q_proj", "v_proj"], r=8, alpha=16.0, seed=2,
                                 config={"use_rslora": True})
    # (computed before the server starts: the two processes share 2 cores)
    want = _merged_greedy(folder, [(pairs_a, 8.0 / 4), (pairs_b, 16.0 / 8 ** 0.5)])
    assert len({tuple(t) for t in want}) == 3, "the adapters must change the tokens for this test to mean anything"
    resolver = tmp_path_factory.mktemp("resolver")
    shutil.copytree(path_a, resolver / "on-demand")
    server = ServerProcess(str(folder), "--served-model-name", "tiny", "--lora-modules", f"a={path_a}",
                           f"b={path_b}", "--allow-runtime-lora-updating", "--lora-resolver-dir", str(resolver))
    yield server, dict(zip(["tiny", "a", "b"], want)), (str(path_a), str(path_b))
    server.stop()


def _tokens(client: OpenAI, model: str, stream: bool = False) -> list[int]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=STEPS, temperature=0, stream=stream,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    if stream:
        return [t for chunk in r for c in chunk.choices for t in (c.model_extra.get("token_ids") or [])]
    return r.choices[0].model_extra["token_ids"]


def test_adapters_are_listed_as_models_of_the_base(lora):
    server, _, (path_a, path_b) = lora
    with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        models = {m.id: m for m in client.models.list()}
        with pytest.raises(NotFoundError):
            client.completions.create(model="c", prompt=PROMPT, max_tokens=1)
    assert list(models) == ["tiny", "a", "b"]
    assert (models["a"].model_extra["root"], models["a"].model_extra["parent"]) == (path_a, "tiny")
    assert (models["b"].model_extra["root"], models["b"].model_extra["parent"]) == (path_b, "tiny")
    assert models["tiny"].model_extra["parent"] is None


def test_each_name_generates_as_its_merged_weights(lora):
    server, want, _ = lora
    with OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        for name in ["a", "tiny", "b"]:
            assert _tokens(client, name) == want[name], name
        assert _tokens(client, "b", stream=True) == want["b"]
        # each name's output depends on other weights: each has its own system_fingerprint
        fingerprints = {client.completions.create(model=name, prompt=PROMPT, max_tokens=1).system_fingerprint
                        for name in ["a", "tiny", "b"]}
        assert len(fingerprints) == 3 and all(f.startswith("fp_") for f in fingerprints)


def test_adapters_and_the_base_share_steps(lora):
    """Requests for both adapters and the base model at once (so their tokens run in the same
    steps, prefill and decode) get what each gets alone; the same prompt through another
    adapter reuses none of the prefix cache's blocks."""
    server, want, _ = lora
    _all_at_once(server, want, ["a", "b", "tiny"] * 3, max_lora=2)


def _all_at_once(server, want: dict, names: list[str], max_lora: int) -> None:
    """Requests for `names` at once each get what they get alone; then vLLM's gauge of the
    adapters running and waiting says none, and `max_lora`."""
    with (OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as client,
          concurrent.futures.ThreadPoolExecutor(len(names)) as pool):
        got = list(pool.map(lambda n: _tokens(client, n), names))
    assert got == [want[n] for n in names]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    labels = f'max_lora="{max_lora}",running_lora_adapters="",waiting_lora_adapters=""'
    assert "llmserve:lora_requests_info{" + labels + "}" in metrics


def test_max_loras_runs_one_adapter_at_a_time(lora):
    """With --max-loras 1, requests for both adapters and the base model at once still get what
    each gets alone: the second adapter's wait until the first's drain (the scheduler's tests
    check the steps); the metric's `max_lora` says the bound."""
    first, want, (path_a, path_b) = lora
    server = ServerProcess(first.model, "--served-model-name", "tiny", "--lora-modules", f"a={path_a}",
                           f"b={path_b}", "--max-loras", "1")
    try:
        _all_at_once(server, want, ["a", "b", "tiny", "b", "a"], max_lora=1)
    finally:
        server.stop()


def test_adapters_load_and_unload_while_the_server_runs(lora):
    """With --allow-runtime-lora-updating, vLLM's routes load an adapter under a new name (it
    generates as its merged weights, and is listed), refuse a loaded name unless
    `load_inplace`, replace one's weights in place, and unload it (its name is then a 404)."""
    server, want, (path_a, path_b) = lora
    url = server.url + "/v1"
    load = lambda **body: httpx.post(url + "/load_lora_adapter", json=body, timeout=60)   # noqa: E731
    unload = lambda **body: httpx.post(url + "/unload_lora_adapter", json=body, timeout=60)   # noqa: E731
    with OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120) as client:
        r = load(lora_name="c", lora_path=path_a)
        assert r.status_code == 200 and "'c'" in r.text, r.text
        assert [m.id for m in client.models.list()] == ["tiny", "a", "b", "c"]
        assert client.models.retrieve("c").model_extra["root"] == path_a
        assert _tokens(client, "c") == want["a"]
        r = load(lora_name="c", lora_path=path_b)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "lora_adapter_exists"), r.text
        assert load(lora_name="c", lora_path=path_b, load_inplace=True).status_code == 200
        assert _tokens(client, "c", stream=True) == want["b"]
        assert _tokens(client, "a") == want["a"] and _tokens(client, "tiny") == want["tiny"]
        r = unload(lora_name="c")
        assert r.status_code == 200 and "'c'" in r.text, r.text
        with pytest.raises(NotFoundError):
            client.completions.create(model="c", prompt=PROMPT, max_tokens=1)
        assert [m.id for m in client.models.list()] == ["tiny", "a", "b"]
        r = unload(lora_name="c")
        assert r.status_code == 404 and "loaded: a, b" in r.json()["error"]["message"], r.text
        # a path that cannot be one here (a name longer than the file system holds) is no folder
        r = load(lora_name="d", lora_path="a" * 300)
        assert r.status_code == 404 and "cannot be a path" in r.json()["error"]["message"], r.text
        # an adapter given at start unloads too, and loads again under its name
        assert unload(lora_name="a").status_code == 200
        assert load(lora_name="a", lora_path=path_a).status_code == 200
        assert _tokens(client, "a") == want["a"]
        # --lora-resolver-dir: the first request naming its subfolder loads it
        assert _tokens(client, "on-demand", stream=True) == want["a"]
        assert [m.id for m in client.models.list()] == ["tiny", "b", "a", "on-demand"]


def test_offline_lora_request_runs_the_adapter_of_its_name(tmp_path):
    """vLLM's `LLM.generate(..., lora_request=LoRARequest(name, id, path))` runs the adapter of
    that name (served from `lora_modules`), one per prompt when a list is given; `priority`
    (one per prompt) rides along; a name that is not served fails as the route's 404."""
    import json
    import types

    from tiny import build_tiny_llama, write_peft_adapter

    from llmserve import LLM
    from llmserve._core import ApiError

    (tmp_path / "m").mkdir()
    folder = build_tiny_llama(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    pairs = write_peft_adapter(tmp_path / "a", config, ["q_proj", "v_proj"], r=4, alpha=8.0, seed=1)
    base, merged = _merged_greedy(folder, [(pairs, 8.0 / 4)])
    assert base != merged
    request = types.SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=str(tmp_path / "a"))
    params = {"max_tokens": STEPS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with LLM(str(folder), served_model_name=("tiny",), lora_modules=(f"a={tmp_path / 'a'}",), threads=1) as llm:
        outs = llm.generate([PROMPT, PROMPT], params, lora_request=[request, None], priority=[0, 0])
        assert [o.outputs[0].token_ids for o in outs] == [merged, base]
        chat = llm.chat([{"role": "user", "content": "hi"}], {**params, "max_tokens": 2}, lora_request=request)
        assert chat.body["model"] == "a"
        with pytest.raises(ApiError, match="model"):
            llm.generate(PROMPT, params, lora_request=types.SimpleNamespace(lora_name="b"))
        with pytest.raises(ValueError, match="priority is a list of 1 for 2 prompts"):
            llm.generate([PROMPT, PROMPT], params, priority=[0])
        with pytest.raises(ValueError, match="LLM\\(model, chat_template=...\\)"):
            llm.chat([{"role": "user", "content": "hi"}], params, chat_template="{{ messages }}")
