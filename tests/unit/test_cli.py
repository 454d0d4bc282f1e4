"""`llmserve run`'s process set-up: the OpenMP spin default is set before torch loads (it is
read once, when libgomp loads), and never over what the environment already says; a bad flag
or environment value stops it with status 2 and a one-line message, before it binds or loads
anything (the config sections check their values, for embedding applications too)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmserve import cli
from llmserve.config import CacheConfig, Config, ModelConfig, ServerConfig, parse_bytes


def test_the_cli_module_does_not_load_torch():
    code = "import sys, llmserve.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_package_lists_its_lazy_names_without_loading_torch():
    code = "import sys, llmserve; print(set(llmserve.__all__) <= set(dir(llmserve)), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_python_dash_m_runs_the_command():
    out = subprocess.run([sys.executable, "-m", "llmserve", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("llmserve ")


def test_short_openmp_spin_respects_the_environment(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cli._short_openmp_spin()
    assert cli.os.environ["GOMP_SPINCOUNT"] == "100000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    cli._short_openmp_spin()
    assert cli.os.environ["GOMP_SPINCOUNT"] == "5"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    cli._short_openmp_spin()
    assert "GOMP_SPINCOUNT" not in cli.os.environ


@pytest.mark.parametrize("args,env,message", [
    (["--block-size", "0"], {}, "--block-size must be at least 1; got 0"),
    (["--max-waiting", "-1"], {}, "--max-waiting must be at least 1"),
    (["--max-body-bytes", "0"], {}, "--max-body-bytes must be at least 1"),
    (["--max-model-len", "1"], {}, "--max-model-len must be at least 2"),
    # counts the core holds in 32 bits, and numbers past any machine's
    (["--max-num-seqs", "99999999999999999999"], {}, "--max-num-seqs must be at most 2147483647"),
    (["--num-kv-blocks", "1000000000000"], {}, "--num-kv-blocks must be at most 2147483647"),
    (["--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"], {}, "--ssl-cert-reqs 2 needs --ssl-ca-certs"),
    (["--uds", ""], {}, "--uds must name the socket's path"),
    (["--num-kv-blocks", "0"], {}, "--num-kv-blocks must be at least 1"),
    (["--threads", "0"], {}, "--threads must be at least 1"),
    (["--port", "99999"], {}, "--port must be at least 0 and at most 65535"),
    (["--sse-keep-alive", "-1"], {}, "--sse-keep-alive must be at least 0.1"),
    (["--gpu-memory-utilization", "1.5"], {}, "--gpu-memory-utilization must be greater than 0 and at most 1"),
    (["--kv-cache-memory", "0"], {}, "--kv-cache-memory must be greater than 0"),
    (["--kv-cache-memory", "12XB"], {}, "--kv-cache-memory: not a memory size"),
    (["--device", "tpu"], {}, "--device must be one of auto, cpu, cuda"),
    (["--generation-config", "foo"], {}, "--generation-config must be auto, none or a folder holding a "
                                         "generation_config.json; 'foo' is not a folder"),
    (["--scheduling-policy", "lifo"], {}, "--scheduling-policy must be one of fcfs, priority"),
    # (a value of vLLM's flag name is refused naming that name too)
    (["--tool-call-parser", "pythonic"], {}, "--tool-call-format (--tool-call-parser) must be one of hermes"),
    (["--api-key", ""], {}, "--api-key must not be empty"),
    (["--served-model-name", " "], {}, "--served-model-name must not be empty"),
    (["--api-key", "k1 "], {}, "--api-key must not begin or end with whitespace; got a value"),
    (["--api-key", "k1", "--api-key", "k1"], {}, "--api-key: the same value is given more than once"),
    (["--served-model-name", "a", "--served-model-name", "a"], {}, "--served-model-name 'a' is given more than once"),
    (["--served-model-name", "a\nb"], {}, "--served-model-name must hold no control or invisible characters; got 'a\\nb'"),
    (["--api-key", "k\x1b1"], {}, "--api-key must hold no control or invisible characters; got a value"),
    ([], {"LLMSERVE_API_KEY": "k1,k2,k1"}, "LLMSERVE_API_KEY holds a key more than once"),
    ([], {"LLMSERVE_API_KEY": "k1,k\x012"}, "LLMSERVE_API_KEY must hold no control or invisible characters"),
    ([], {"LLMSERVE_ADMIN_API_KEY": "a\u200bb"}, "LLMSERVE_ADMIN_API_KEY must hold no control or invisible"),
    (["--chat-template", "/no/such/template.jinja"], {}, "neither a readable file nor a Jinja template"),
    (["--allowed-origins", "http://a.example/"], {},
     "--allowed-origins 'http://a.example/' is not an origin as browsers send it"),
    (["--allowed-origins", "HTTPS://App.example:443"], {}, "did you mean 'https://app.example'?"),
    (["--allowed-origins", "app.example"], {}, "--allowed-origins 'app.example' is not an origin"),
    ([], {"LLMSERVE_API_KEY": " , "}, "LLMSERVE_API_KEY is set but holds no key"),
    ([], {"LLMSERVE_API_KEY": ""}, "LLMSERVE_API_KEY is set but holds no key"),   # (a secret not filled in)
    ([], {"LLMSERVE_ADMIN_API_KEY": ""}, "LLMSERVE_ADMIN_API_KEY is set but holds no key"),
    ([], {"LLMSERVE_ADMIN_API_KEY": "a,a"}, "LLMSERVE_ADMIN_API_KEY holds a key more than once"),
    (["--api-key", "k", "--admin-api-key", "k"], {}, "an --admin-api-key must be a key of its own"),
    ([], {"LLMSERVE_LOG_LEVEL": "bogus"}, "LLMSERVE_LOG_LEVEL must be one of"),
    (["--served-model-name", "a", "x.gguf"], {}, "--served-model-name took 'x.gguf' as a second name"),
    (["--kv-cache-memory", "0.5"], {}, "--kv-cache-memory must be greater than 0; got 0.5 (0 bytes)"),
    (["--lora-modules", "a=/x", "/path/model"], {}, "--lora-modules '/path/model': give NAME=PATH (the name "
                                                    "clients send as `model`, then the adapter's folder); if it is "
                                                    "the model, give it first"),
    (["--lora-modules", "a=/x", "a=/y"], {}, "--lora-modules names 'a' twice"),
    (["--served-model-name", "a", "--lora-modules", "a=/x"], {}, "--lora-modules names 'a', which is also a "
                                                                 "--served-model-name"),
    (["--lora-modules", "{\"name\": \"a\"}"], {}, "the JSON form is {\"name\": NAME, \"path\": PATH}"),
    (["--override-generation-config", "{\"temp\": 1}"], {}, "'temp' is not one of temperature"),
    (["--override-generation-config", "{\"top_p\": 2}"], {}, "top_p must be a number from 0 to 1, got 2"),
    (["--override-generation-config", "{\"repetition_penalty\": Infinity}"], {},
     "repetition_penalty must be a finite number above 0, got inf"),
    (["--default-chat-template-kwargs", "enable_thinking=false"], {}, "--default-chat-template-kwargs must be a JSON "
                                                                     "object: Expecting value"),
    (["--default-chat-template-kwargs", "[1]"], {}, "must be a JSON object such as '{\"enable_thinking\": false}'"),
])
def test_bad_values_stop_with_status_2_before_anything_starts(monkeypatch, capsys, args, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("llmserve.server.app.serve", lambda cfg: pytest.fail("served"), raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", *args])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_served_model_names_come_several_to_a_flag_or_one_a_flag(tmp_path):
    """vLLM's `--served-model-name a b` and our repeated flag; the model may come first."""
    for args in (["run", "--served-model-name", "a", "b", "--served-model-name", "c"],
                 ["run", str(tmp_path), "--served-model-name", "a", "b", "c"]):
        cfg = cli.config_from_args(cli.build_parser().parse_args(args))
        assert cfg.model.served_model_name == ("a", "b", "c"), args
    assert cfg.model.model == str(tmp_path)
    # a model after the names would be read as one more name: refused, naming it
    for model in (str(tmp_path), "x.gguf", "Qwen/Qwen2.5-0.5B-Instruct"):
        with pytest.raises(ValueError, match=f"took '{model}' as a second name; if it is the model, give it first"):
            cli.config_from_args(cli.build_parser().parse_args(["run", "--served-model-name", "a", model]))
    # an org/name alias of the default model is fine on a flag of its own, or with a model
    for args in (["--served-model-name", "org/name", "--served-model-name", "b"],
                 [str(tmp_path), "--served-model-name", "a", "org/name"]):
        names = cli.config_from_args(cli.build_parser().parse_args(["run", *args])).model.served_model_name
        assert "org/name" in names


