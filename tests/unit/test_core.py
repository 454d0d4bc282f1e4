"""llmserve._core from Python: a request round-trips Router -> Core -> commit -> bytes,
driven by a deterministic fake runner (no model, no torch)."""

from __future__ import annotations

import json
import time

import numpy as np
import orjson
import pytest

from llmserve import _core
from tiny import CHATML, SPECIALS, build_tokenizer

EOS = SPECIALS.index("<|im_end|>")


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_tokenizer(path)
    config = {"served_model_names": ["m"], "max_model_len": 256, "special_tokens": {"eos_token": "<|im_end|>"},
              "eos_token_ids": [EOS]}
    sources = {"cli": None, "folder_jinja": None, "tokenizer_config": CHATML, "gguf": None}
    return _core.Router(str(path), None, json.dumps(sources), json.dumps(config))


def make_core(router, **overrides):
    config = {"num_blocks": 128, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64,
              "max_model_len": 256, "enable_prefix_caching": True, "policy": "priority", **overrides}
    return _core.Core(router, json.dumps(config))


class FakeRunner:
    """Deterministic tokens: a function of the sequence and its position; never eos."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.steps = []

    def execute(self, plan):
        self.steps.append(plan)
        rows = plan.num_rows
        tokens = (plan.row_req_ids.astype(np.int64) * 31 + plan.gen_index * 7) % (self.vocab - 10) + 10
        return (tokens.astype(np.int64), np.full(rows, -0.5, np.float32),
                np.zeros((rows, 0), np.int64), np.zeros((rows, 0), np.float32))


def run(core, runner, max_steps=500, check=True):
    out = {}
    order = []
    for _ in range(max_steps):
        plan = core.schedule()
        if plan is None:
            break
        tokens, lps, tids, tlps = runner.execute(plan)
        for handle, data, finished, error, ntok, _ in core.commit(tokens, lps, tids, tlps):
            assert not (error and check)
            if handle not in order:
                order.append(handle)
            out.setdefault(handle, []).append(data)
    return out, order


def test_round_trip_chat(router):
    core = make_core(router)
    prepared = router.prepare("chat", orjson.dumps({
        "model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5}))
    assert prepared.id.startswith("chatcmpl-") and not prepared.stream
    handle = core.add(prepared)
    out, _ = run(core, FakeRunner(router.vocab_size))
    body = orjson.loads(b"".join(out[handle]))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    stats = core.stats()
    assert stats["running"] == 0 and stats["used_blocks"] == 0 and stats["requests"] == 0


def test_plan_columns_are_numpy(router):
    core = make_core(router)
    core.add(router.prepare("completion", orjson.dumps({"model": "m", "prompt": "Hello world",
                                                         "max_tokens": 2})))
    plan = core.schedule()
    assert isinstance(plan.input_ids, np.ndarray) and plan.input_ids.dtype == np.int64
    assert plan.block_tables.shape == (plan.num_seqs, plan.block_table_width)
    assert plan.query_start_loc[-1] == plan.num_tokens == len(plan.slot_mapping)


def test_abort_frees_blocks(router):
    core = make_core(router)
    handle = core.add(router.prepare("completion", orjson.dumps(
        {"model": "m", "prompt": "The quick brown fox " * 5, "max_tokens": 50})))
    runner = FakeRunner(router.vocab_size)
    plan = core.schedule()
    core.commit(*runner.execute(plan))
    assert core.stats()["used_blocks"] > 0
    assert core.abort(handle)
    assert core.stats()["used_blocks"] == 0 and not core.has_work()


def test_errors_carry_openai_fields(router):
    with pytest.raises(_core.NotFoundError) as e:
        router.prepare("chat", b'{"model": "x", "messages": [{"role": "user", "content": "a"}]}')
    assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")
    assert orjson.loads(e.value.body)["error"]["code"] == "model_not_found"
    with pytest.raises(_core.BadRequestError) as e:
        router.prepare("chat", b"{")
    assert e.value.status == 400 and isinstance(e.value, _core.ApiError)
    err = _core.Router.error("unavailable", "busy", retry_after=3)
    assert isinstance(err, _core.ServiceUnavailableError) and err.retry_after == 3 and err.status == 503


def test_priority_orders_the_queue(router):
    core = make_core(router, max_num_seqs=1)

    def add(priority):
        return core.add(router.prepare("completion", orjson.dumps(
            {"model": "m", "prompt": "Hello", "max_tokens": 3, "priority": priority})))

    first = add(0)
    runner = FakeRunner(router.vocab_size)
    core.commit(*runner.execute(core.schedule()))  # `first` is running now
    low = add(5)
    high = add(-1)
    _, order = run(core, runner)
    assert order.index(high) < order.index(low)
    assert order[0] == first


def test_fcfs_rejects_priority(router):
    core = make_core(router, policy="fcfs")
    with pytest.raises(_core.BadRequestError):
        core.add(router.prepare("completion", orjson.dumps(
            {"model": "m", "prompt": "Hello", "max_tokens": 3, "priority": 2})))


def test_stream_bytes_are_sse(router):
    core = make_core(router)
    handle = core.add(router.prepare("chat", orjson.dumps({
        "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})))
    out, _ = run(core, FakeRunner(router.vocab_size))
    text = b"".join(out[handle]).decode()
    frames = [f for f in text.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    usage = json.loads(frames[-2].removeprefix("data: "))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_a_token_the_grammar_rejects_fails_the_request(router):
    """The mask keeps sampled tokens inside the grammar; if one gets past it anyway (here a
    runner that ignores the mask), the request ends in a server error, not in "stop" with
    output the grammar does not accept, and its blocks are freed."""
    core = make_core(router)
    body = {"model": "m", "prompt": "Give JSON", "max_tokens": 8,
            "response_format": {"type": "json_object"}}
    runner = FakeRunner(router.vocab_size)
    ids = [router.prepare("completion", orjson.dumps({"model": "m", "prompt": t})).prompt_token_ids[0][-1]
           for t in ("{", "x")]
    outs = []
    for stream in (False, True):
        handle = core.add(router.prepare("completion", orjson.dumps({**body, "stream": stream})))
        for step in range(20):
            plan = core.schedule()
            if plan is None:
                break
            tokens, lps, tids, tlps = runner.execute(plan)
            tokens[:] = ids[min(step, 1)]  # "{" then "x": no JSON object goes on so
            outs += [o for o in core.commit(tokens, lps, tids, tlps) if o[0] == handle and o[2]]
    (_, body_bytes, finished, error, _, _), (_, sse, finished2, error2, _, _) = outs
    assert (finished, error, finished2, error2) == ("error", True, "error", True)
    err = orjson.loads(body_bytes)["error"]
    assert err["type"] == "server_error" and "Constrained decoding failed" in err["message"]
    assert sse.startswith(b"data: {\"error\"") and sse.endswith(b"data: [DONE]\n\n")
    stats = core.stats()
    assert stats["used_blocks"] == 0 and stats["requests"] == 0


def test_load_counts_a_request_while_its_first_step_runs(router):
    """/load and the gauges read EngineThread.stats: they are refreshed once a step is
    planned, so a request in a long first prefill counts as running, not as nothing."""
    import threading
    from types import SimpleNamespace

    from llmserve.engine.loop import EngineThread

    class BlockingRunner(FakeRunner):
        def __init__(self, vocab):
            super().__init__(vocab)
            self.entered, self.release = threading.Event(), threading.Event()

        def execute(self, plan):
            self.entered.set()
            assert self.release.wait(10)
            tokens, lps, tids, tlps = super().execute(plan)
            return SimpleNamespace(tokens=tokens, logprobs=lps, top_ids=tids, top_logprobs=tlps)

    core = make_core(router)
    runner = BlockingRunner(router.vocab_size)
    done = threading.Event()
    thread = EngineThread(core, runner, lambda outs: any(o[2] for o in outs) and done.set())
    thread.start()
    try:
        thread.post(("add", router.prepare("completion", orjson.dumps(
            {"model": "m", "prompt": "Hello world", "max_tokens": 1})), "t"))
        assert runner.entered.wait(10)
        assert (thread.stats["running"], thread.stats["waiting"]) == (1, 0)
        # while the step runs, posted requests wait; queued aborts (clients gone) are not
        # requests and must not count against --max-waiting
        for i in range(3):
            thread.post(("abort", f"gone-{i}"))
        thread.post(("add", router.prepare("completion", orjson.dumps(
            {"model": "m", "prompt": "next", "max_tokens": 1})), "t2"))
        assert thread.snapshot()[1] == 1
        # counted in sequences, as the Core counts its waiting ones: two prompts, two sampled
        # choices each
        thread.post(("add", router.prepare("completion", orjson.dumps(
            {"model": "m", "prompt": ["a", "b"], "n": 2, "temperature": 1, "max_tokens": 1})), "t3"))
        assert thread.snapshot()[1] == 5
        runner.release.set()
        assert done.wait(10)
    finally:
        runner.release.set()
        thread.stop()


def test_a_client_gone_from_the_queue_frees_its_place_at_once(router):
    """A waiting request whose client left stops counting against --max-waiting when the
    abort is posted, not when the step running ends: one still posted leaves the inbox, one
    waiting in the Core is no longer counted (the Core drops it after the step); one the
    plan already started counts as it runs until its abort applies."""
    import threading
    from types import SimpleNamespace

    from llmserve.engine.loop import EngineThread

    class GatedRunner(FakeRunner):
        """Each step waits for a permit; `entered` counts the steps begun."""

        def __init__(self, vocab):
            super().__init__(vocab)
            self.permits, self.entered = threading.Semaphore(0), threading.Semaphore(0)

        def execute(self, plan):
            self.entered.release()
            assert self.permits.acquire(timeout=10)
            tokens, lps, tids, tlps = super().execute(plan)
            return SimpleNamespace(tokens=tokens, logprobs=lps, top_ids=tids, top_logprobs=tlps)

    def add(token, n=1, max_tokens=4):
        body = {"model": "m", "prompt": token, "n": n, "temperature": 1, "max_tokens": max_tokens}
        thread.post(("add", router.prepare("completion", orjson.dumps(body)), token))

    runner = GatedRunner(router.vocab_size)
    finished = []
    thread = EngineThread(make_core(router, max_num_seqs=1), runner,
                          lambda outs: finished.extend((o[0], o[3]) for o in outs if o[2]))
    thread.start()
    try:
        def waiting():
            stats, unpublished = thread.snapshot()
            return stats["waiting"] + unpublished

        add("runs")
        assert runner.entered.acquire(timeout=10)          # step 1 runs "runs" (one slot)
        add("queued", n=2)                                 # posted while it runs
        add("left-inbox")
        assert waiting() == 3
        thread.post(("abort", "left-inbox"))               # still posted: leaves the inbox
        assert waiting() == 2
        runner.permits.release()
        assert runner.entered.acquire(timeout=10)          # step 2: "queued" waits in the Core
        assert thread.stats["waiting"] == 2 and waiting() == 2
        thread.post(("abort", "queued"))                   # its client left mid-step
        assert waiting() == 0 and thread.stats["waiting"] == 2
        add("next")
        assert waiting() == 1                              # counted; the gone request is not
        for _ in range(12):
            runner.permits.release()
        deadline = time.monotonic() + 10
        # (a step publishes its counts before it delivers its outputs)
        while not (thread.stats["waiting"] == 0 and thread.stats["running"] == 0 and len(finished) == 2) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (thread.stats["waiting"], thread.stats["running"], waiting()) == (0, 0, 0)
        assert sorted(finished) == [("next", False), ("runs", False)]   # (and neither failed)
        assert not thread._unstarted and not thread._abandoned   # (nothing left behind)
    finally:
        for _ in range(20):
            runner.permits.release()
        thread.stop()


class ScriptRunner(FakeRunner):
    """Every sequence generates the same scripted ids, in order."""

    def __init__(self, vocab: int, script: list[int]):
        super().__init__(vocab)
        self.script = script

    def execute(self, plan):
        tokens, lps, tids, tlps = super().execute(plan)
        tokens[:] = [self.script[min(g, len(self.script) - 1)] for g in plan.gen_index]
        return tokens, lps, tids, tlps


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_never_show_text_a_stop_string_trimmed(router, stream):
    """The stop string's tokens are generated (and counted in usage), but their logprobs do
    not go out: the logprob tokens spell the returned text. Streamed, a token's logprobs go
    out with the last of its text, never ahead of it."""
    text = " the cat sat. on the mat"
    script = router.prepare("completion", orjson.dumps({"model": "m", "prompt": text})).prompt_token_ids[0]
    core = make_core(router)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30,
            "logprobs": True, "stop": ["at. o"], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    handle = core.add(router.prepare("chat", orjson.dumps(body)))
    out, _ = run(core, ScriptRunner(router.vocab_size, script))
    if stream:
        chunks = [json.loads(f.removeprefix("data: ")) for f in b"".join(out[handle]).decode().split("\n\n")
                  if f.startswith("data: {")]
        content, shown = "", ""
        for chunk in chunks[:-1]:
            choice = chunk["choices"][0]
            content += choice["delta"].get("content") or ""
            shown += "".join(t["token"] for t in (choice["logprobs"] or {}).get("content", []))
            assert content.startswith(shown)
        usage = chunks[-1]["usage"]
    else:
        response = orjson.loads(b"".join(out[handle]))
        content = response["choices"][0]["message"]["content"]
        shown = "".join(t["token"] for t in response["choices"][0]["logprobs"]["content"])
        usage = response["usage"]
    assert content == shown == " the cat s"
    assert usage["completion_tokens"] == len(script[:script.index(81) + 1])  # through the "o"


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_of_half_a_character_follow_its_text(router, stream):
    """A token that ends inside a character has no text of its own yet: its logprobs go out
    with the token that completes the character, and not at all when a stop string trims that
    character away (the listed bytes spell the content, streamed or not)."""
    script = router.prepare("completion", orjson.dumps({"model": "m", "prompt": " 東京 🎉🎉 end"})).prompt_token_ids[0]
    core = make_core(router)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30,
            "logprobs": True, "stop": ["🎉 e"], "stream": stream}
    handle = core.add(router.prepare("chat", orjson.dumps(body)))
    out, _ = run(core, ScriptRunner(router.vocab_size, script))
    if stream:
        chunks = [json.loads(f.removeprefix("data: ")) for f in b"".join(out[handle]).decode().split("\n\n")
                  if f.startswith("data: {")]
        content, shown = "", b""
        for chunk in chunks:
            choice = chunk["choices"][0]
            content += choice["delta"].get("content") or ""
            listed = (choice["logprobs"] or {}).get("content", [])
            shown += b"".join(bytes(t["bytes"]) for t in listed)
            assert content.encode().startswith(shown)
            assert not listed or choice["delta"].get("content"), "logprobs ahead of their text"
    else:
        choice = orjson.loads(b"".join(out[handle]))["choices"][0]
        content = choice["message"]["content"]
        shown = b"".join(bytes(t["bytes"]) for t in choice["logprobs"]["content"])
    assert content == " 東京 🎉" and shown == content.encode()


@pytest.mark.parametrize("shown", [False, True])
def test_a_stopping_token_is_listed_only_when_its_text_is_shown(router, shown):
    """EOS (or a stop_token_ids token) ends the choice: counted in usage, but listed in
    logprobs only with include_stop_str_in_output, so the listed tokens spell the content."""
    words = router.prepare("completion", orjson.dumps({"model": "m", "prompt": " the cat"})).prompt_token_ids[0]
    core = make_core(router)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10,
            "logprobs": True, "include_stop_str_in_output": shown, "skip_special_tokens": False}
    handle = core.add(router.prepare("chat", orjson.dumps(body)))
    out, _ = run(core, ScriptRunner(router.vocab_size, [*words, EOS]))
    response = orjson.loads(b"".join(out[handle]))
    choice = response["choices"][0]
    listed = "".join(t["token"] for t in choice["logprobs"]["content"])
    assert choice["finish_reason"] == "stop"
    assert response["usage"]["completion_tokens"] == len(words) + 1
    assert listed == choice["message"]["content"]
    assert listed == (" the cat<|im_end|>" if shown else " the cat")


@pytest.mark.parametrize("stream", [False, True])
def test_completions_list_the_stopping_token(router, stream):
    """On completions the token that ended the choice (EOS, a stop_token_ids id) is listed in
    logprobs, as vLLM's and OpenAI's legacy completions list it, at the end of the text:
    lm-eval's loglikelihood (`echo`, `max_tokens: 1`) reads the sampled token as the last
    entry, and would otherwise score a continuation the model ends with EOS as 0."""
    words = router.prepare("completion", orjson.dumps({"model": "m", "prompt": " the cat"})).prompt_token_ids[0]
    base = {"model": "m", "prompt": "Hi there", "logprobs": 1, "stream": stream}

    def answer(script, **fields):
        core = make_core(router)
        handle = core.add(router.prepare("completion", orjson.dumps({**base, **fields})))
        out, _ = run(core, ScriptRunner(router.vocab_size, script))
        assert core.stats()["used_blocks"] == 0
        if not stream:
            return orjson.loads(b"".join(out[handle]))["choices"][0]
        frames = [orjson.loads(f[6:]) for f in b"".join(out[handle]).split(b"\n\n") if f.startswith(b"data: {")]
        lps = {"tokens": [], "token_logprobs": [], "text_offset": []}
        for c in (c for f in frames for c in f["choices"]):
            for key in lps:
                lps[key] += c["logprobs"][key]
        return {"text": "".join(c["text"] for f in frames for c in f["choices"]), "logprobs": lps}

    eos = answer([*words, EOS], max_tokens=10)
    assert eos["text"] == " the cat"
    tokens, offsets = eos["logprobs"]["tokens"], eos["logprobs"]["text_offset"]
    assert len(tokens) == len(words) + 1 and "".join(tokens[:-1]) == " the cat" and tokens[-1] == "<|im_end|>"
    assert offsets[-1] == offsets[0] + len(" the cat")
    stop_id = answer([*words, EOS], max_tokens=10, stop_token_ids=[words[-1]])
    assert stop_id["text"] == " the ca" and stop_id["logprobs"]["tokens"] == tokens[:-1]
    echo = answer([EOS], max_tokens=1, echo=True)
    assert echo["text"] == "Hi there"
    # (the fake runner computes no prompt logprobs: the server's are in test_echo_logprobs)
    assert echo["logprobs"]["tokens"][-1] == "<|im_end|>" and echo["logprobs"]["token_logprobs"][-1] == -0.5
    assert echo["logprobs"]["text_offset"][-1] == len("Hi there")


def test_a_token_the_stop_string_begins_inside_keeps_its_logprobs(router):
    """A token that holds text before the stop string as well as some of it is shown: its
    logprobs are part of the answer."""
    script = router.prepare("completion", orjson.dumps({"model": "m", "prompt": " the cat"})).prompt_token_ids[0]
    core = make_core(router)
    handle = core.add(router.prepare("completion", orjson.dumps(
        {"model": "m", "prompt": "Hi", "max_tokens": 10, "logprobs": 0, "stop": ["he c"]})))
    out, _ = run(core, ScriptRunner(router.vocab_size, script))
    choice = orjson.loads(b"".join(out[handle]))["choices"][0]
    assert choice["text"] == " t"
    assert choice["logprobs"]["tokens"] == [" the"] and choice["logprobs"]["text_offset"] == [len("Hi")]


def test_each_request_gets_its_own_number_of_alternatives(router):
    """The runner returns as many alternatives per row as the most any row of the step
    wants; a request lists only its own `top_logprobs` (chat; none when absent) or its own
    `logprobs` (completions, plus the sampled token), whatever shares its step."""
    letters = np.array([router.prepare("completion", orjson.dumps({"model": "m", "prompt": c}))
                        .prompt_token_ids[0][-1] for c in "qwxyz"], np.int64)

    class TopRunner(FakeRunner):
        def execute(self, plan):
            tokens, lps, _, _ = super().execute(plan)
            k = max(int(plan.num_logprobs.max()), 0)
            ids = np.tile(letters[:k], (len(tokens), 1))        # distinct texts
            return tokens, lps, ids, np.full((len(tokens), k), -1.0, np.float32)

    core = make_core(router)
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    handles = {
        "chat5": core.add(router.prepare("chat", orjson.dumps({**chat, "logprobs": True, "top_logprobs": 5}))),
        "chat1": core.add(router.prepare("chat", orjson.dumps({**chat, "logprobs": True, "top_logprobs": 1}))),
        "chat0": core.add(router.prepare("chat", orjson.dumps({**chat, "logprobs": True}))),
        "comp2": core.add(router.prepare("completion", orjson.dumps(
            {"model": "m", "prompt": "Hi", "max_tokens": 3, "logprobs": 2}))),
    }
    out, _ = run(core, TopRunner(router.vocab_size))
    body = {name: json.loads(b"".join(out[h])) for name, h in handles.items()}
    for name, want in (("chat5", 5), ("chat1", 1), ("chat0", 0)):
        entries = body[name]["choices"][0]["logprobs"]["content"]
        assert [len(e["top_logprobs"]) for e in entries] == [want] * 3, name
    tops = body["comp2"]["choices"][0]["logprobs"]["top_logprobs"]
    assert all(set(t) - {"q", "w"} <= {e} for t, e in zip(tops, body["comp2"]["choices"][0]["logprobs"]["tokens"])), tops


def test_a_finished_request_reports_each_choice_end(router):
    """The sixth item of a finished output: each choice's finish reason and completion
    tokens, in order (the metrics count each choice as vLLM counts each sequence)."""
    core = make_core(router)
    handle = core.add(router.prepare("completion", orjson.dumps({
        "model": "m", "prompt": "Hello", "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 3})))
    base = FakeRunner(router.vocab_size)
    data, ends = [], []
    for _ in range(50):
        plan = core.schedule()
        if plan is None:
            break
        tokens, lps, tids, tlps = base.execute(plan)
        # choice 1 ends at its third token, the others run to max_tokens
        tokens[(plan.row_seq_index == 1) & (plan.gen_index == 2)] = EOS
        for h, chunk, finished, error, ntok, choice_ends in core.commit(tokens, lps, tids, tlps):
            assert h == handle and not error
            data.append(chunk)
            ends.append(choice_ends) if finished else None
            assert finished or choice_ends == []
    body = orjson.loads(b"".join(data))
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop", "length"]
    assert body["usage"]["completion_tokens"] == 6 + 3 + 6
    assert ends == [[("length", 6), ("stop", 3), ("length", 6)]]


def chunks_of(data: list[bytes]) -> list[dict]:
    """The JSON chunks of an SSE body (not [DONE])."""
    frames = b"".join(data).decode().split("\n\n")
    return [json.loads(f.removeprefix("data: ")) for f in frames if f.startswith("data: {")]


def choice_pieces(chunks: list[dict], index: int) -> list[tuple[str, list[int], str | None]]:
    """Choice `index`'s chunks after its role chunk: (content, token ids, finish_reason)."""
    out = []
    for chunk in chunks:
        for c in chunk["choices"]:
            if c["index"] == index and not c["delta"].get("role"):
                out.append((c["delta"].get("content") or "", c.get("token_ids") or [], c["finish_reason"]))
    return out


