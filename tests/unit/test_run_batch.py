"""`llmserve run-batch`: an OpenAI batch file run offline, one answer per request line in its
order, each what the server would answer (errors with their status and param); lines that are
no request get an `error`; the answers equal the offline API's for the same requests."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from llmserve import cli
from llmserve.engine.offline import LLM

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 5, "temperature": 0, "n": 2}


def _line(custom_id: str, url: str, body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def answers(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("batch")
    lines = [
        _line("chat", "/v1/chat/completions", CHAT),
        _line("completion", "/v1/completions", COMPLETION),
        "",   # (blank lines are skipped)
        "{not json",
        json.dumps({"custom_id": "nowhere", "method": "POST", "url": "/v1/images", "body": {}}),
        _line("bad-max", "/v1/chat/completions", {**CHAT, "max_tokens": -1}),
        _line("streamed", "/v1/completions", {**COMPLETION, "stream": True}),
        _line("unknown-model", "/v1/completions", {**COMPLETION, "model": "other"}),
        _line("rerank", "/v1/rerank", {"model": "tiny", "query": "q", "documents": ["a b", "c"]}),
        _line("embed", "/v1/embeddings", {"model": "tiny", "input": "a b"}),
    ] + [_line(f"many-{i}", "/v1/completions", {**COMPLETION, "n": 1, "prompt": f"Numbers {i}"}) for i in range(5)]
    (folder / "in.jsonl").write_text("\n".join(lines) + "\n")
    status = cli.main(["run-batch", str(tiny_model), "--served-model-name", "tiny", "--threads", "1",
                       "--num-kv-blocks", "64", "-i", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl")])
    assert status == 0
    return [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]


def test_each_request_line_is_answered_in_its_place(answers):
    ids = [a["custom_id"] for a in answers]
    assert ids == ["chat", "completion", None, "nowhere", "bad-max", "streamed", "unknown-model", "rerank", "embed",
                   *[f"many-{i}" for i in range(5)]]
    assert len({a["id"] for a in answers}) == len(answers) and all(a["id"].startswith("batch_req_") for a in answers)
    ok = {a["custom_id"]: a for a in answers if a["error"] is None and a["response"]["status_code"] == 200}
    assert set(ok) == {"chat", "completion", "rerank", "embed", *[f"many-{i}" for i in range(5)]}
    chat = ok["chat"]["response"]
    assert chat["body"]["object"] == "chat.completion" and chat["request_id"] == chat["body"]["id"]
    assert len(ok["completion"]["response"]["body"]["choices"]) == 2
    assert sorted(r["index"] for r in ok["rerank"]["response"]["body"]["results"]) == [0, 1]
    # (an embeddings body holds no id: its request's, as the server's x-request-id says)
    assert ok["embed"]["response"]["request_id"].startswith("embd-")


def test_errors_are_answered_as_the_server_would(answers):
    by_id = {a["custom_id"]: a for a in answers}
    assert answers[2]["response"] is None and answers[2]["error"]["code"] == "invalid_json"
    assert by_id["nowhere"]["response"] is None and "/v1/images" in by_id["nowhere"]["error"]["message"]
    for custom_id, status, param in (("bad-max", 400, "max_tokens"), ("streamed", 400, "stream"),
                                     ("unknown-model", 404, "model")):
        response = by_id[custom_id]["response"]
        assert (response["status_code"], response["body"]["error"]["param"]) == (status, param), custom_id
        assert by_id[custom_id]["error"] is None


def test_the_output_may_replace_the_input(tiny_model, tmp_path):
    """The input is read whole before the output is written: one file for both is answered,
    not emptied (it was, before the model had read a line)."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text(_line("chat", "/v1/chat/completions", CHAT) + "\n")
    assert cli.main(["run-batch", str(tiny_model), "--served-model-name", "tiny", "--threads", "1",
                     "--num-kv-blocks", "64", "-i", str(batch), "-o", str(batch)]) == 0
    (answer,) = [json.loads(line) for line in batch.read_text().splitlines()]
    assert answer["custom_id"] == "chat" and answer["response"]["status_code"] == 200
    assert [p.name for p in tmp_path.iterdir()] == ["batch.jsonl"]


