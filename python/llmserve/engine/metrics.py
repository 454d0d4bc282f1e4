"""Prometheus metrics, named after vLLM's under the `llmserve:` prefix so dashboards map over.

Every series carries a `model_name` label (the first served name), as vLLM's do: dashboards
select on it. Each engine has its own registry (several apps can live in one process, as in
tests).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's bucket bounds, so a dashboard's or an alert's `le` matches a series: time to first
# token; the gap between a request's outputs (and per output token); a request's latencies
# (end to end, queue, prefill, decode, inference); tokens per step.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
         20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
         40.0, 80.0)
_LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
            240.0, 480.0, 960.0, 1920.0, 7680.0)
_STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# (an engine step takes a token's time: the inter-token bounds)
_STEP_SECONDS = _TPOT
# The finish reasons request_success has a series for from the start (at 0), as vLLM's: a
# rate over the first one of each then counts it.
_REASONS = ("stop", "length", "error")


def buckets_1_2_5(most: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `most` (vLLM's bounds of its token-count histograms,
    `most` the context length)."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > most:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


# The token-count histograms (key: name, help), whose bounds run 1, 2, 5, ... up to the
# context length, as vLLM's; these bounds until the model (and its context length) is known.
_TOKEN_COUNTS = {
    "request_prompt": ("llmserve:request_prompt_tokens", "Prompt tokens per request."),
    "request_generation": ("llmserve:request_generation_tokens", "Generated tokens per request."),
    "request_max_generation": ("llmserve:request_max_num_generation_tokens",
                               "Generated tokens of a request's longest choice."),
    "params_max_tokens": ("llmserve:request_params_max_tokens",
                          "The max_tokens of each request, as resolved (the rest of the context when not sent)."),
}
_TOKENS = buckets_1_2_5(32768)


# vLLM's `cache_config_info` label names (of its CacheConfig) that mean something here.
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching",
                       "gpu_memory_utilization")


# The API's finish reasons that vLLM's metrics label by the engine's: a tool call is a stop.
_ENGINE_REASONS = {"tool_calls": "stop"}


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self._families = {
            "running": gauge("llmserve:num_requests_running", "Sequences in the running batch."),
            "waiting": gauge("llmserve:num_requests_waiting", "Sequences waiting to start."),
            "kv_usage": gauge("llmserve:kv_cache_usage_perc",
                              "KV-cache blocks in use, as a fraction (1 = full)."),
            "preemptions": counter("llmserve:num_preemptions", "Sequences preempted."),
            "prefix_hits": counter("llmserve:prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache."),
            "prefix_queries": counter("llmserve:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache (the hit "
                                      "rate is hits / queries)."),
            "prompt_tokens": counter("llmserve:prompt_tokens",
                                     "Prompt tokens processed (each choice's, as its first token comes)."),
            "generation_tokens": counter("llmserve:generation_tokens", "Tokens generated (as they come)."),
            "ttft": histogram("llmserve:time_to_first_token_seconds", "Time to first token.", _TTFT),
            # vLLM's older name for inter_token_latency_seconds: observed at the same times
            # (each gap between a request's outputs), not once a request as request_tpot is
            "tpot": histogram("llmserve:time_per_output_token_seconds",
                              "Time between a request's successive outputs of new tokens "
                              "(inter_token_latency_seconds' older name).", _TPOT),
            "request_tpot": histogram("llmserve:request_time_per_output_token_seconds",
                                      "Mean time per output token after the first, per request.",
                                      _TPOT),
            "itl": histogram("llmserve:inter_token_latency_seconds",
                             "Time between a request's successive outputs of new tokens.", _TPOT),
            "e2e": histogram("llmserve:e2e_request_latency_seconds", "End-to-end latency.",
                             _LATENCY),
            "queue": histogram("llmserve:request_queue_time_seconds",
                               "Time from arrival to the first step that holds the request.",
                               _LATENCY),
            "prefill": histogram("llmserve:request_prefill_time_seconds",
                                 "Time from the first step that holds the request to its first "
                                 "token.", _LATENCY),
            "decode": histogram("llmserve:request_decode_time_seconds",
                                "Time from the first token to the last.", _LATENCY),
            "inference": histogram("llmserve:request_inference_time_seconds",
                                   "Time from the first step that holds the request to its end.",
                                   _LATENCY),
            "step_time": histogram("llmserve:engine_step_seconds", "One engine step.", _STEP_SECONDS),
            "iteration_tokens": histogram("llmserve:iteration_tokens_total",
                                          "Tokens per engine step: those generated, and the prompts of "
                                          "the requests whose first token came (as vLLM counts them).",
                                          _STEP_TOKENS),
            "params_n": histogram("llmserve:request_params_n", "The n (choices per prompt) of each request.",
                                  (1, 2, 5, 10, 20)),
        }
        for key in _TOKEN_COUNTS:
            self._count_tokens(key, _TOKENS)
        # NOTE: labelled as vLLM labels it, by the engine's finish reason ("stop", "length",
        # "error": a choice that ended in a tool call stopped, as vLLM's engine sees it), counting
        # each choice of each prompt as vLLM counts each sequence; a request whose client left
        # is not a success there either: it counts in request_aborted.
        self._requests = Counter("llmserve:request_success",
                                 "Sequences finished (each choice of each prompt), by finish reason.",
                                 ["model_name", "finished_reason"], registry=r)
        self._families["aborted"] = counter(
            "llmserve:request_aborted",
            "Sequences (each choice of each prompt) whose client left before they finished.")
        # Speculation (--speculative-config): vLLM's spec_decode counters, each step's drafts as the
        # engine checked them; the per-position one labelled by the draft's place (0 = first).
        self._families["spec_drafts"] = counter(
            "llmserve:spec_decode_num_drafts", "Sequence steps that checked drafts (speculative decoding).")
        self._families["spec_draft_tokens"] = counter(
            "llmserve:spec_decode_num_draft_tokens", "Draft tokens checked.")
        self._families["spec_accepted_tokens"] = counter(
            "llmserve:spec_decode_num_accepted_tokens",
            "Draft tokens the model's samples confirmed (the acceptance rate is these / draft tokens).")
        self._spec_per_pos = Counter("llmserve:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens confirmed, by their place among a step's drafts.",
                                     ["model_name", "position"], registry=r)
        self._last_spec: dict[str, int] = {}
        self._last_spec_pos: list[int] = []
        self._cache_config = Gauge("llmserve:cache_config_info",
                                   "The KV cache's configuration (as labels; the value is 1).",
                                   ["model_name", *CACHE_CONFIG_LABELS], registry=r)
        # NOTE: vLLM's, which routers that keep an adapter's requests together read (Kubernetes'
        # Gateway API Inference Extension): one series, its labels the adapters (comma
        # separated) of running and waiting requests, its value when they were last published.
        self._lora_info = Gauge("llmserve:lora_requests_info",
                                "LoRA adapters of the running and the waiting requests (as labels; the "
                                "value is the time they were published, in seconds since the epoch).",
                                ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
        self._max_lora = 0
        self._lora_bound = 0
        self._lora_labels: tuple[str, str, str] | None = None
        self.model_name = ""
        self._last_preemptions = 0
        self._last_hits = 0
        self._last_queries = 0

    def _count_tokens(self, key: str, buckets: tuple) -> None:
        """(Re)make the token-count histogram `key` of _TOKEN_COUNTS with these bounds."""
        if key in self._families:
            self.registry.unregister(self._families[key])
        name, doc = _TOKEN_COUNTS[key]
        self._families[key] = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)

    def bind(self, model_name: str, cache_config: dict | None = None, max_lora: int = 0,
             lora_bound: int = 0, max_model_len: int | None = None, draft_positions: int = 0) -> None:
        """Once the model is loaded: every series gets its `model_name`, and
        `cache_config_info` the values of CACHE_CONFIG_LABELS in `cache_config`. Before,
        /metrics lists the metrics with no samples, and nothing calls on_step or on_finish (no
        engine runs). `max_lora`: the LoRA adapters served at start (0, without runtime loading:
        none, and no lora_requests_info); the published stats' `loras_served` then updates it.
        `lora_bound`: --max-loras, which the `max_lora` label then says (as vLLM's does).
        `max_model_len`: the context length, up to which the token-count histograms' bounds
        run (1, 2, 5, 10, ...). `draft_positions`: the drafts a speculative step checks at most,
        whose per-position counter gets a series for each from the start (as vLLM's), at 0."""
        self.model_name = model_name
        if max_model_len is not None:
            for key in _TOKEN_COUNTS:
                self._count_tokens(key, buckets_1_2_5(max_model_len))
        self._max_lora = max_lora
        self._lora_bound = lora_bound
        for attr, family in self._families.items():
            setattr(self, attr, family.labels(model_name))
        for reason in _REASONS:
            self._requests.labels(model_name, reason)
        for pos in range(draft_positions):
            self._spec_per_pos.labels(model_name, str(pos))
        if cache_config is not None:
            self._cache_config.labels(model_name, *(str(cache_config[k]) for k in CACHE_CONFIG_LABELS)).set(1)

    def on_step(self, stats: dict, seconds: float) -> None:
        """Engine thread: each time it publishes its counts (every plan made, every step, and
        after aborts that emptied it); `seconds` is the step's time, 0 where none ran."""
        self.running.set(stats["running"])
        self.kv_usage.set(stats["kv_cache_usage"])
        self.preemptions.inc(max(0, stats["preemptions"] - self._last_preemptions))
        self._last_preemptions = stats["preemptions"]
        self.prefix_hits.inc(max(0, stats["prefix_hit_tokens"] - self._last_hits))
        self._last_hits = stats["prefix_hit_tokens"]
        self.prefix_queries.inc(max(0, stats["prefix_query_tokens"] - self._last_queries))
        self._last_queries = stats["prefix_query_tokens"]
        for key in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens"):
            value = stats.get(key, 0)
            if value != self._last_spec.get(key, 0):
                getattr(self, key).inc(max(0, value - self._last_spec.get(key, 0)))
                self._last_spec[key] = value
        per_pos = stats.get("spec_accepted_per_pos", ())
        for pos, value in enumerate(per_pos):
            last = self._last_spec_pos[pos] if pos < len(self._last_spec_pos) else 0
            if value != last or pos >= len(self._last_spec_pos):
                self._spec_per_pos.labels(self.model_name, str(pos)).inc(max(0, value - last))
        self._last_spec_pos = list(per_pos)
        if seconds > 0:
            self.step_time.observe(seconds)
        if self._max_lora:
            # (the adapters served now: runtime loads and unloads change it)
            labels = (str(self._lora_bound or stats.get("loras_served", self._max_lora)), ",".join(stats.get("running_loras", ())),
                      ",".join(stats.get("waiting_loras", ())))
            if labels != self._lora_labels:   # (one series: the adapters of now)
                self._lora_info.clear()
                self._lora_labels = labels
            self._lora_info.labels(*labels).set_to_current_time()

    def on_iteration(self, prompt_tokens: int, generated: int, first_token_waits: list[float]) -> None:
        """Event loop: a step's outputs came: `generated` new tokens, and the first tokens of
        requests that waited `first_token_waits` seconds for them (since they arrived), whose
        prompts were `prompt_tokens` tokens, each choice's counted (as vLLM counts a sequence's).
        Counted as they come, as vLLM's engine counts them each step: a long generation moves
        the counters while it runs."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        for wait in first_token_waits:
            self.ttft.observe(wait)
        if prompt_tokens + generated:
            self.iteration_tokens.observe(prompt_tokens + generated)

    def on_tokens(self, since_last: float) -> None:
        """Event loop: a request got new tokens, `since_last` seconds after its previous ones."""
        self.itl.observe(since_last)
        self.tpot.observe(since_last)

    def on_token_gaps(self, gaps: list[float]) -> None:
        """Event loop: `on_tokens` for each gap of one step's requests, in bulk.

        NOTE: observing one at a time took about a tenth of the event loop's time when serving
        concurrency 256 as fast as the engine steps (benches/serving_overhead.py): each
        observation takes two locks. Here each bucket and the sum take one per step."""
        if gaps:
            observe_many(self.itl, gaps)
            observe_many(self.tpot, gaps)

    def on_finish(self, *, reason: str, prompt_lens: list[int], submitted: float,
                  scheduled: float | None, first_token: float | None, finished: float,
                  n: int = 1, max_tokens: int | None = None,
                  ends: list[tuple[str, int]] | None = None, returned_n: int | None = None) -> None:
        """A request ended: `reason` is "abort" when its client left, "error" when it failed,
        else its first choice's finish reason. `prompt_lens` holds each prompt's tokens (a
        completions list has several, each answered by `n` choices); `ends` each choice's
        (finish reason, completion tokens) when it ended normally, in order (prompt-major),
        else None. `scheduled` is None when no step ever held it (aborted in the queue);
        `first_token` None when it produced none. (Its tokens and its time to first token
        were counted as they came: `on_iteration`.)

        vLLM runs each choice of each prompt as a request of its own, so the counts by
        request (request_success, the prompt and generation tokens per request, and
        max_tokens) count each choice (`n` per prompt: the sequences run, completions' `best_of`
        candidates too); n and the longest choice, which vLLM observes once per prompt, are
        observed per prompt (n as the request asked: `returned_n`, fewer than run under
        `best_of`). The latency histograms count the request once: its
        choices share one queue, one schedule and one end."""
        sequences = len(prompt_lens) * n
        if reason == "abort":
            self.aborted.inc(sequences)
            return
        if ends is None:
            self._requests.labels(self.model_name, _ENGINE_REASONS.get(reason, reason)).inc(sequences)
        else:
            for i, (choice_reason, tokens) in enumerate(ends):
                self._requests.labels(self.model_name, _ENGINE_REASONS.get(choice_reason, choice_reason)).inc()
                self.request_prompt.observe(prompt_lens[min(i // n, len(prompt_lens) - 1)])
                self.request_generation.observe(tokens)
        if max_tokens is not None:
            for _ in range(sequences):
                self.params_max_tokens.observe(max_tokens)
        for p in range(len(prompt_lens)):
            self.params_n.observe(n if returned_n is None else returned_n)
            if ends:
                self.request_max_generation.observe(max(t for _, t in ends[p * n:(p + 1) * n]))
        self.e2e.observe(finished - submitted)
        if scheduled is not None:
            self.queue.observe(scheduled - submitted)
            self.inference.observe(finished - scheduled)
        if first_token is not None:
            self.decode.observe(finished - first_token)
            if scheduled is not None:
                self.prefill.observe(first_token - scheduled)
            # per choice: the choices decode side by side, so the longest one's tokens set
            # the pace
            longest = max((t for _, t in ends), default=0) if ends else 0
            if longest > 1:
                self.request_tpot.observe((finished - first_token) / (longest - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def observe_many(histogram, values: list[float]) -> None:
    """`histogram.observe(v)` for each of `values`, with one increment per bucket touched.

    NOTE: reaches into prometheus_client's Histogram (non-cumulative `_buckets` over
    `_upper_bounds`, and `_sum`), whose version requirements.txt pins; a test checks the
    exposition equals observing one at a time."""
    bounds = histogram._upper_bounds
    for index, count in Tally(bisect_left(bounds, v) for v in values).items():
        histogram._buckets[index].inc(count)
    histogram._sum.inc(sum(values))