@pytest.mark.parametrize("n", [1, 2])
def test_stream_interval_sends_a_chunk_per_interval(router, n):
    """--stream-interval 4: a choice's first token goes at once, then each chunk waits for 4
    tokens, and the last brings the rest with the finish. The content, ids and logprobs are
    those of a stream with interval 1, and a body not streamed is the same whatever the
    interval."""
    script = router.prepare("completion", orjson.dumps(
        {"model": "m", "prompt": " the cat sat on the mat and the dog sat on the log"})).prompt_token_ids[0]
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 11, "n": n,
            "temperature": 1.0, "seed": 5, "logprobs": True, "return_token_ids": True}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    def answer(interval, request):
        core = make_core(router, stream_interval=interval)
        handle = core.add(router.prepare("chat", orjson.dumps(request)))
        out, _ = run(core, ScriptRunner(router.vocab_size, script))
        assert core.stats()["used_blocks"] == 0
        return out[handle]

    for index in range(n):
        one = choice_pieces(chunks_of(answer(1, streamed)), index)
        four = choice_pieces(chunks_of(answer(4, streamed)), index)
        assert [len(ids) for _, ids, _ in one] == [1] * 11
        assert [len(ids) for _, ids, _ in four] == [1, 4, 4, 2]
        assert [f for *_, f in four] == [None, None, None, "length"]
        assert "".join(t for t, *_ in four) == "".join(t for t, *_ in one)
        assert sum((ids for _, ids, _ in four), []) == script[:11]
    usage = [c["usage"]["completion_tokens"] for c in chunks_of(answer(4, streamed)) if c["choices"]]
    assert usage == sorted(usage) and usage[-1] == 11 * n
    four, one = ({k: v for k, v in orjson.loads(b"".join(answer(interval, body))).items() if k not in ("id", "created")}
                 for interval in (4, 1))
    assert four == one


