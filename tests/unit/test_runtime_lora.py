"""LoRA adapters loaded and unloaded while the engine serves (engine/adapters.py), driven in
process through AsyncEngine: a request admitted before its adapter is unloaded runs to its
end through that adapter, the weights go once no request holds them, a request validated
just before the unload and queued after the weights went fails with a 404, and loads that
cannot be served change nothing."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import orjson
import pytest
import torch

from llmserve._core import BadRequestError, NotFoundError
from llmserve.engine.async_engine import AsyncEngine, RequestStream
from llmserve.engine.offline import make_config
from llmserve.models.layers import Linear


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tiny import build_tiny_llama, write_peft_adapter

    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny"))
    config = json.loads((folder / "config.json").read_text())
    adapter = tmp_path_factory.mktemp("adapter")
    write_peft_adapter(adapter, config, ["q_proj", "v_proj", "down_proj"], r=4, alpha=8.0, seed=3)
    return folder, adapter


def _body(model: str, stream: bool = False, max_tokens: int = 40) -> bytes:
    return orjson.dumps({"model": model, "prompt": [5, 17, 42, 99, 7], "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True, "return_token_ids": True, "stream": stream})


def _stream_tokens(frames: bytes) -> list[int]:
    tokens = []
    for line in frames.split(b"\n"):
        if line.startswith(b"data: {"):
            tokens += [t for c in orjson.loads(line[6:])["choices"] for t in c.get("token_ids") or []]
    return tokens


def _weights_left(engine: AsyncEngine) -> set[int]:
    """The adapter indices whose weights some linear of the model still holds."""
    model = engine.engine.adapters.model
    return {i for m in model.modules() if isinstance(m, Linear) and m.lora is not None for i in m.lora.pairs}


async def _until(condition, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the condition never held")


def test_unloading_lets_admitted_requests_finish_then_frees_the_weights(served):
    folder, adapter = served
    engine = AsyncEngine(make_config(str(folder), served_model_name=["tiny"], num_kv_blocks=64, threads=1,
                                     allow_runtime_lora_updating=True))
    load = orjson.dumps({"lora_name": "x", "lora_path": str(adapter)})

    async def main():
        await engine.start()
        text, _ = await engine.load_lora(load)
        assert text == "Success: LoRA adapter 'x' added successfully."
        whole = orjson.loads(await (await engine.submit("completion", _body("x"))).read_all())
        want = whole["choices"][0]["token_ids"]
        base = orjson.loads(await (await engine.submit("completion", _body("tiny"))).read_all())
        assert base["choices"][0]["token_ids"] != want, "the adapter must change the tokens"
        assert _weights_left(engine) == {1}

        # unloaded while it streams: it ends as it would have, through the adapter
        stream = await engine.submit("completion", _body("x", stream=True))
        first = await stream.next()
        text, _ = engine.unload_lora(orjson.dumps({"lora_name": "x"}))
        assert text == "Success: LoRA adapter 'x' removed successfully."
        with pytest.raises(NotFoundError):
            await engine.submit("completion", _body("x"))
        rest = await stream.read_all()
        assert _stream_tokens(first + rest) == want
        await _until(lambda: not _weights_left(engine))
        assert engine.engine.adapters.model.lora_adapters == {}
        assert engine.router.lora_names() == []

        # validated through an adapter that is unloaded (and freed) before the engine takes it
        await engine.load_lora(load)
        prepared = engine.router.prepare("completion", _body("x"))
        engine.unload_lora(orjson.dumps({"lora_name": "x"}))
        await _until(lambda: not _weights_left(engine))
        late = RequestStream(engine, prepared)
        engine._open.add(late)
        engine._thread.post(("add", prepared, late))
        with pytest.raises(NotFoundError, match="'x'|`x`"):
            await late.read_all()
        # ... and the engine goes on serving
        again = orjson.loads(await (await engine.submit("completion", _body("tiny"))).read_all())
        assert again["choices"][0]["token_ids"] == base["choices"][0]["token_ids"]
        await engine.drain()

    asyncio.run(main())


def test_loads_that_cannot_be_served_change_nothing(served, tmp_path, monkeypatch):
    folder, adapter = served
    engine = AsyncEngine(make_config(str(folder), served_model_name=["tiny"], num_kv_blocks=64, threads=1,
                                     allow_runtime_lora_updating=True))
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "adapter_config.json").write_text('{"r": 0}')
    other = tmp_path / "other"   # (made for a model of another hidden size)
    from tiny import write_peft_adapter

    config = json.loads((folder / "config.json").read_text())
    write_peft_adapter(other, {**config, "hidden_size": 2 * config["hidden_size"]}, ["q_proj"])

    async def main():
        await engine.start()
        cases = [
            ({"lora_name": "y", "lora_path": str(tmp_path / "missing")}, NotFoundError, None, "does not exist"),
            ({"lora_name": "y", "lora_path": str(damaged)}, BadRequestError, "lora_path", "no adapter_model"),
            ({"lora_name": "y", "lora_path": str(other)}, BadRequestError, "lora_path", "hidden size"),
            ({"lora_name": "tiny", "lora_path": str(adapter)}, BadRequestError, "lora_name", "base model"),
            ({"lora_name": "y"}, BadRequestError, "lora_path", "lora_path"),
            ({"lora_name": 3, "lora_path": str(adapter)}, BadRequestError, "lora_name", "Invalid type"),
        ]
        for body, error, param, message in cases:
            with pytest.raises(error, match=message) as e:
                await engine.load_lora(orjson.dumps(body))
            assert e.value.param == param, body
        with pytest.raises(NotFoundError, match="none is loaded"):
            engine.unload_lora(orjson.dumps({"lora_name": "y"}))
        assert engine.router.lora_names() == [] and not _weights_left(engine)
        assert not getattr(engine.engine.adapters.model, "lora_adapters", None)
        # an adapter the device has no memory left for
        with monkeypatch.context() as m:
            def oom(*args):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
            m.setattr("llmserve.models.lora.compose", oom)
            with pytest.raises(BadRequestError, match="does not fit in the memory left"):
                await engine.load_lora(orjson.dumps({"lora_name": "y", "lora_path": str(adapter)}))
        # two loads of one name at once: one is served, the other refused
        results = await asyncio.gather(*(engine.load_lora(orjson.dumps({"lora_name": "y", "lora_path": str(adapter)}))
                                         for _ in range(2)), return_exceptions=True)
        assert sorted(type(r).__name__ for r in results) == ["BadRequestError", "tuple"], results
        assert engine.router.lora_names() == ["y"] and len(_weights_left(engine)) == 1
        await engine.drain()

    asyncio.run(main())


def test_a_path_not_found_is_said_in_one_line(monkeypatch):
    """A hub id the Hub cannot give says so in its first line, not the library's whole text."""
    from llmserve.engine.adapters import AdapterMissing, read_adapter
    from llmserve.loaders.checkpoint import LoadError

    def missing(path, log):
        raise LoadError(f"{path!r} is not here, and the Hub could not be reached: ConnectError\nAn error happened "
                        "while trying to locate the files on the Hub ...")

    monkeypatch.setattr("llmserve.loaders.load.local_folder", missing)
    with pytest.raises(AdapterMissing) as e:
        read_adapter("ph", "nobody/nothing-here", {})
    assert str(e.value) == ("LoRA adapter 'ph': 'nobody/nothing-here' is not here, and the Hub could not be reached: "
                            "ConnectError")


