"""llmserve as a library: the offline LLM API, and the ASGI app mounted in another service."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import httpx
import numpy as np
import pytest
import torch
from starlette.applications import Starlette
from starlette.routing import Mount

from llmserve import LLM, ApiError, AsyncEngine, BadRequestError, SamplingParams, create_app
from llmserve.engine.offline import make_config
from llmserve.engine.sampling_params import Logprob


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), num_kv_blocks=64)


def test_generate_batch_and_token_prompts(llm):
    results = llm.generate(["Hello world", "The quick brown"], {"max_tokens": 5, "ignore_eos": True})
    assert [r.usage["completion_tokens"] for r in results] == [5, 5]
    assert all(r.finish_reason == "length" for r in results)
    again = llm.generate([[5, 6, 7, 8]], {"max_tokens": 3, "ignore_eos": True, "temperature": 0})[0]
    assert again.usage == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                           "prompt_tokens_details": {"cached_tokens": 0}}


def test_generate_takes_vllms_prompt_dicts(llm):
    params = {"max_tokens": 3, "ignore_eos": True, "temperature": 0}
    want = [r.text for r in llm.generate(["Hello world", [5, 6, 7]], params)]
    got = llm.generate([{"prompt": "Hello world"}, {"prompt_token_ids": [5, 6, 7]}], params)
    assert [r.text for r in got] == want
    assert llm.generate({"prompt_token_ids": (5, 6, 7)}, params)[0].text == want[1]
    for bad in ({"prompt": "a", "multi_modal_data": {}}, {"prompt_token_ids": ["a"]}, {"prompt": 5}):
        with pytest.raises(TypeError, match=r"prompts\[1\] must be .*'prompt_token_ids'"):
            llm.generate(["a", bad])


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(llm):
    # 40 tokens: the second request finds the first one's two full blocks of 16 (the block
    # holding the last prompt token is always computed)
    prompt = [list(range(5, 45))]
    params = {"max_tokens": 2, "ignore_eos": True, "temperature": 0}
    first, second = (llm.generate(prompt, params)[0] for _ in range(2))
    assert first.usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second.usage["prompt_tokens_details"] == {"cached_tokens": 32}
    assert second.text == first.text


def test_generate_greedy_is_deterministic(llm):
    a = llm.generate("Numbers: 1 2 3", {"max_tokens": 8, "temperature": 0, "ignore_eos": True})[0].text
    b = llm.generate("Numbers: 1 2 3", {"max_tokens": 8, "temperature": 0, "ignore_eos": True})[0].text
    assert a == b


def test_chat_one_and_many(llm):
    one = llm.chat([{"role": "user", "content": "Hi"}], {"max_tokens": 4, "ignore_eos": True})
    assert one.usage["completion_tokens"] == 4
    # a list of its one Result, as vLLM's LLM.chat answers, that also reads as that Result
    assert isinstance(one, list) and len(one) == 1 and [r.text for r in one] == [one.text]
    assert one[0].outputs[0].text == one.outputs[0].text == one.text and one[0].finished
    assert not hasattr(one, "no_such_field")
    many = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                    {"max_tokens": 2, "ignore_eos": True, "n": 2})
    assert [len(r.texts) for r in many] == [2, 2]


def test_offline_errors_are_api_errors(llm):
    from llmserve import ApiError, BadRequestError, NotFoundError

    with pytest.raises(BadRequestError):
        llm.generate("x", {"temperature": 5})
    with pytest.raises(NotFoundError) as info:
        llm.generate("x", {"model": "nope"})
    assert isinstance(info.value, ApiError) and info.value.status == 404
    assert ApiError.__name__ == "ApiError" and ApiError.__module__ == "llmserve._core"
    # A 400 is also the ValueError vLLM's offline API raises for bad params and too-long
    # prompts (code written for it catches `ValueError`); other statuses are not.
    with pytest.raises(ValueError, match="maximum context length") as too_long:
        llm.generate("x " * 5000, {"max_tokens": 1})
    assert isinstance(too_long.value, BadRequestError) and too_long.value.status == 400
    assert BadRequestError.__name__ == "BadRequestError" and BadRequestError.__module__ == "llmserve._core"
    assert not isinstance(info.value, ValueError)


@pytest.mark.parametrize("params, param", [
    ({"temperature": float("nan")}, "temperature"),
    ({"max_tokens": float("inf")}, "max_tokens"),
    ({"top_p": float("-inf")}, "top_p"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias.5"),
])
def test_offline_refuses_nan_and_infinity_by_name(llm, params, param):
    """JSON has no NaN or infinity (the server refuses them as invalid JSON); orjson would write
    them as null, read as an absent field (audit 47: A47-1)."""
    from llmserve import BadRequestError

    with pytest.raises(BadRequestError) as info:
        llm.generate("x", {"max_tokens": 2, **params})
    assert (info.value.param, info.value.code) == (param, "invalid_value")
    assert "finite" in info.value.message
    assert llm.generate("x", {"max_tokens": 2, "stop": None})[0].usage["completion_tokens"] <= 2


def test_an_offline_batch_error_names_the_prompt_as_the_server_would(llm):
    """Each prompt runs as its own request, whose error would name a position inside that
    prompt; a call's error names the prompt in the caller's list (audit 47: A47-5)."""
    from llmserve import BadRequestError

    with pytest.raises(BadRequestError) as info:
        llm.generate([[1, 2], [3, 4], [5, 10**6]], {"max_tokens": 2})
    assert info.value.param == "prompt[2][1]"
    with pytest.raises(BadRequestError) as info:
        llm.generate(["ok", "fine", ""], {"max_tokens": 2})
    assert info.value.param == "prompt[2]"
    # strings mixed with token ids are not one valid request: the error says which prompt
    with pytest.raises(BadRequestError) as info:
        llm.generate(["ok", [5, 10**6]], {"max_tokens": 2})
    assert "(in prompt 1 of the call, counting from 0)" in info.value.__notes__
    # a field of one prompt's own params is noted too (one shared by all is not: above)
    with pytest.raises(BadRequestError) as info:
        llm.generate(["a", "b"], [{"max_tokens": 2}, {"max_tokens": 2, "top_p": 7}])
    assert info.value.param == "top_p" and "(in prompt 1 of the call, counting from 0)" in info.value.__notes__
    with pytest.raises(BadRequestError) as info:
        llm.generate(["a", "b"], {"max_tokens": 2, "top_p": 7})
    assert not getattr(info.value, "__notes__", None)


def _idle(llm) -> dict:
    stats = llm.engine.core.stats()
    return {k: stats[k] for k in ("running", "waiting", "used_blocks")}


def test_a_failed_call_leaves_the_llm_as_it_was(llm):
    """A bad prompt among good ones fails the call before anything is queued; a call that
    stops midway (an error, Ctrl-C) aborts what it queued: the next call works, and no
    request or KV block is left behind."""
    from llmserve._core import BadRequestError

    idle = _idle(llm)
    with pytest.raises(BadRequestError):
        llm.generate(["fine", "x"], {"max_tokens": 2, "logit_bias": {"999999": 1}})
    with pytest.raises(BadRequestError):
        llm.chat([[{"role": "user", "content": "a"}], [{"role": "nobody", "content": "b"}]], {"max_tokens": 2})
    assert _idle(llm) == idle

    runner = llm.engine.runner
    execute, calls = runner.execute, []

    def interrupted(plan):
        calls.append(plan)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return execute(plan)

    runner.execute = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["one", "two"], {"max_tokens": 6, "ignore_eos": True})
    finally:
        runner.execute = execute
    assert _idle(llm) == idle
    again = llm.generate("one", {"max_tokens": 3, "ignore_eos": True})[0]
    assert again.usage["completion_tokens"] == 3


def test_calls_from_threads_run_one_at_a_time(llm):
    import threading

    want = llm.generate(["Story 0:", "Story 1:"], {"max_tokens": 6, "temperature": 0, "ignore_eos": True})
    got: dict[int, str] = {}

    def work(i: int) -> None:
        got[i] = llm.generate(f"Story {i}:", {"max_tokens": 6, "temperature": 0, "ignore_eos": True})[0].text

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {0: want[0].text, 1: want[1].text}


def test_ignored_fields_are_told_and_the_model_is_checked(llm):
    from llmserve._core import NotFoundError

    with pytest.warns(UserWarning, match="frobnicate, store"):
        r = llm.generate("x", {"max_tokens": 1, "frobnicate": 1, "store": True})[0]
    assert r.ignored_fields == ("frobnicate", "store")
    assert llm.generate("x", {"max_tokens": 1})[0].ignored_fields == ()
    with pytest.raises(NotFoundError):
        llm.generate("x", {"max_tokens": 1, "model": "other"})
    assert llm.generate("x", {"max_tokens": 1, "model": llm.model_name})[0].usage["completion_tokens"] == 1


def test_an_engine_starts_once_and_serves_its_own_loop(tiny_model):
    engine = AsyncEngine(make_config(str(tiny_model), served_model_name=["tiny"], num_kv_blocks=64))
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "ignore_eos": true}'

    async def first():
        await engine.start()
        with pytest.raises(RuntimeError, match="already"):
            await engine.start()
        stream = await engine.submit("completion", body)
        return await stream.read_all()

    assert b'"completion_tokens":2' in asyncio.run(first())

    async def other_loop():
        with pytest.raises(RuntimeError, match="event loop"):
            await engine.submit("completion", body)

    asyncio.run(other_loop())
    threads = [t.name for t in __import__("threading").enumerate()]
    assert threads.count("llmserve-engine") == 1

    async def stop():
        engine._loop = asyncio.get_running_loop()  # (the first loop is gone)
        await engine.drain()

    asyncio.run(stop())
    assert engine.state == "stopped" and not engine.busy()


def test_a_failed_load_is_said_on_every_route(tmp_path):
    with pytest.raises(TypeError, match="create_app takes a llmserve.Config"):
        create_app({"model": "x"})
    app = create_app(make_config(str(tmp_path / "missing.gguf")))

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            await c.get("/health")   # starts the load
            for _ in range(100):
                if (await c.get("/ready")).json().get("status") == "failed":
                    break
                await asyncio.sleep(0.05)
            for method, path in [("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/v1/completions")]:
                r = await c.request(method, path, json={"prompt": "a"})
                assert r.status_code == 503, (path, r.text)
                assert "failed to load" in r.json()["error"]["message"], (path, r.text)
                assert "retry-after" not in r.headers, path   # for good: nothing to retry
            assert "retry-after" not in (await c.get("/ready")).headers

    asyncio.run(main())


def test_bad_arguments_are_clear_type_errors(llm, tiny_model):
    for bad, says in ((5, "prompts must be a str, token ids, a vLLM prompt dict, or a list of these; got int"),
                      ({"a": 1}, r"prompts must be \{'prompt': str\} or .*; got keys \['a'\]"), ([1.5], r"token ids must be integers; prompts\[0\] is float"),
                      ([3, True], r"token ids must be integers; prompts\[1\] is bool"),
                      (["a", [3, 4.0]], r"prompts\[1\] must be a str, token ids \(integers\) or a vLLM prompt dict; got a list holding a float"),
                      ([["a"]], r"prompts\[0\] .*; got a list holding a str"),
                      ([1, [2]], r"prompts mixes token ids with other items \(prompts\[0\] is an integer\)"),
                      (np.array(5), "got a 0-d array"), (np.array([1.0, 2.0]), "token ids must be integers; "
                                                                               "got an array of float64")):
        with pytest.raises(TypeError, match=says):
            llm.generate(bad, {"max_tokens": 1})
    with pytest.raises(TypeError, match=r"pass the prompt as the first argument, not as params\['prompt'\]"):
        llm.generate("a", {"prompt": "b"})
    with pytest.raises(TypeError, match="pass the messages as the first argument"):
        llm.chat([{"role": "user", "content": "a"}], {"messages": []})
    with pytest.raises(TypeError, match="max_model_len"):
        LLM(str(tiny_model), max_model_len=512.5)  # before anything loads


def test_token_ids_may_be_tuples_and_numpy_integers(llm):
    params = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    want = llm.generate([5, 6, 7, 8], params)[0].text
    for ids in ((5, 6, 7, 8), np.array([5, 6, 7, 8]), [np.int64(5), 6, np.uint16(7), 8]):
        assert llm.generate(ids, params)[0].text == want, ids
    assert [r.text for r in llm.generate(np.array([[5, 6, 7, 8]] * 2), params)] == [want, want]
    texts = [r.text for r in llm.generate(np.array(["Hello", "The quick"]), params)]   # (a DataFrame column)
    assert texts == [r.text for r in llm.generate(["Hello", "The quick"], params)]
    from llmserve import BadRequestError

    with pytest.raises(BadRequestError):   # one empty prompt, as over HTTP (not an empty list of them)
        llm.generate(np.array([], dtype=np.int64), params)
    # numpy numbers in params are their values; a NaN among them is named
    assert llm.generate([5, 6, 7, 8], {**params, "max_tokens": np.int64(3), "temperature": np.float32(0)})[0].text == want
    with pytest.raises(BadRequestError, match="`temperature` must be a finite number"):
        llm.generate("hi", {"max_tokens": 2, "temperature": np.float32("nan")})


def test_params_json_cannot_hold_are_refused_as_over_http(llm):
    """Integers beyond 64 bits get the Router's range error (orjson cannot write them);
    integer keys are written as strings, as `logit_bias` is usually spelled in Python."""
    from llmserve import BadRequestError

    for prompt, params, param in (("hi", {"max_tokens": 2**70}, "max_tokens"),
                                  ("hi", {"max_tokens": 2, "seed": 2**64}, "seed"),
                                  ([1, 2, 2**64], {"max_tokens": 2}, "prompt[2]")):
        with pytest.raises(BadRequestError) as e:
            llm.generate(prompt, params)
        assert e.value.param == param
    params = {"max_tokens": 3, "temperature": 0}
    with pytest.raises(BadRequestError) as e:   # (orjson writes no lone surrogate; the Router names it)
        llm.generate("a\ud800b", {"max_tokens": 2})
    assert "surrogate" in str(e.value)
    with pytest.raises(TypeError, match="params must hold JSON values .*: Object of type set"):
        llm.generate("hi", {"max_tokens": 2, "stop": {"a", "b"}})
    with pytest.raises(BadRequestError, match=r"`logit_bias.9` must be a finite number"):
        llm.generate("hi", {"max_tokens": 2, "logit_bias": {9: np.float32("nan")}})
    forced = llm.generate("hi", {**params, "logit_bias": {9: 100}})[0]
    assert forced.text == llm.generate("hi", {**params, "logit_bias": {"9": 100}})[0].text
    assert forced.text == llm.generate("hi", {**params, "logit_bias": {np.int64(9): 100}})[0].text
    assert forced.text != llm.generate("hi", params)[0].text


def test_server_options_are_told_to_have_no_effect_offline(tiny_model):
    with pytest.warns(UserWarning, match="no effect offline: port, max_waiting, root_path, allow_credentials$"):
        LLM(str(tiny_model), num_kv_blocks=64, port=9, max_waiting=2, root_path="/x", allow_credentials=True,
            strict_fields=True)


def test_vllm_options_are_taken_as_their_flags_are():
    """`LLM(...)` takes vLLM's engine options that `llmserve run` takes as flags with no effect,
    saying why, and refuses the others as the flags are refused (before anything loads)."""
    with pytest.warns(UserWarning, match=r"no effect: trust_remote_code \(llmserve runs no code.*; "
                                         r"tensor_parallel_size \(llmserve runs a model on one device\)"):
        make_config(None, trust_remote_code=True, tensor_parallel_size=1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: llmserve runs a model on one device \(only 1"):
        make_config(None, tensor_parallel_size=2)
    with pytest.raises(TypeError, match="option 'quantization' is vLLM's: GGUF files are served in their own"):
        make_config(None, quantization="awq")
    with pytest.raises(TypeError, match="unknown option 'bogus'"):
        make_config(None, bogus=1)
    assert make_config(None, dtype="half").model.dtype == "float16"
    # vLLM's types for two of them: a torch dtype, and a boolean where the flag is on/off/auto
    assert make_config(None, dtype=torch.bfloat16).model.dtype == "bfloat16"
    assert [make_config(None, async_scheduling=v).scheduler.async_scheduling for v in (True, False)] == ["on", "off"]
    # vLLM's defaults, passed as config-driven code passes them: None keeps the option's default,
    # and vLLM's options llmserve does not have are quiet at the value that turns them off
    defaults = make_config(None)
    assert make_config(None, seed=None, max_num_seqs=None, block_size=None, quantization=None, cpu_offload_gb=0,
                       enable_sleep_mode=False, compilation_config=None) == defaults
    with pytest.raises(TypeError, match="option 'cpu_offload_gb' is vLLM's"):
        make_config(None, cpu_offload_gb=4)
    # vLLM's LLM takes dicts for its JSON options, and its own name for the KV cache's size
    cfg = make_config(None, hf_overrides={"max_position_embeddings": 4096}, override_generation_config={"top_k": 5},
                      kv_cache_memory_bytes=2**30)
    assert cfg.model.config_overrides() == {"max_position_embeddings": 4096}
    assert cfg.model.generation_overrides() == {"top_k": 5}
    assert cfg.cache.kv_cache_memory == 2**30


def test_default_sampling_params_are_the_models(tiny_model):
    """vLLM's `get_default_sampling_params()`, which its example programs start from: the
    model's sampling defaults (override_generation_config here), vLLM's for the rest; and a
    request that leaves them out samples with them."""
    llm = LLM(str(tiny_model), num_kv_blocks=64,
              override_generation_config={"temperature": 0.5, "top_k": 7, "max_new_tokens": 9})
    params = llm.get_default_sampling_params()
    assert params == SamplingParams(temperature=0.5, top_k=7, max_tokens=9)
    params.seed, params.ignore_eos = 3, True
    out = llm.generate("Hello", params)[0]
    assert len(out.outputs[0].token_ids) == 9
    assert out.text == llm.generate("Hello", {"seed": 3, "ignore_eos": True})[0].text
    plain = LLM(str(tiny_model), num_kv_blocks=64)
    assert plain.get_default_sampling_params() == SamplingParams()
    # No params are these defaults, as vLLM reads them (a request without `max_tokens` would
    # run to the end of the context); so is one prompt's None among params given per prompt.
    for lm, most in ((plain, 16), (llm, 9)):
        many = lm.generate(["Hello"] * 6, sampling_params=None)
        assert max(r.usage["completion_tokens"] for r in many) == most
        each = lm.generate(["Hello"] * 2, [None, {"max_tokens": 20, "ignore_eos": True}])
        assert each[0].usage["completion_tokens"] <= most and each[1].usage["completion_tokens"] == 20
        chats = lm.chat([[{"role": "user", "content": "Hi"}]] * 6)
        assert max(r.usage["completion_tokens"] for r in chats) == most


def test_a_capped_prefill_answers_as_a_whole_one(llm, tiny_model):
    """`long_prefill_token_threshold`: a long prompt computed a few tokens a step beside short
    ones gives the tokens and logprobs it gives computed whole."""
    prompts = [[5 + i % 50 for i in range(150)], [7, 8, 9], [11 + i % 30 for i in range(40)]]
    params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2, "return_token_ids": True}
    whole = llm.generate(prompts, params)
    with LLM(str(tiny_model), num_kv_blocks=64, long_prefill_token_threshold=16) as capped:
        runner, steps = capped.engine.runner, []
        execute = runner.execute
        runner.execute = lambda plan: steps.append(plan.num_tokens) or execute(plan)
        chunked = capped.generate(prompts, params)
    # (the first step: 16 tokens of each prompt but the 3-token one, which starts whole)
    assert steps[0] == 16 + 3 + 16 and max(steps) <= 16 * 3
    for a, b in zip(whole, chunked):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got, want = b.body["choices"][0]["logprobs"], a.body["choices"][0]["logprobs"]
        assert got["tokens"] == want["tokens"]
        # (to float32's rounding: the decode steps after the prompts batch other rows, and an
        # AVX2 CPU's float32 GEMMs round a row differently by the batch's row count; only
        # --batch-invariant promises the same bits)
        assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], rel=1e-5)
        for g, w in zip(got["top_logprobs"], want["top_logprobs"]):
            assert g.keys() == w.keys() and list(g.values()) == pytest.approx(list(w.values()), rel=1e-5)


def test_params_may_be_one_per_prompt(llm):
    """As vLLM takes one SamplingParams per prompt: a list of params, one per prompt."""
    both = llm.generate(["Hello", "Hi"], [{"max_tokens": 2, "temperature": 0}, {"max_tokens": 3, "temperature": 0}])
    assert [r.usage["completion_tokens"] for r in both] == [2, 3]
    assert both[1].text == llm.generate("Hi", {"max_tokens": 3, "temperature": 0})[0].text
    chats = llm.chat([[{"role": "user", "content": "a"}]] * 2, [{"max_tokens": 1}, {"max_tokens": 2}])
    assert [r.usage["completion_tokens"] for r in chats] == [1, 2]
    with pytest.raises(TypeError, match="params is a list of 1 for 2 prompts: give one per prompt"):
        llm.generate(["a", "b"], [{"max_tokens": 1}])

    class Params:
        max_tokens = 2
    with pytest.raises(TypeError, match="params must be a dict of request fields .*, a SamplingParams or None; got "
                                        "Params"):
        llm.generate("a", Params())
    with pytest.raises(TypeError, match=r"params\[1\] must be a dict"):
        llm.generate(["a", "b"], [{}, 5])
    with pytest.raises(TypeError, match=r"pass the prompt as the first argument"):
        llm.generate(["a", "b"], [{}, {"prompt": "c"}])


def test_vllms_sampling_params_ask_what_the_same_request_fields_ask(llm):
    """Code written for vLLM's LLM: `SamplingParams` with vLLM's defaults (16 tokens), and
    outputs read as `RequestOutput.outputs`, token ids included."""
    out = llm.generate(["Hello", [5, 6, 7]], SamplingParams(temperature=0, ignore_eos=True))
    assert [r.usage["completion_tokens"] for r in out] == [16, 16]
    same = llm.generate("Hello", {"temperature": 0, "ignore_eos": True, "max_tokens": 16, "return_token_ids": True})[0]
    first = out[0].outputs[0]
    assert (first.index, first.text, first.finish_reason) == (0, same.text, "length")
    assert first.token_ids == same.body["choices"][0]["token_ids"] and len(first.token_ids) == 16
    assert (out[1].prompt_token_ids, llm.generate("Hello", {"max_tokens": 1})[0].prompt_token_ids) == ([5, 6, 7], None)
    assert (out[0].prompt, out[1].prompt) == ("Hello", None)   # (vLLM's quickstart prints it)
    # clone(): a deep copy, as vLLM's
    params = SamplingParams(max_tokens=2, stop=["x"])
    copied = params.clone()
    copied.stop.append("y")
    assert (params.stop, copied.stop) == (["x"], ["x", "y"])
    # one per prompt, and `logprobs` k as each route takes it
    two = llm.generate(["a", "b"], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=2, n=2, seed=3)])
    assert [len(r.outputs) for r in two] == [1, 2] and two[1].outputs[1].index == 1
    scored = llm.generate("a", SamplingParams(max_tokens=2, logprobs=3, temperature=0))[0]
    assert len(scored.body["choices"][0]["logprobs"]["top_logprobs"][0]) == 3
    # cumulative_logprob: the generated tokens' logprobs summed, with logprobs asked (else None)
    token_logprobs = scored.body["choices"][0]["logprobs"]["token_logprobs"]
    assert scored.outputs[0].cumulative_logprob == pytest.approx(sum(token_logprobs))
    assert out[0].outputs[0].cumulative_logprob is None
    # (an echoed prompt's logprobs come first and do not count)
    plain, echoed = (llm.generate("a b c", {"max_tokens": 2, "logprobs": 0, "temperature": 0, "echo": echo})[0]
                     for echo in (False, True))
    assert echoed.outputs[0].cumulative_logprob == pytest.approx(plain.outputs[0].cumulative_logprob, rel=1e-4)
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=2, logprobs=2, stop=["zz"]))
    assert len(chat.body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert chat.outputs[0].text == chat.text and len(chat.outputs[0].token_ids) == 2
    assert chat.outputs[0].cumulative_logprob == pytest.approx(
        sum(e["logprob"] for e in chat.body["choices"][0]["logprobs"]["content"]))
    assert chat.prompt_token_ids == chat.body["prompt_token_ids"] and len(chat.prompt_token_ids) > 3
    # outputs' per-token logprobs, as vLLM's: the sampled token's id first, then its likeliest
    # alternatives' ids, each -> Logprob(logprob, rank, decoded_token)
    out0 = scored.outputs[0]
    assert len(out0.logprobs) == 2
    tokenizer = llm.get_tokenizer()
    for step, (entry, token, value, top) in enumerate(zip(out0.logprobs, out0.token_ids, token_logprobs,
                                                          scored.body["choices"][0]["logprobs"]["top_logprobs"])):
        assert next(iter(entry)) == token and entry[token].logprob == pytest.approx(value)
        assert entry[token].rank == 1                    # (greedy: the likeliest)
        assert len(entry) == 3 and [lp.rank for lp in entry.values()] == [1, 2, 3]
        assert {f"token_id:{i}": lp.logprob for i, lp in entry.items()} == pytest.approx(top)
        assert all(lp.decoded_token == tokenizer.decode(i) for i, lp in entry.items())
    assert out[0].outputs[0].logprobs is None
    # sampled freely, a token outside the k likeliest is listed beside them (as completions'
    # top_logprobs list it) with its rank unknown; k 0 lists the sampled token alone
    free = llm.generate("a", SamplingParams(max_tokens=16, logprobs=2, temperature=2.0, seed=5))[0].outputs[0]
    for entry, token in zip(free.logprobs, free.token_ids):
        alternatives = sorted((i for i in entry if i != token or entry[i].rank is not None),
                              key=lambda i: -entry[i].logprob)
        assert len(alternatives) == 2 and [entry[i].rank for i in alternatives] == [1, 2]
        assert entry[token].rank == (alternatives.index(token) + 1 if token in alternatives else None)
    assert any(entry[token].rank is None for entry, token in zip(free.logprobs, free.token_ids))
    alone = llm.generate("a", SamplingParams(max_tokens=3, logprobs=0, temperature=0))[0].outputs[0]
    assert [list(e) for e in alone.logprobs] == [[t] for t in alone.token_ids]
    assert all(e[t].rank is None for e, t in zip(alone.logprobs, alone.token_ids))
    assert llm.generate("a", {"max_tokens": 1})[0].outputs[0].token_ids is None     # (not returned)
    assert llm.generate("a", {"max_tokens": 1, "logprobs": 1})[0].outputs[0].logprobs is None   # (named by text)
    # (sampled at temperature 1, the token may lie outside the top 2: its rank is then unknown)
    for entry, token, content in zip(chat.outputs[0].logprobs, chat.outputs[0].token_ids,
                                     chat.body["choices"][0]["logprobs"]["content"]):
        assert next(iter(entry)) == token and entry[token].logprob == pytest.approx(content["logprob"])
        alternatives = [int(t["token"].removeprefix("token_id:")) for t in content["top_logprobs"]]
        assert entry[token].rank == (alternatives.index(token) + 1 if token in alternatives else None)
        assert set(entry) == {token, *alternatives}
    # vLLM's RequestOutput fields: request_id, finished, prompt_logprobs keyed by token id
    scored = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert scored.request_id == scored.body["id"] and scored.finished
    lps = scored.prompt_logprobs
    assert lps[0] is None and len(lps) == 3 and 6 in lps[1] and 7 in lps[2]
    sent = scored.body["choices"][0]["prompt_logprobs"][1]["6"]
    assert lps[1][6] == Logprob(sent["logprob"], sent["rank"], sent["decoded_token"])
    assert out[0].prompt_logprobs is None
    # what vLLM's params ask that no request field does is told, as any field without effect
    with pytest.warns(UserWarning, match="detokenize"):
        told = llm.generate("a", SamplingParams(max_tokens=1, detokenize=False))[0]
    assert "detokenize" in told.ignored_fields
    # (logits processors, callables that would change the tokens, are refused by name, as the
    # server refuses the field: audit B found a TypeError about JSON)
    with pytest.raises(BadRequestError) as info:
        llm.generate("a", SamplingParams(max_tokens=1, logits_processors=[lambda ids, logits: logits]))
    assert info.value.param == "logits_processors"
    # (vLLM's output_kind: a call returns whole outputs, so it is reported)
    import enum

    kind = enum.Enum("RequestOutputKind", "CUMULATIVE DELTA FINAL_ONLY")
    with pytest.warns(UserWarning, match="output_kind"):
        told = llm.generate("a", SamplingParams(max_tokens=1, output_kind=kind.DELTA))[0]
    assert "output_kind" in told.ignored_fields
    with pytest.raises(BadRequestError, match="temperature"):
        llm.generate("a", SamplingParams(temperature=-1))


def test_get_tokenizer_answers_as_transformers_tokenizer(llm, tiny_model):
    """vLLM's `llm.get_tokenizer()` is a transformers tokenizer; ours answers its calls from the
    engine's own tokenizer and template, each as transformers' tokenizer of the same folder."""
    import torch
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(tiny_model))
    tok = llm.get_tokenizer()
    for text in ("Hello world", " two  spaces\nand 12345", "é😀"):
        for specials in (True, False):
            assert tok.encode(text, add_special_tokens=specials) == ref.encode(text, add_special_tokens=specials)
    ids = ref.encode("Hello there, world", add_special_tokens=True) + [ref.eos_token_id]
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert tok.decode(np.array(ids[1:3])) == ref.decode(ids[1:3]) and tok.decode(ids[2]) == ref.decode(ids[2])
    assert tok.decode(torch.tensor(ids[2])) == ref.decode(ids[2]) and tok.decode(torch.tensor(ids)) == ref.decode(ids)
    assert tok.batch_decode([ids[:2], ids[2:]]) == ref.batch_decode([ids[:2], ids[2:]])
    assert tok.decode([ids[:2], ids[2:]]) == ref.decode([ids[:2], ids[2:]])
    for texts in ("Hello world", ["Hello", "two words"]):
        ours, theirs = tok(texts), ref(texts)
        assert (ours.input_ids, ours["attention_mask"]) == (theirs.input_ids, theirs["attention_mask"])
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert (getattr(tok, name), getattr(tok, name + "_id")) == (getattr(ref, name), getattr(ref, name + "_id"))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    longer = chat + [{"role": "assistant", "content": "Hello"}]
    for gen in (False, True):
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen) == \
            ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(longer, tokenize=False, continue_final_message=True) == \
        ref.apply_chat_template(longer, tokenize=False, continue_final_message=True)
    # tokenized, as the engine tokenizes a rendered chat (the template's special tokens as such)
    ours = tok.apply_chat_template(chat, add_generation_prompt=True)
    text = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours == ref.encode(text, add_special_tokens=False)
    as_dict = ref.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)
    assert dict(tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)) == {
        "input_ids": as_dict["input_ids"], "attention_mask": as_dict["attention_mask"]}
    assert tok.apply_chat_template([chat, longer], tokenize=False) == [
        ref.apply_chat_template(c, tokenize=False) for c in (chat, longer)]
    # the prompt it builds is the one chat builds
    done = llm.chat(chat, {"max_tokens": 1, "return_token_ids": True})
    assert done.prompt_token_ids == ours
    with pytest.warns(UserWarning, match="chat_template_kwargs.no_such_kwarg"):
        tok.apply_chat_template(chat, no_such_kwarg=True)
    with pytest.raises(TypeError, match="return_tensors"):
        tok.apply_chat_template(chat, return_tensors="pt")
    with pytest.raises(TypeError, match="token_ids must be token ids"):
        tok.decode(["a"])
    with pytest.raises(BadRequestError, match="vocabulary"):
        tok.decode([10**6])


def test_get_tokenizer_vocabulary_is_transformers(llm, tiny_model):
    """The vocabulary calls code written for vLLM makes (`convert_tokens_to_ids` for a stop
    token, `convert_ids_to_tokens` to show pieces, `get_vocab`, `vocab_size`, `len`) answer as
    transformers' tokenizer of the same folder."""
    import torch
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(tiny_model))
    tok = llm.get_tokenizer()
    assert tok.get_vocab() == ref.get_vocab()
    assert (tok.vocab_size, len(tok)) == (ref.vocab_size, len(ref))
    ids = ref.encode("Hello there, world é😀", add_special_tokens=True) + [ref.eos_token_id]
    for skip in (False, True):
        assert tok.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
            ref.convert_ids_to_tokens(ids, skip_special_tokens=skip)
    assert tok.convert_ids_to_tokens(np.array(ids)) == tok.convert_ids_to_tokens(torch.tensor(ids)) == \
        ref.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(ids[1]) == ref.convert_ids_to_tokens(ids[1])
    assert tok.convert_ids_to_tokens(10**6) is ref.convert_ids_to_tokens(10**6) is None
    pieces = ref.convert_ids_to_tokens(ids)
    assert tok.convert_tokens_to_ids(pieces) == ref.convert_tokens_to_ids(pieces) == ids
    assert tok.convert_tokens_to_ids(ref.eos_token) == ref.eos_token_id
    assert tok.convert_tokens_to_ids("no such piece") == ref.convert_tokens_to_ids("no such piece")
    with pytest.raises(TypeError, match="convert_tokens_to_ids"):
        tok.convert_tokens_to_ids([1])
    for text in ("Hello there, world é😀", " two  spaces"):
        for specials in (False, True):
            assert tok.tokenize(text, add_special_tokens=specials) == \
                ref.tokenize(text, add_special_tokens=specials)
        assert tok.convert_tokens_to_string(ref.tokenize(text)) == ref.convert_tokens_to_string(ref.tokenize(text))
    with pytest.raises(ValueError, match="no such piece"):
        tok.convert_tokens_to_string(["no such piece"])