def test_a_step_with_drafts_streams_one_chunk_per_choice(router):
    """A step that confirms several drafts sends its tokens in one chunk, as vLLM does: one
    chunk per step, with the text and ids of a stream without drafts."""
    script = router.prepare("completion", orjson.dumps(
        {"model": "m", "prompt": " the cat the cat the cat the cat the cat the cat the cat"})).prompt_token_ids[0]
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 14,
            "return_token_ids": True, "stream": True}

    def pieces(**config):
        core = make_core(router, **config)
        handle = core.add(router.prepare("chat", orjson.dumps(body)))
        runner = ScriptRunner(router.vocab_size, script)
        out, _ = run(core, runner)
        steps = sum(1 for plan in runner.steps if plan.num_rows)
        return choice_pieces(chunks_of(out[handle]), 0), steps

    plain, _ = pieces()
    drafted, steps = pieces(speculation={"num_tokens": 4, "lookup_min": 1, "lookup_max": 2}, draft_step_tokens=24)
    assert [len(ids) for _, ids, _ in plain] == [1] * 14
    assert len(drafted) == steps < 14 and max(len(ids) for _, ids, _ in drafted) > 1
    assert "".join(t for t, *_ in drafted) == "".join(t for t, *_ in plain)
    assert sum((ids for _, ids, _ in drafted), []) == script[:14]
    assert drafted[-1][2] == "length" and [f for *_, f in drafted[:-1]] == [None] * (steps - 1)