def test_fields_without_effect_are_logged_with_their_lines(tiny_model, tmp_path, caplog):
    """The server names fields without effect in a header; a batch run logs them, each set once
    with the lines (from 1) that sent it (audit B)."""
    batch = tmp_path / "batch.jsonl"
    lines = [_line("a", "/v1/completions", {**COMPLETION, "foo": 1}), _line("b", "/v1/completions", COMPLETION),
             _line("c", "/v1/chat/completions", {**CHAT, "foo": 2})]
    batch.write_text("\n".join(lines) + "\n")
    assert cli.main(["run-batch", str(tiny_model), "--served-model-name", "tiny", "--threads", "1",
                     "--num-kv-blocks", "64", "-i", str(batch), "-o", str(tmp_path / "out.jsonl")]) == 0
    told = [r.getMessage() for r in caplog.records if "had no effect" in r.getMessage()]
    assert told == ["these request fields had no effect: foo (lines 1, 3)"]
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [a["response"]["status_code"] for a in answers] == [200, 200, 200]


@pytest.mark.parametrize("damage, says", [
    ("not_utf8", "line 2 is not UTF-8 text"),
    ("output_folder", "is a folder"),
    ("no_model", "no_such_model"),
])
def test_a_run_that_cannot_be_done_writes_nothing(tmp_path, caplog, damage, says):
    """One line in the log and status 1, before the model loads where the files are at fault;
    no output file, whole or partial."""
    batch = tmp_path / "in.jsonl"
    batch.write_bytes(_line("a", "/v1/completions", COMPLETION).encode() + b"\n{\"x\": \"\xff\"}\n")
    if damage != "not_utf8":
        batch.write_text(_line("a", "/v1/completions", COMPLETION) + "\n")
    out = tmp_path / "out.jsonl"
    if damage == "output_folder":
        out.mkdir()
    model = str(tmp_path / "no_such_model")
    assert cli.main(["run-batch", model, "--threads", "1", "-i", str(batch), "-o", str(out)]) == 1
    assert says in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in.jsonl"] + ["out.jsonl"] * (damage == "output_folder"))


def test_answers_equal_the_offline_apis(answers, tiny_model):
    llm = LLM(str(tiny_model), served_model_name=("tiny",), threads=1, num_kv_blocks=64)
    by_id = {a["custom_id"]: a["response"]["body"] for a in answers if a["response"]}
    params = {k: v for k, v in CHAT.items() if k not in ("model", "messages")}
    assert by_id["chat"]["choices"][0]["message"]["content"] == llm.chat(CHAT["messages"], params).text
    for i in range(5):
        want = llm.generate(f"Numbers {i}", {"max_tokens": 5, "temperature": 0})[0].text
        assert by_id[f"many-{i}"]["choices"][0]["text"] == want


def test_a_run_closed_early_leaves_the_engine_as_before(tiny_model):
    """`run_to_end` (the offline API's and run-batch's loop): closed after its first output,
    the step in flight is dropped and the other requests aborted: no work, no KV block held;
    the engine then serves the next call."""
    from llmserve.engine.loop import run_to_end

    llm = LLM(str(tiny_model), served_model_name=("tiny",), threads=1, num_kv_blocks=64)
    engine = llm.engine
    body = json.dumps({**COMPLETION, "n": 1, "max_tokens": 30}).encode()
    run = run_to_end(engine.core, engine.runner, [engine.router.prepare("completion", body) for _ in range(3)])
    next(run)
    assert engine.core.has_work()
    run.close()
    assert not engine.core.has_work() and engine.core.stats()["used_blocks"] == 0
    assert llm.generate("The quick brown", {"max_tokens": 3})[0].usage["completion_tokens"] == 3


def test_a_terminated_run_writes_nothing(tiny_model, tmp_path):
    """SIGTERM (what `timeout`, systemd and Kubernetes send) ends a run as SIGINT does: status
    143, one line saying so, and no output file, whole or partial."""
    batch = tmp_path / "in.jsonl"
    long = {**COMPLETION, "n": 8, "max_tokens": None, "ignore_eos": True}   # (each to the end of the context)
    batch.write_text("".join(_line(f"long-{i}", "/v1/completions", long) + "\n" for i in range(500)))
    with subprocess.Popen([sys.executable, "-m", "llmserve.cli", "run-batch", str(tiny_model), "--served-model-name",
                            "tiny", "--threads", "1", "-i", str(batch), "-o", str(tmp_path / "out.jsonl")],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as run:
        try:
            deadline = time.monotonic() + 120
            while "engine ready" not in (line := run.stderr.readline()):
                assert line and time.monotonic() < deadline, "run-batch ended before its engine was ready"
            time.sleep(1.0)
            assert list(tmp_path.glob("out.jsonl.*.partial")) and run.poll() is None
            run.send_signal(signal.SIGTERM)
            _, err = run.communicate(timeout=60)
        finally:
            run.kill()
    assert run.returncode == 143, err
    assert "run-batch: terminated; no output written" in err
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]