def test_vllms_keyword_arguments_are_taken(llm):
    """vLLM's `LLM.generate(prompts, sampling_params=..., use_tqdm=False)` and `LLM.chat`'s
    template keywords: each the request field of its name."""
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert llm.generate(["Hello"], sampling_params=sp, use_tqdm=False)[0].text == llm.generate("Hello", sp)[0].text
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    tok = llm.get_tokenizer()
    fields = {"max_tokens": 1, "return_token_ids": True}
    continued = llm.chat(chat, fields, continue_final_message=True, add_generation_prompt=False, use_tqdm=False)
    assert continued.prompt_token_ids == tok.apply_chat_template(chat, continue_final_message=True)
    with pytest.warns(UserWarning, match="chat_template_kwargs.unread"):
        kw = llm.chat(chat[:1], sampling_params=fields, chat_template_kwargs={"unread": 1})
    assert kw.prompt_token_ids == tok.apply_chat_template(chat[:1], add_generation_prompt=True)
    with pytest.raises(TypeError, match="not both"):
        llm.generate("a", {"max_tokens": 1}, sampling_params=sp)
    with pytest.raises(TypeError, match="tools"):
        llm.chat(chat[:1], {"tools": []}, tools=[])
    with pytest.raises(ValueError, match="LLM"):
        llm.chat(chat[:1], chat_template_content_format="string")
    with pytest.raises(ValueError, match="chat_template is the LLM's"):
        llm.chat(chat[:1], chat_template="{{ messages }}")