def test_a_resolver_adapter_may_name_the_default_models_hub_repository():
    """An adapter trained on the default model names its Hub repository as its base (PEFT
    writes `HuggingFaceTB/SmolLM2-135M-Instruct`): the resolver takes it (audit C: a 404);
    for a model given by path or id, that and the served names."""
    from llmserve.engine.adapters import resolver_bases

    assert resolver_bases(["SmolLM2-135M-Instruct"], None) == {"SmolLM2-135M-Instruct",
                                                                 "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert resolver_bases(["tiny", "t2"], "/models/tiny") == {"tiny", "t2", "/models/tiny"}


def test_a_resolver_folder_loads_the_adapter_a_request_names(served, tmp_path, caplog):
    """--lora-resolver-dir (vLLM's filesystem resolver): a request naming a subfolder whose
    adapter is made for this model loads it, and it is served from then on; a subfolder made
    for another model, a name reaching out of the folder, another spelling of a loaded
    subfolder's path, or none at all stay 404s; an adapter that cannot be served is a 400 at
    `model`."""
    import shutil

    from tiny import write_peft_adapter

    folder, adapter = served
    shutil.copytree(adapter, tmp_path / "sql")
    config = json.loads((folder / "config.json").read_text())
    write_peft_adapter(tmp_path / "other", config, ["q_proj"], config={"base_model_name_or_path": "someone/else"})
    write_peft_adapter(tmp_path.parent / "outside", config, ["q_proj"])
    write_peft_adapter(tmp_path / "odd", config, ["q_proj"], config={"base_model_name_or_path": ["tiny"]})
    write_peft_adapter(tmp_path / "team" / "nested", config, ["q_proj"])
    write_peft_adapter(tmp_path / "dora", config, ["q_proj"], config={"use_dora": True})
    engine = AsyncEngine(make_config(str(folder), served_model_name=["tiny"], num_kv_blocks=64, threads=1,
                                     lora_resolver_dir=str(tmp_path)))

    async def main():
        await engine.start()
        base = orjson.loads(await (await engine.submit("completion", _body("tiny"))).read_all())
        got = orjson.loads(await (await engine.submit("completion", _body("sql"))).read_all())
        assert got["model"] == "sql" and engine.router.lora_names() == ["sql"]
        assert got["choices"][0]["token_ids"] != base["choices"][0]["token_ids"]
        again = orjson.loads(await (await engine.submit("completion", _body("sql"))).read_all())
        assert again["choices"][0]["token_ids"] == got["choices"][0]["token_ids"]
        nested = orjson.loads(await (await engine.submit("completion", _body("team/nested"))).read_all())
        assert nested["model"] == "team/nested"
        for name in ("other", "odd", "../outside", str(tmp_path / "sql"), "missing", "", "sql/", "./sql", "sql/.",
                     "team//nested", "team/../sql", "team\\nested", "team", "sql\0"):
            with pytest.raises(NotFoundError):
                await engine.submit("completion", _body(name))
        with pytest.raises(BadRequestError) as e:
            await engine.submit("completion", _body("dora"))
        assert e.value.param == "model" and "dora" in e.value.message.lower(), e.value.message
        assert engine.router.lora_names() == ["sql", "team/nested"]
        # (whoever runs the server learns why a subfolder was not served)
        assert "'other' in " in caplog.text and "base_model_name_or_path 'someone/else'" in caplog.text
        await engine.drain()

    asyncio.run(main())


def test_max_loras_bounds_the_adapters_of_a_step(served):
    """--max-loras 1: requests for two adapters and the base model at once run with at most one
    adapter per step, and each gets what it gets alone."""
    folder, adapter = served
    engine = AsyncEngine(make_config(str(folder), served_model_name=["tiny"], num_kv_blocks=64, threads=1,
                                     lora_modules=[f"x={adapter}", f"y={adapter}"], max_loras=1))
    steps = []

    async def main():
        await engine.start()
        runner = engine.engine.runner
        execute = runner.execute

        def recording(plan):
            steps.append({int(i) for i in np.asarray(plan.lora_ids)})
            return execute(plan)

        runner.execute = recording
        alone = {name: orjson.loads(await (await engine.submit("completion", _body(name, max_tokens=6))).read_all())
                 for name in ("x", "tiny")}
        steps.clear()
        names = ["x", "y", "tiny", "y", "x"]
        streams = [await engine.submit("completion", _body(name, max_tokens=6)) for name in names]
        got = [orjson.loads(await s.read_all()) for s in streams]
        for name, body in zip(names, got):
            # (x and y are the same weights under two names)
            assert body["choices"][0]["token_ids"] == alone["tiny" if name == "tiny" else "x"]["choices"][0]["token_ids"]
        await engine.drain()

    asyncio.run(main())
    adapters = [s - {0} for s in steps]
    assert all(len(a) <= 1 for a in adapters), steps
    assert {1} in adapters and {2} in adapters and any(0 in s for s in steps), steps
