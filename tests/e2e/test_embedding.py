"""llmserve as a library: the offline LLM API, and the ASGI app mounted in another service."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from llmserve import LLM, AsyncEngine, create_app
from llmserve.engine.offline import make_config


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model), num_kv_blocks=64)


def test_generate_batch_and_token_prompts(llm):
    results = llm.generate(["Hello world", "The quick brown"], {"max_tokens": 5, "ignore_eos": True})
    assert [r.usage["completion_tokens"] for r in results] == [5, 5]
    assert all(r.finish_reason == "length" for r in results)
    again = llm.generate([[5, 6, 7, 8]], {"max_tokens": 3, "ignore_eos": True, "temperature": 0})[0]
    assert again.usage == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_generate_greedy_is_deterministic(llm):
    a = llm.generate("Numbers: 1 2 3", {"max_tokens": 8, "temperature": 0, "ignore_eos": True})[0].text
    b = llm.generate("Numbers: 1 2 3", {"max_tokens": 8, "temperature": 0, "ignore_eos": True})[0].text
    assert a == b


def test_chat_one_and_many(llm):
    one = llm.chat([{"role": "user", "content": "Hi"}], {"max_tokens": 4, "ignore_eos": True})
    assert one.usage["completion_tokens"] == 4
    many = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                    {"max_tokens": 2, "ignore_eos": True, "n": 2})
    assert [len(r.texts) for r in many] == [2, 2]


def test_offline_errors_are_api_errors(llm):
    from llmserve._core import BadRequestError

    with pytest.raises(BadRequestError):
        llm.generate("x", {"temperature": 5})


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