def test_beam_search_answers_as_vllms(llm):
    """vLLM's `LLM.beam_search(prompts, BeamSearchParams(...))`: each prompt's best beams as
    `BeamSearchSequence`s (prompt and beam tokens, the beam's text, its cumulative logprob),
    the same beams the completion route's `use_beam_search` finds."""
    from llmserve import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    out = llm.beam_search([{"prompt": "Hello"}, [5, 6, 7]], params)
    same = llm.generate("Hello", {"use_beam_search": True, "n": 3, "max_tokens": 4, "ignore_eos": True,
                                  "return_token_ids": True, "logprobs": 0})[0]
    first = out[0].sequences[0]
    choice = same.body["choices"][0]
    assert first.tokens == same.prompt_token_ids + choice["token_ids"] and len(choice["token_ids"]) == 4
    # (vLLM's text decodes every token, the prompt's too)
    tok = llm.get_tokenizer()
    assert [s.text for s in out[0].sequences] == [tok.decode(s.tokens) for s in out[0].sequences]
    assert [s.text for s in out[0].sequences] == ["Hello" + text for text in same.texts]
    assert first.cum_logprob == pytest.approx(sum(choice["logprobs"]["token_logprobs"]))
    assert out[0].sequences[0].cum_logprob >= out[0].sequences[-1].cum_logprob   # (length_penalty 1, same lengths)
    assert len(out[1].sequences) == 3 and out[1].sequences[0].tokens[:3] == [5, 6, 7]
    with pytest.warns(UserWarning, match="temperature"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=1, temperature=0.5))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search("Hello", {"n": 2})
    with pytest.raises(BadRequestError) as refused:
        llm.beam_search("Hello", BeamSearchParams(beam_width=0, max_tokens=1))
    assert "beam_width is the request's `n`" in "".join(refused.value.__notes__)