class MaskRunner(FakeRunner):
    """Each row samples the script's token at its gen_index when its mask allows it, else the
    lowest token its mask allows. Records each plan's rows as (gen_index, the input token at
    its logits position, its mask or None)."""

    def __init__(self, vocab: int, script: list[int]):
        super().__init__(vocab)
        self.script = script
        self.rows = []

    def execute(self, plan):
        tokens, lps, tids, tlps = super().execute(plan)
        masks = {int(r): np.asarray(plan.token_bitmask[i]).copy() for i, r in enumerate(plan.mask_rows)}
        rows = []
        for r in range(plan.num_rows):
            g = int(plan.gen_index[r])
            want = self.script[min(g, len(self.script) - 1)]
            mask = masks.get(r)
            if mask is not None:
                allowed = np.flatnonzero((mask[:, None] >> np.arange(32)) & 1)
                tokens[r] = want if want in allowed else allowed[0]
            else:
                tokens[r] = want
            rows.append((g, int(plan.input_ids[plan.logits_indices[r]]), mask))
        self.rows.append(rows)
        return tokens, lps, tids, tlps


def check_draft_masks(runner: MaskRunner, reference: MaskRunner, ref_tokens: list[int]) -> tuple[int, int]:
    """Each plan's draft rows (one sequence): a row whose drafts are the reference answer's
    tokens has the mask decoding gave that token (`reference`, run without drafts); after a
    draft the row before may not sample, each row has that row's mask. Returns how many rows
    of each kind there were."""
    same = lambda a, b: (a is None and b is None) or (a is not None and b is not None and (a == b).all())  # noqa: E731
    ref_masks = {g: m for rows in reference.rows for g, _, m in rows}
    live = dead = 0
    for rows in runner.rows:
        alive = True
        for j, (g, draft, mask) in enumerate(rows[1:], 1):
            before = rows[j - 1][2]
            alive = alive and (before is None or bool((before[draft // 32] >> (draft % 32)) & 1))
            if not alive:
                assert same(mask, before), (g, j)
                dead += 1
            elif all(r[1] == ref_tokens[r[0] - 1] for r in rows[1:j + 1]):
                assert same(mask, ref_masks[g]), (g, j)
                live += 1
    return live, dead


def answers_with_and_without_drafts(router, kind: str, body: dict, script: list[int]):
    """`body` run by a MaskRunner on `script`, without drafts then with n-gram drafts: (the
    body, its runner) for each, and the stats of the run with drafts."""
    def answer(**config):
        core = make_core(router, **config)
        handle = core.add(router.prepare(kind, orjson.dumps(body)))
        runner = MaskRunner(router.vocab_size, script)
        out, _ = run(core, runner)
        assert core.stats()["used_blocks"] == 0
        return orjson.loads(b"".join(out[handle])), runner, core.stats()

    plain, reference, _ = answer()
    drafted, runner, stats = answer(speculation={"num_tokens": 4, "lookup_min": 1, "lookup_max": 2},
                                    draft_step_tokens=24)
    return (plain, reference), (drafted, runner), stats


def test_a_grammar_masks_each_draft_row_after_the_drafts_before_it(router):
    """With drafts, a constrained sequence's draft rows are masked as decoding would mask
    them once the drafts before them are taken; after a draft the row before may not sample,
    the rows copy that row's mask (none of them can be kept). The answer is the one without
    drafts."""
    text = '{"a": [1, 2, 1, 2, 1, 2], "b": [1, 2, 1, 2, 1, 2, 1, 2]}'
    script = router.prepare("completion", orjson.dumps({"model": "m", "prompt": text})).prompt_token_ids[0]
    script = script[:9] + [script[3]] + script[9:]          # a token the grammar refuses there
    body = {"model": "m", "prompt": text[:20], "max_tokens": 50, "response_format": {"type": "json_object"}}
    (plain, reference), (drafted, runner), stats = answers_with_and_without_drafts(router, "completion", body, script)
    assert drafted["choices"] == plain["choices"]
    assert stats["spec_accepted_tokens"] > 10
    text = plain["choices"][0]["text"]
    ref_tokens = router.prepare("completion", orjson.dumps({"model": "m", "prompt": text})).prompt_token_ids[0]
    live, dead = check_draft_masks(runner, reference, ref_tokens)
    assert live > 5 and dead > 0, (live, dead)


def router_with(folder, added: list[str], **config):
    """A Router (and its tokenizer) over the tiny tokenizer with `added` as added tokens (not
    special, as Qwen3's <think>), its config extended by `config`."""
    from tokenizers import AddedToken, Tokenizer

    path = folder / "tokenizer.json"
    build_tokenizer(path)
    tok = Tokenizer.from_file(str(path))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.save(str(path))
    config = {"served_model_names": ["m"], "max_model_len": 256, "special_tokens": {"eos_token": "<|im_end|>"},
              "eos_token_ids": [EOS], **config}
    sources = {"cli": None, "folder_jinja": None, "tokenizer_config": CHATML, "gguf": None}
    return _core.Router(str(path), None, json.dumps(sources), json.dumps(config)), tok


@pytest.fixture(scope="module")
def think_router(tmp_path_factory):
    return router_with(tmp_path_factory.mktemp("think"), ["<think>", "</think>"], reasoning_parser="think")


@pytest.mark.parametrize("grammar", [False, True])
def test_a_thinking_budget_masks_each_draft_row_after_the_drafts_before_it(think_router, grammar):
    """thinking_token_budget with drafts: a draft row past the budget is forced to `</think>`
    as decoding would force it (here the step after `<think>` and four thought tokens drafts
    across the budget), and with a grammar after the thinking also masked by it; the answer,
    its thinking and usage are those without drafts."""
    router, tok = think_router
    thought, answer_text = " a b a b a b a b a b a b", ' {"a": [1, 2, 1, 2, 1, 2, 1, 2]}'
    script = tok.encode("<think>" + thought + "</think>" + answer_text, add_special_tokens=False).ids
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
            "thinking_token_budget": 5, "return_token_ids": True}
    if grammar:
        body["response_format"] = {"type": "json_object"}
    (plain, reference), (drafted, runner), stats = answers_with_and_without_drafts(router, "chat", body, script)
    assert drafted["choices"] == plain["choices"] and drafted["usage"] == plain["usage"]
    ids = plain["choices"][0]["token_ids"]
    assert ids[6] == tok.token_to_id("</think>") and plain["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5
    assert stats["spec_accepted_tokens"] > 5
    live, _ = check_draft_masks(runner, reference, ids)
    close = tok.token_to_id("</think>")
    forced = [g for rows in runner.rows for g, _, m in rows[1:]
              if m is not None and np.flatnonzero((m[:, None] >> np.arange(32)) & 1).tolist() == [close]]
    assert live > 3 and forced == [6], (live, forced)


@pytest.mark.parametrize("config", [{"stream_interval": 4}, {"speculation": {"num_tokens": 5, "lookup_min": 1,
                                                                             "lookup_max": 3}, "draft_step_tokens": 24}])
def test_text_after_a_call_never_cuts_its_arguments_short(tmp_path, config):
    """A choice a tool-call parser reads is pushed token by token, whatever the interval or
    drafts: pushed together, the text after a call went out ahead of the call's last pieces,
    and Messages' and Responses' streams closed the call there (its arguments cut short)."""
    router, tok = router_with(tmp_path, ["<tool_call>", "</tool_call>"], tool_call_format="hermes")
    text = 'a b a b a b hello <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> bye. the end'
    script = tok.encode(text, add_special_tokens=False).ids + [EOS]
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    bodies = {"messages": {"model": "m", "max_tokens": 120, "stream": True, "messages": [{"role": "user", "content": text}],
                           "tools": [{"name": "f", "input_schema": schema}]},
              "responses": {"model": "m", "max_output_tokens": 120, "stream": True, "input": text,
                            "tools": [{"type": "function", "name": "f", "parameters": schema}]}}
    for kind, body in bodies.items():
        core = make_core(router, **config)
        handle = core.add(router.prepare(kind, orjson.dumps(body)))
        out, _ = run(core, ScriptRunner(router.vocab_size, script))
        events = [json.loads(line[6:]) for line in b"".join(out[handle]).decode().split("\n")
                  if line.startswith("data: {")]
        if kind == "messages":
            args = "".join(e["delta"]["partial_json"] for e in events
                           if e.get("type") == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
        else:
            args = next(e["arguments"] for e in events if e.get("type") == "response.function_call_arguments.done")
        assert json.loads(args) == {"x": 1}, (kind, args)
    # chat: the merged stream sums to the stream of one token a push, each call's id and name
    # before its arguments
    chat = {"model": "m", "max_tokens": 120, "stream": True, "messages": [{"role": "user", "content": text}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}

    def summed(**config):
        core = make_core(router, **config)
        handle = core.add(router.prepare("chat", orjson.dumps(chat)))
        out, _ = run(core, ScriptRunner(router.vocab_size, script))
        content, calls, finish = "", {}, []
        for chunk in chunks_of(out[handle]):
            for c in chunk["choices"]:
                content += c["delta"].get("content") or ""
                for t in c["delta"].get("tool_calls") or []:
                    assert t["index"] in calls or t.get("id"), "arguments before the call's id"
                    name, args = calls.get(t["index"], ("", ""))
                    calls[t["index"]] = (name + (t["function"].get("name") or ""), args + t["function"]["arguments"])
                finish += [c["finish_reason"]] if c["finish_reason"] else []
        return content, calls, finish

    assert summed(**config) == summed() == ("a b a b a b hellobye. the end", {0: ("f", '{"x": 1}')}, ["tool_calls"])


def test_a_failed_stream_sends_what_it_held_first(router):
    """With --stream-interval, tokens waiting for the interval go out before the error frame of
    a request that fails (here a runner that ignores the grammar's mask)."""
    ids = router.prepare("completion", orjson.dumps({"model": "m", "prompt": '{"a": 1, "b": 2, "c": 3 x'})).prompt_token_ids[0]
    texts = []
    for interval in (1, 4):
        core = make_core(router, stream_interval=interval)
        handle = core.add(router.prepare("completion", orjson.dumps({
            "model": "m", "prompt": "J", "max_tokens": 30, "stream": True, "response_format": {"type": "json_object"}})))
        out, _ = run(core, ScriptRunner(router.vocab_size, ids), check=False)
        data = b"".join(out[handle])
        assert b'data: {"error"' in data and data.endswith(b"data: [DONE]\n\n")
        texts.append("".join(c["choices"][0]["text"] for c in chunks_of([data]) if c.get("choices")))
    assert texts[0] == texts[1] == '{"a": 1, "b": 2, "c": 3'