def test_lora_modules_take_vllms_two_forms(tmp_path):
    cfg = _config(["--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}',
                   "--lora-modules", "c=/z=w"])
    assert cfg.model.lora_adapters() == [("a", "/x", None), ("b", "/y", "m"), ("c", "/z=w", None)]


def _config(args):
    return cli.config_from_args(cli.build_parser().parse_args(["run", *args]))


def _logs(caplog, args: list[str], lines: list[str]) -> None:
    """`llmserve run ARGS` (with serving stubbed out) starts and logs each of `lines`."""
    caplog.clear()
    with caplog.at_level("INFO", logger="llmserve"):
        assert cli.main(["run", *args]) == 0
    for line in lines:
        assert line in caplog.text, line


def test_vllm_spellings_are_taken(monkeypatch, caplog, tmp_path):
    """What a `vllm serve` command line carries over: --tool-call-parser (--tool-call-format's
    vLLM name), --async-scheduling alone and --no-async-scheduling, --allowed-origins as a JSON
    list, VLLM_API_KEY, VLLM_ALLOW_RUNTIME_LORA_UPDATING, VLLM_LORA_RESOLVER_CACHE_DIR, and the
    flags that mean nothing here
    (accepted, and said so)."""
    assert _config(["--tool-call-parser", "hermes"]).model.tool_call_format == "hermes"
    kwargs = _config(["--default-chat-template-kwargs", '{"enable_thinking": false}']).model.template_kwargs()
    assert kwargs == {"enable_thinking": False}
    for text, tokens in (("4096", 4096), ("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("32.2k", 32200)):
        assert _config(["--max-model-len", text]).model.max_model_len == tokens
    assert _config(["--async-scheduling"]).scheduler.async_scheduling == "on"
    assert _config(["--no-async-scheduling"]).scheduler.async_scheduling == "off"
    assert _config(["--enforce-eager"]).device.enforce_eager and not _config([]).device.enforce_eager
    assert _config([]).scheduler.async_scheduling == "auto"
    origins = _config(["--allowed-origins", '["https://a.example", "*"]', "--allowed-origins", "null"])
    assert origins.server.allowed_origins == ("https://a.example", "*", "null")
    cors = _config(["--allowed-methods", '["*"]', "--allowed-headers", "x-a", "--allow-credentials"]).server
    assert (cors.allowed_methods, cors.allowed_headers, cors.allow_credentials) == (("*",), ("x-a",), True)
    with pytest.raises((ValueError, SystemExit)):
        _config(["--allowed-methods", "get it"])
    monkeypatch.delenv("LLMSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "v1,part")   # (one key, as vLLM reads it)
    assert _config([]).server.api_key == ("v1,part",)
    monkeypatch.setenv("VLLM_API_KEY", "")   # (empty: none, as in vLLM)
    assert _config([]).server.api_key == ()
    monkeypatch.setenv("VLLM_API_KEY", " v1")
    with pytest.raises(ValueError, match="VLLM_API_KEY must hold no surrounding whitespace"):
        _config([])
    monkeypatch.setenv("VLLM_API_KEY", "v1")
    assert _config([]).server.api_key == ("v1",)
    assert _config(["--api-key", "k"]).server.api_key == ("k",)
    monkeypatch.setenv("LLMSERVE_API_KEY", "l1")
    assert _config([]).server.api_key == ("l1",)   # (ours first)
    monkeypatch.setenv("LLMSERVE_ADMIN_API_KEY", "a1, a2")
    assert _config([]).server.admin_api_key == ("a1", "a2")
    assert _config(["--admin-api-key", "f"]).server.admin_api_key == ("f",)   # (the flag first)
    monkeypatch.delenv("LLMSERVE_ADMIN_API_KEY")
    assert not _config([]).model.allow_runtime_lora_updating
    assert _config(["--allow-runtime-lora-updating"]).model.allow_runtime_lora_updating
    for value, on in (("True", True), ("1", True), ("false", False), ("0", False), ("", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert _config([]).model.allow_runtime_lora_updating == on, value
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(tmp_path))
    assert _config([]).model.lora_resolver_dir == str(tmp_path)
    assert _config(["--lora-resolver-dir", "."]).model.lora_resolver_dir == "."   # (the flag first)
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is not a folder"):
        _config([])
    monkeypatch.delenv("VLLM_LORA_RESOLVER_CACHE_DIR")
    monkeypatch.setattr("llmserve.server.app.serve", lambda cfg: 0, raising=False)
    _logs(caplog, ["--trust-remote-code", "--enable-auto-tool-choice", "--enable-lora", "--max-lora-rank", "64",
                   "--max-cpu-loras", "4"], [
        "--trust-remote-code has no effect: llmserve runs no code from model repositories",
        '--enable-auto-tool-choice has no effect: tool_choice "auto" is always on',
        "--enable-lora has no effect: LoRA adapters are served whenever --lora-modules names some",
        "--max-lora-rank has no effect: adapters of any rank are served",
        "--max-cpu-loras has no effect: every LoRA adapter served is held in memory at once",
    ])
    # --max-loras is served: it bounds the adapters running at once (0, the default: no bound)
    assert _config(["--max-loras", "2"]).model.max_loras == 2
    assert _config([]).model.max_loras == 0
    with pytest.raises((ValueError, SystemExit)):
        _config(["--max-loras", "-1"])
    assert _config(["--download-dir", "/models"]).model.download_dir == "/models"
    assert _config(["--tokenizer", "org/tok"]).model.tokenizer == "org/tok"
    assert _config(["--tokenizer-revision", "v2"]).model.tokenizer_revision == "v2"
    assert [_config(a).cache.kv_cache_dtype for a in ([], ["--kv-cache-dtype", "fp8"])] == ["auto", "fp8"]
    # vLLM's other names for a dtype are that dtype
    assert [_config(["--dtype", d]).model.dtype for d in ("half", "float")] == ["float16", "float32"]
    # and vLLM's `vllm` (no generation_config.json: the server's own defaults) is `none`
    assert _config(["--generation-config", "vllm"]).model.generation_config == "none"
    # vLLM's name for --no-access-log
    assert (_config([]).server.access_log, _config(["--disable-uvicorn-access-log"]).server.access_log) == (True, False)
    overrides = _config(["--override-generation-config", '{"temperature": 0.2}']).model.generation_overrides()
    assert overrides == {"temperature": 0.2}
    # the values that ask for what llmserve does anyway are taken, and said to do nothing
    _logs(caplog, ["--tensor-parallel-size", "1", "-tp", "1", "--pipeline-parallel-size=1",
                   "--lora-dtype", "auto", "--disable-log-stats", "--load-format", "auto",
                   "--enable-chunked-prefill", "--enable-prompt-tokens-details", "--enable-server-load-tracking",
                   "--disable-fastapi-docs", "--disable-custom-all-reduce", "--swap-space", "4",
                   "--disable-frontend-multiprocessing", "--guided-decoding-backend", "xgrammar",
                   "--tokenizer-mode", "auto", "--response-role", "assistant", "--log-error-stack"], [
        "--tensor-parallel-size 1 has no effect: llmserve runs a model on one device",
        "--disable-log-stats has no effect: nothing is logged periodically",
        "--load-format auto has no effect: the weights are read in the format of the model's files",
        "--enable-chunked-prefill has no effect: prompts longer than a step's token budget",
        "--swap-space has no effect: a sequence preempted when the KV cache runs out recomputes",
        *(f"{flag} has no effect: " for flag in ("--enable-prompt-tokens-details", "--enable-server-load-tracking",
                                                 "--disable-fastapi-docs", "--disable-custom-all-reduce",
                                                 "--disable-frontend-multiprocessing",
                                                 "--guided-decoding-backend")),
        "--tokenizer-mode auto has no effect: the model's own tokenizer.json runs in HF tokenizers",
        "--response-role assistant has no effect: an answer's role is always OpenAI's `assistant`",
        "--log-error-stack has no effect: an unexpected error (a 500) is always logged with its stack",
    ])
    _logs(caplog, ["--data-parallel-size", "1", "--preemption-mode", "recompute", "--logprobs-mode", "raw_logprobs",
                   "--enable-reasoning", "--exclude-tools-when-tool-choice-none", "--max-parallel-loading-workers",
                   "2", "--use-tqdm-on-load"], [
        "--data-parallel-size 1 has no effect: one process serves one model on one device",
        "--preemption-mode recompute has no effect: a sequence preempted when the KV cache runs out recomputes",
        "--logprobs-mode raw_logprobs has no effect: logprobs are the model's raw ones",
        "--enable-reasoning has no effect: the reasoning parser is on whenever the chat template opens <think>",
        '--exclude-tools-when-tool-choice-none has no effect: under tool_choice "none" the tools are never rendered',
        "--max-parallel-loading-workers has no effect: the weights are read in one pass",
        "--use-tqdm-on-load has no effect: ",
    ])
    _logs(caplog, ["--runner", "pooling", "--convert", "embed", "--task", "generate", "--skip-mm-profiling",
                   "--prefix-caching-hash-algo", "xxhash", "--disable-hybrid-kv-cache-manager"], [
        "--runner pooling has no effect: every model serves generation (chat, completions) and pooling",
        "--convert embed has no effect: /v1/embeddings pools any model's final hidden states",
        "--task generate has no effect: ",
        "--skip-mm-profiling has no effect: llmserve serves text models",
        "--prefix-caching-hash-algo has no effect: a cached block is reused only when its tokens",
        "--disable-hybrid-kv-cache-manager has no effect: ",
    ])
    # vLLM's --kv-cache-memory-bytes is --kv-cache-memory, with vLLM's suffixes (G 2^30, g 10^9);
    # unset, the device sizes the cache (2GiB on CPU, --gpu-memory-utilization on CUDA)
    assert _config([]).cache.kv_cache_memory is None
    for text, size in (("4G", 4 << 30), ("4g", 4 * 10**9), ("512M", 512 << 20), ("1.5g", 1_500_000_000),
                       ("4GiB", 4 << 30), ("1000", 1000), ("1TiB", 1 << 40)):
        assert parse_bytes(_config(["--kv-cache-memory-bytes", text]).cache.kv_cache_memory) == size, text
    assert _config(["--kv-cache-memory", "1G"]).cache.kv_cache_memory == "1G"
    # CUDA graphs: the sizes captured, as vLLM's flags name them (those above --max-num-seqs never run)
    device = _config(["--cudagraph-capture-sizes", "1", "2", "4", "--cudagraph-capture-sizes", "512"]).device
    assert (device.cudagraph_capture_sizes, device.capture_sizes(256)) == ((1, 2, 4, 512), [1, 2, 4])
    assert _config(["--max-cudagraph-capture-size", "40"]).device.capture_sizes(256) == [1, 2, 4, 8, 16, 32, 40]
    assert _config(["--max-cudagraph-capture-size", "512"]).device.capture_sizes(64)[-1] == 64
    assert _config([]).device.capture_sizes(64) is None
    with pytest.raises(ValueError, match="--cudagraph-capture-sizes must be whole numbers of at least 1"):
        _config(["--cudagraph-capture-sizes", "0"])
    # the access log leaves out a load balancer's probes
    quiet = _config(["--disable-access-log-for-endpoints", "/health, /metrics"]).server.quiet_paths()
    assert quiet == frozenset({"/health", "/metrics"})
    assert _config([]).server.quiet_paths() == frozenset()
    with pytest.raises(ValueError, match="'health' is not a path"):
        _config(["--disable-access-log-for-endpoints", "health"])
    # (the access log matches them as the routes name them: under --root-path too)
    from llmserve.server.middleware import route_path
    assert route_path({"path": "/p/health", "root_path": "/p"}) == "/health"
    assert (route_path({"path": "/p", "root_path": "/p"}), route_path({"path": "/health"})) == ("/", "/health")
    # served: a Unix socket, and request ids on every response
    assert (_config([]).server.uds, _config(["--uds", "/tmp/s.sock"]).server.uds) == (None, "/tmp/s.sock")
    assert _config(["--enable-request-id-headers"]).server.enable_request_id_headers is True
    # vLLM's request logging: off by default, --disable-log-requests its older "off"
    assert (_config([]).server.enable_log_requests, _config([]).server.max_log_len) == (False, None)
    logged = _config(["--enable-log-requests", "--max-log-len", "100"]).server
    assert (logged.enable_log_requests, logged.max_log_len) == (True, 100)
    assert _config(["--enable-log-requests", "--disable-log-requests"]).server.enable_log_requests is False
    assert _config(["--uvicorn-log-level", "info"]).server.uvicorn_log_level == "info"
    # given at warning or above it quiets the access lines too, as vLLM's (uvicorn's, at info)
    assert [_config(args).server.logs_access() for args in (
        [], ["--uvicorn-log-level", "info"], ["--uvicorn-log-level", "warning"], ["--uvicorn-log-level", "error"],
        ["--disable-uvicorn-access-log"])] == [True, True, False, False, False]
    with pytest.raises((ValueError, SystemExit)):
        _config(["--uvicorn-log-level", "loud"])
    # --max-logprobs is served (vLLM's: -1 is the vocabulary)
    assert (_config([]).model.max_logprobs, _config(["--max-logprobs", "-1"]).model.max_logprobs) == (20, -1)
    with pytest.raises((ValueError, SystemExit)):
        _config(["--max-logprobs", "-2"])


@pytest.mark.parametrize("args, says", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size is vLLM's: llmserve runs a model on one device"),
    (["--lora-dtype", "bfloat16"], "--lora-dtype is vLLM's: LoRA adapters compute in the model's dtype"),
    (["-tp", "2"], "-tp is vLLM's: llmserve runs a model on one device (only 1 is taken)"),
    (["--kv-cache-dtype", "fp8_inc"], "--kv-cache-dtype must be one of auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2"),
    (["--reasoning-parser", "deepseek"], "--reasoning-parser must be one of"),
    (["m", "--model", "n"], "two models given: m (MODEL) and n (--model); give one"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--load-format", "safetensors"], "--load-format is vLLM's: the weights are read in the format of the model's"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is vLLM's: prompts longer than"),
    (["--tokenizer-mode", "slow"], "--tokenizer-mode is vLLM's: the model's own tokenizer.json"),
    (["--response-role", "user"], "--response-role is vLLM's: an answer's role is always OpenAI's `assistant`"),
    (["--tool-parser-plugin", "p.py"], "--tool-parser-plugin is vLLM's: the tool-call parsers are built in"),
    (["--disable-sliding-window"], "--disable-sliding-window is vLLM's: sliding-window layers attend over"),
    (["--enable-sleep-mode"], "--enable-sleep-mode is vLLM's: there is no sleep mode"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
     "--speculative-config: `method` 'eagle': only \"ngram\" (prompt lookup) is served"),
    (["--preemption-mode", "swap"], "--preemption-mode is vLLM's: a sequence preempted when the KV cache runs out"),
    (["-O3"], "-O is vLLM's: nothing is compiled with torch.compile"),
    (["--limit-mm-per-prompt", "{}"], "--limit-mm-per-prompt is vLLM's: llmserve serves text models"),
    (["--reasoning-config", "{}"], "--reasoning-config is vLLM's: the thinking is read between <think> and"),
    (["--enable-log-outputs"], "--enable-log-outputs needs --enable-log-requests (as vLLM's does)"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"),
    (["--ssl-certfile", "missing.pem"], "--ssl-certfile 'missing.pem' is not a file"),
    (["--ssl-certfile", "/dev", "--ssl-cert-reqs", "3"], "--ssl-cert-reqs must be one of 0, 1, 2; got 3"),
    (["--api-key", "k", "--tensor-parallel-size", "2"], "--tensor-parallel-size is vLLM's: llmserve runs a model"),
    (["--async-scheduling", "org/model"], "got 'org/model' (--async-scheduling alone is on: give the model before it)"),
    (["--max-model-len", "1.5k5"], "'1.5k5' is not a whole number (such as 4096, 32k or 32K)"),
    (["--max-model-len", "1e3k"], "'1e3k' is not a whole number"),
    (["--max-model-len", "0.3K"], "'0.3K' is not a whole number"),
    (["--runner", "draft"], "--runner is vLLM's: every model serves generation (chat, completions) and pooling"),
    (["--task", "classify"], "there are no classification, reward or transcription heads (only auto, generate, "
                             "embed, embedding are taken)"),
    (["--convert", "reward"], "--convert is vLLM's: /v1/embeddings pools any model's final hidden states"),
    (["--headless"], "--headless is vLLM's: the engine and the HTTP server run in one process"),
    (["--logits-processors", "m.P"], "--logits-processors is vLLM's: there are no logits-processor plugins"),
    (["--kv-cache-memory-bytes", "4X"], "not a memory size: '4X'"),
])
def test_vllm_flags_llmserve_lacks_say_what_to_do(monkeypatch, capsys, args, says):
    monkeypatch.setattr("llmserve.server.app.serve", lambda cfg: pytest.fail("served"), raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", *args])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--api-key", "k1", "secret-two"], ["m", "--api-key", "k1", "secret-two"],
                                  ["--api-key=k1", "secret-two"], ["--api", "k1", "secret-two"],
                                  ["m", "--api-key=k1", "secret-two"]])
def test_vllms_several_keys_form_is_refused_without_echoing_a_key(monkeypatch, capsys, args):
    monkeypatch.setattr("llmserve.server.app.serve", lambda cfg: pytest.fail("served"), raising=False)
    with pytest.raises(SystemExit):
        cli.main(["run", *args])
    err = capsys.readouterr().err
    assert "--api-key takes one key: repeat the flag for each" in err and "secret-two" not in err


def test_sections_must_be_their_classes():
    from llmserve.config import DeviceConfig

    with pytest.raises(TypeError, match="Config.device must be a DeviceConfig"):
        Config(device={"threads": 2})
    with pytest.raises(TypeError, match="Config.model must be a ModelConfig .*got DeviceConfig"):
        Config(model=DeviceConfig(threads=2))


def test_good_values_and_templates_pass(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    ModelConfig(chat_template=str(template))
    ModelConfig(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    CacheConfig(gpu_memory_utilization=1.0, kv_cache_memory="512MiB")
    ServerConfig(port=0, sse_keep_alive=0.5, api_key=("k1", "k2"))
    ServerConfig(allowed_origins=("*", "null", "http://localhost:3000", "https://app.example",
                                  "http://[::1]:8080", "chrome-extension://abcdef"))
    Config()


def test_a_template_file_that_is_not_utf8_is_named_before_the_model_loads(monkeypatch, capsys, tmp_path):
    template = tmp_path / "latin1.jinja"
    template.write_bytes("{{ messages[0].content }} caf\xe9".encode("latin-1"))
    monkeypatch.setattr("llmserve.server.app.serve", lambda cfg: pytest.fail("served"), raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--chat-template", str(template)])
    assert exit_.value.code == 2
    assert f"--chat-template {str(template)!r} cannot be read as UTF-8 text" in capsys.readouterr().err


def test_config_values_of_the_wrong_type_or_range_are_refused_when_built():
    """An embedding application builds sections from Python values: a wrong type is a
    TypeError naming the flag and the keyword, before anything loads."""
    import dataclasses

    import pytest

    from llmserve.config import CacheConfig, Config, DeviceConfig, ModelConfig, parse_bytes

    with pytest.raises(TypeError, match=r"--max-model-len \(max_model_len\) must be an integer"):
        ModelConfig(max_model_len=512.5)
    with pytest.raises(TypeError, match="items are each a string"):
        ModelConfig(served_model_name=("a", 1))
    with pytest.raises(TypeError, match="a size such as"):
        CacheConfig(kv_cache_memory=[1])
    assert parse_bytes(CacheConfig(kv_cache_memory=1 << 30).kv_cache_memory) == 1 << 30
    with pytest.raises(ValueError, match="--seed must be at least 0 and at most"):
        DeviceConfig(seed=2 ** 70)
    assert dataclasses.replace(Config().device, threads=2).threads == 2


def test_the_step_token_budget_defaults_by_device():
    """--max-num-batched-tokens unset: 2048 on CPU, 8192 on CUDA (vLLM's for an API server on
    H100-class GPUs); a value given is kept on either."""
    import torch

    from llmserve.config import SchedulerConfig
    from llmserve.engine.build import batched_tokens

    unset, given = Config(), Config(scheduler=SchedulerConfig(max_num_batched_tokens=512))
    assert batched_tokens(unset, torch.device("cpu")) == 2048
    assert batched_tokens(unset, torch.device("cuda")) == 8192
    assert batched_tokens(given, torch.device("cuda")) == batched_tokens(given, torch.device("cpu")) == 512
    with pytest.raises(ValueError, match="--max-num-batched-tokens must be at least 1"):
        SchedulerConfig(max_num_batched_tokens=0)


def test_a_config_file_gives_flags_the_command_line_overrides(tmp_path, monkeypatch, capsys):
    """vLLM's `--config FILE`: the YAML's keys are flag names (`_` for `-` too, `model` is MODEL),
    lists repeat the flag, mappings are JSON, booleans the bare or `--no-` flag; the command
    line's own flags win."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {model}\nport: 8123\nhost: 127.0.0.1\nserved_model_name: [a, b]\n"
                      "async-scheduling: false\noverride-generation-config: {temperature: 0.4}\n"
                      "trust-remote-code: true\nmax-num-seqs: 7\n")
    served = []
    monkeypatch.setattr("llmserve.server.app.serve", lambda cfg: served.append(cfg) or 0, raising=False)
    assert cli.main(["run", "--config", str(config), "--port", "9000"]) == 0
    cfg = served[0]
    assert (cfg.model.model, cfg.server.port, cfg.server.host) == (str(model), 9000, "127.0.0.1")
    assert cfg.model.served_model_name == ("a", "b") and cfg.scheduler.max_num_seqs == 7
    assert cfg.scheduler.async_scheduling == "off"
    assert cfg.model.generation_overrides() == {"temperature": 0.4}
    for bad, says in ((tmp_path / "none.yaml", "No such file"), (tmp_path / "list.yaml", "a mapping")):
        if bad.name == "list.yaml":
            bad.write_text("- port\n")
        with pytest.raises(SystemExit) as exit_:
            cli.main(["run", f"--config={bad}"])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    # the command line's model wins over the file's too
    other = tmp_path / "other.gguf"
    other.write_bytes(b"")
    assert cli.main(["run", str(other), "--config", str(config)]) == 0
    assert served[-1].model.model == str(other)


@pytest.mark.parametrize("text, says", [
    ("api-key:\n", "`api-key` holds no value"),        # (would serve with no key at all)
    ("api-key: []\n", "`api-key` holds no value"),
    ("config: other.yaml\n", "`config`: a file cannot name another"),
])
def test_a_config_file_that_names_nothing_is_refused(tmp_path, capsys, text, says):
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--config", str(config)])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["run", "--config", str(config), "--config", str(config)])
    assert "--config is given more than once" in capsys.readouterr().err


def test_vllm_command_lines_start_as_written(monkeypatch, caplog):
    """What vLLM's own parser takes: `--model X` (its Docker image's form) for MODEL, flag names
    with underscores, its reasoning parsers' names (served by `think`, and said so)."""
    served = []
    monkeypatch.setattr("llmserve.server.app.serve", lambda cfg: served.append(cfg) or 0, raising=False)
    assert cli.main(["serve", "--model", "some/model", "--max_model_len=1024", "--max_num_seqs", "8"]) == 0
    cfg = served.pop()
    assert (cfg.model.model, cfg.model.max_model_len, cfg.scheduler.max_num_seqs) == ("some/model", 1024, 8)
    assert cli.main(["run", "m", "--model", "m"]) == 0 and served.pop().model.model == "m"
    # (only flag names change: a value with underscores, or words after `--`, stay as given)
    assert cli.main(["run", "m", "--served-model-name", "a_b", "--api_key=k_1"]) == 0
    cfg = served.pop()
    assert (cfg.model.served_model_name, cfg.server.api_key) == (("a_b",), ("k_1",))
    caplog.clear()
    with caplog.at_level("INFO", logger="llmserve"):
        for name in ("qwen3", "deepseek_r1"):
            assert cli.main(["run", "m", "--reasoning-parser", name]) == 0
            assert served.pop().model.reasoning_parser == "think"
    assert "--reasoning-parser qwen3: vLLM's name; served as think here" in caplog.text


def test_serve_is_run_and_flags_that_do_nothing_here_are_named(monkeypatch, caplog):
    """`llmserve serve` (vLLM's verb) is `run`; run-batch names the HTTP flags it has no use
    for, and a CPU engine the CUDA-only ones set away from their defaults."""
    from llmserve.engine.build import cuda_only_flags_given

    served = []
    monkeypatch.setattr("llmserve.server.app.serve", lambda cfg: served.append(cfg) or 0, raising=False)
    assert cli.main(["serve", "some/model", "--port", "8123"]) == 0
    assert (served[0].model.model, served[0].server.port) == ("some/model", 8123)
    monkeypatch.setattr(cli, "_run_batch", lambda cfg, i, o: 0)
    caplog.clear()
    with caplog.at_level("INFO", logger="llmserve"):
        assert cli.main(["run-batch", "m", "-i", "in", "-o", "out", "--port", "9", "--no-access-log",
                         "--strict-fields"]) == 0
    assert "--port has no effect: run-batch serves no HTTP" in caplog.text
    assert "--no-access-log has no effect: run-batch serves no HTTP" in caplog.text
    assert "--strict-fields has no effect" not in caplog.text     # (it shapes the answers)
    cfg = _config(["--enforce-eager", "--gpu-memory-utilization", "0.5", "--cudagraph-capture-sizes", "1", "2"])
    assert cuda_only_flags_given(cfg) == ["--gpu-memory-utilization", "--enforce-eager", "--cudagraph-capture-sizes"]
    assert cuda_only_flags_given(_config(["--gpu-memory-utilization", "0.9"])) == []   # (the default)