def test_streams_close_as_context_managers_and_endpoints_are_checked(tiny_model):
    engine = AsyncEngine(make_config(str(tiny_model), served_model_name=["tiny"], num_kv_blocks=64))
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 50, "ignore_eos": true, "stream": true}'

    async def main():
        await engine.start()
        with pytest.raises(ValueError, match="handle"):
            await engine.submit("tokenize", b'{"prompt": "x"}')
        with pytest.raises(ValueError, match="submit"):
            await engine.handle("chat", body)
        async with await engine.submit("completion", body) as stream:
            await stream.next()   # a reader that stops early
        for _ in range(100):
            load = engine.load()
            if load["running"] == 0 and load["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.02)
        assert (load["running"], load["kv_blocks_used"], load["requests"]) == (0, 0, 0)
        # once a response is read whole, the counts no longer hold it
        done = await engine.submit("completion", body.replace(b'"stream": true', b'"stream": false'))
        await done.read_all()
        load = engine.load()
        assert (load["running"], load["requests"]) == (0, 0)
        await engine.drain()

    asyncio.run(main())


def test_mounted_app_shares_a_started_engine(tiny_model):
    engine = AsyncEngine(make_config(str(tiny_model), served_model_name=["tiny"], num_kv_blocks=64))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # NOTE: Starlette does not run a mounted app's lifespan: the host starts the engine.
        await engine.start()
        yield
        await engine.drain()

    host = Starlette(routes=[Mount("/llm", app=create_app(engine=engine))], lifespan=lifespan)

    async def main():
        async with lifespan(host):
            transport = httpx.ASGITransport(app=host)
            async with httpx.AsyncClient(transport=transport, base_url="http://host") as c:
                r = await c.post("/llm/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 3
                assert (await c.get("/llm/ready")).status_code == 200

    asyncio.run(main())


def test_an_engine_never_started_says_so(tiny_model):
    """An app serving an engine nobody started (`create_app(engine=...)`, whose host never
    called `start()`) answers what to do, not "still loading" forever; and the engine too."""
    engine = AsyncEngine(make_config(str(tiny_model), served_model_name=["tiny"], num_kv_blocks=64))
    app = create_app(engine=engine)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            for r in (await c.post("/v1/chat/completions", json=chat), await c.post("/tokenize", json={
                    "model": "tiny", "prompt": "hi"})):
                assert r.status_code == 503 and "retry-after" not in r.headers, r.text
                assert "await engine.start()" in r.json()["error"]["message"]
        with pytest.raises(ApiError, match=r"never started: `await engine.start\(\)`"):
            await engine.submit("completion", json.dumps({"model": "tiny", "prompt": "hi"}).encode())

    asyncio.run(main())
    assert engine.state == "loading" and not engine.busy()


def test_mounted_app_loads_on_its_first_request_and_keeps_probes_open(tiny_model):
    """Starlette does not run a mounted app's lifespan: the first request starts the load
    (503 "loading" until it is done), and the open probes stay open under the mount prefix
    while the API routes need the key."""
    cfg = make_config(str(tiny_model), served_model_name=["tiny"], num_kv_blocks=64)
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, api_key=("k",), access_log=False))
    inner = create_app(cfg)
    host = Starlette(routes=[Mount("/llm", app=inner)])

    async def main():
        transport = httpx.ASGITransport(app=host)
        async with httpx.AsyncClient(transport=transport, base_url="http://host") as c:
            assert (await c.get("/llm/health")).status_code == 200
            first = await c.get("/llm/ready")
            assert first.status_code == 503 and first.headers["retry-after"]
            loading = await c.post("/llm/v1/completions", headers={"authorization": "Bearer k"},
                                   json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
            assert loading.status_code == 503 and "still loading" in loading.json()["error"]["message"]
            for _ in range(600):
                if (await c.get("/llm/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            assert (await c.get("/llm/metrics")).status_code == 200
            assert (await c.get("/llm/v1/models")).status_code == 401
            r = await c.post("/llm/v1/chat/completions", headers={"authorization": "Bearer k"}, json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200, r.text
        await inner.state.engine.drain()

    asyncio.run(main())


_EXIT_SCRIPT = """
import asyncio, sys
from llmserve import AsyncEngine
from llmserve.engine.offline import make_config

engine = AsyncEngine(make_config(sys.argv[1], served_model_name=["tiny"], num_kv_blocks=64, threads=1))

async def main():
    if sys.argv[2] == "loading":      # the application ends before the load does
        asyncio.ensure_future(engine.start())
        await asyncio.sleep(0.01)
        return
    await engine.start()
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 500, "ignore_eos": true, "stream": true}'
    stream = await engine.submit("completion", body)
    asyncio.ensure_future(stream.read_all())   # still reading when asyncio.run cancels it
    await asyncio.sleep(0.3)

asyncio.run(main())
print("exited")
"""


@pytest.mark.parametrize("when", ["loading", "generating"])
def test_an_application_that_never_drains_exits_cleanly(tiny_model, when):
    """An engine thread (the load, or the loop inside a step) still running at interpreter
    exit is waited for or stopped first: an interpreter that finalizes around a thread inside
    torch aborts the process (SIGABRT, "terminate called without an active exception")."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tiny_model), when],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "exited"), done.stderr[-2000:]
    assert "terminate called" not in done.stderr and "FATAL" not in done.stderr, done.stderr[-2000:]


def test_a_stream_read_from_another_loop_says_so(tiny_model):
    """Outputs are queued on the loop that started the engine: another loop would wait forever."""
    import threading

    engine = AsyncEngine(make_config(str(tiny_model), served_model_name=["tiny"], num_kv_blocks=64))
    home = asyncio.new_event_loop()
    thread = threading.Thread(target=home.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(engine.start(), home).result(60)
        with pytest.raises(TypeError, match="must be bytes"):
            asyncio.run_coroutine_threadsafe(engine.submit("completion", '{"prompt": "hi"}'), home).result(5)
        body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
        stream = asyncio.run_coroutine_threadsafe(engine.submit("completion", body), home).result(5)
        with pytest.raises(RuntimeError, match="serves the event loop that started it"):
            asyncio.run(stream.next())
        assert b'"choices"' in asyncio.run_coroutine_threadsafe(stream.read_all(), home).result(30)
        asyncio.run_coroutine_threadsafe(engine.drain(), home).result(30)
    finally:
        home.call_soon_threadsafe(home.stop)
        thread.join(5)
        home.close()


def test_offline_embed_answers_as_vllms(llm):
    """vLLM's `LLM.embed`: an EmbeddingRequestOutput per prompt (`outputs.embedding`), its
    pooled token ids; `PoolingParams` or a dict, and vLLM's keywords."""
    from llmserve import PoolingParams

    texts = ["Hello world", "The quick brown fox"]
    out = llm.embed(texts)
    assert [len(o.outputs.embedding) for o in out] == [o.outputs.hidden_size for o in out] == [64, 64]
    assert all(isinstance(x, float) for x in out[0].outputs.embedding) and all(o.finished for o in out)
    assert len({o.request_id for o in out}) == 2
    tok = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in out] == [tok.encode(t) for t in texts]
    # token ids, vLLM's prompt dicts and a mix of kinds, in order
    mixed = llm.embed([out[1].prompt_token_ids, {"prompt": texts[0]}])
    np.testing.assert_allclose(mixed, np.asarray(out)[::-1], atol=1e-6)
    # the params: a PoolingParams, by vLLM's keyword or positionally, or the route's dict
    raw = np.asarray(llm.embed(texts[:1], pooling_params=PoolingParams(normalize=False)))
    assert abs(np.linalg.norm(raw) - 1) > 1e-3
    np.testing.assert_allclose(llm.embed(texts[:1], PoolingParams(use_activation=False)), raw, atol=0)
    np.testing.assert_allclose(llm.embed(texts[:1], {"normalize": False}), raw, atol=0)
    # vLLM's truncate_prompt_tokens keyword keeps the last k tokens, and the ids say so
    cut = llm.embed(texts[1], truncate_prompt_tokens=2)[0]
    assert cut.prompt_token_ids == out[1].prompt_token_ids[-2:]
    np.testing.assert_allclose(cut, llm.embed([out[1].prompt_token_ids[-2:]])[0], atol=1e-6)
    with pytest.raises(BadRequestError) as err:
        llm.embed(texts, PoolingParams(normalize=True, use_activation=False))
    assert err.value.param == "use_activation"
    with pytest.raises(TypeError, match="as params or as pooling_params"):
        llm.embed(texts, {}, pooling_params=PoolingParams())
    with pytest.raises(TypeError, match="must be a PoolingParams"):
        llm.embed(texts, SamplingParams())
    with pytest.warns(UserWarning, match="had no effect: softmax"):
        llm.embed(texts, PoolingParams(softmax=True))


def test_offline_score_and_rerank_answer_as_the_routes(llm):
    docs = ["Hello, world!", "def add(a, b): return a + b", "Paris is in France."]
    v = np.asarray(llm.embed(["Where is Paris?", *docs]), np.float64)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    want = v[1:] @ v[0]
    scores = llm.score("Where is Paris?", docs)
    np.testing.assert_allclose([s.outputs.score for s in scores], want, atol=1e-5)
    # vLLM's ScoringRequestOutput: each pair's token ids, the first text's then the second's
    ids = {t: e.prompt_token_ids for t, e in zip(["Where is Paris?", "Hello", *docs],
                                                 llm.embed(["Where is Paris?", "Hello", *docs]))}
    assert [s.prompt_token_ids for s in scores] == [ids["Where is Paris?"] + ids[d] for d in docs]
    assert len({s.request_id for s in scores}) == 3 and all(s.finished for s in scores)
    # pair by pair
    hello = np.asarray(llm.embed("Hello")[0], np.float64)
    pairs = llm.score(["Where is Paris?", "Hello"], docs[:2])
    np.testing.assert_allclose([s.outputs.score for s in pairs], [want[0], hello @ v[2] / np.linalg.norm(hello)],
                               atol=1e-5)
    assert [s.prompt_token_ids for s in pairs] == [ids["Where is Paris?"] + ids[docs[0]], ids["Hello"] + ids[docs[1]]]
    ranked = llm.rerank("Where is Paris?", docs, {"top_n": 2})
    assert [r["index"] for r in ranked] == list(np.argsort(-want)[:2])
    with pytest.raises(TypeError, match="pass the documents as the second argument"):
        llm.rerank("q", docs, {"documents": docs})


def test_offline_reset_prefix_cache_leaves_nothing_to_find(llm):
    prompt = [list(range(100, 140))]
    params = {"max_tokens": 1, "temperature": 0}
    llm.generate(prompt, params)
    assert llm.generate(prompt, params)[0].usage["prompt_tokens_details"] == {"cached_tokens": 32}
    assert llm.reset_prefix_cache() >= 2
    assert llm.generate(prompt, params)[0].usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_close_releases_the_engine_and_later_calls_say_so(tiny_model):
    """`close()` (or leaving a `with` block) frees the model and KV cache at once, however many
    references to the LLM remain; a later call raises rather than serving a freed engine."""
    import gc
    import weakref

    with LLM(str(tiny_model), num_kv_blocks=40) as llm:
        assert llm.generate("Hi", {"max_tokens": 2, "ignore_eos": True})[0].usage["completion_tokens"] == 2
        runner = weakref.ref(llm.engine.runner)
    gc.collect()
    assert runner() is None, "the model and its KV cache outlived close()"
    for call in (lambda: llm.generate("Hi"), lambda: llm.chat([{"role": "user", "content": "Hi"}]),
                 llm.reset_prefix_cache):
        with pytest.raises(RuntimeError, match="this LLM was closed"):
            call()
    llm.close()   # (twice is fine)


def test_a_program_that_ends_during_an_offline_call_on_a_daemon_thread_exits_cleanly(tiny_model, tmp_path):
    """An interpreter that finalizes while a daemon thread is inside a step (inside torch)
    aborts the process ("FATAL: exception not rethrown", SIGABRT): the exit waits for the
    step and starts no other."""
    import subprocess
    import sys

    script = tmp_path / "daemon.py"
    script.write_text(f"""
import threading, time
from llmserve import LLM
llm = LLM({str(tiny_model)!r}, threads=1, num_kv_blocks=512)
started = threading.Event()
def work():
    started.set()
    llm.generate(["hi"] * 32, {{"max_tokens": 400, "ignore_eos": True}})
threading.Thread(target=work, daemon=True).start()
started.wait()
time.sleep(0.5)
""")
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
