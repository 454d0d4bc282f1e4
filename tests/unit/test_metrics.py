"""The engine's Prometheus metrics, fed directly (no engine runs)."""

import pytest

from llmserve.engine.metrics import Metrics


def _value(m: Metrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_a_request_its_client_left_is_no_success():
    """A request its client left is no success (vLLM's request_success never counts one): it
    counts in request_aborted, a sequence per choice. Each finish reason has its series from
    the start, at 0, as vLLM's."""
    m = Metrics()
    m.bind("m")
    assert m.registry.get_sample_value("llmserve:request_success_total",
                                       {"model_name": "m", "finished_reason": "error"}) == 0
    m.on_finish(reason="abort", prompt_lens=[36], submitted=0.0, scheduled=None,
                first_token=None, finished=1.0, n=2)
    assert _value(m, "llmserve:request_success_total", finished_reason="abort") == 0
    assert _value(m, "llmserve:request_aborted_total") == 2
    assert _value(m, "llmserve:e2e_request_latency_seconds_count") == 0
    m.on_finish(reason="length", prompt_lens=[12], submitted=0.0, scheduled=0.1,
                first_token=0.2, finished=0.5, ends=[("length", 3)])
    assert _value(m, "llmserve:request_success_total", finished_reason="length") == 1


def test_each_draft_position_has_its_series_from_the_start():
    """--speculative-config: the per-position accepted-drafts counter has a series for each of
    the step's draft places from the start, at 0, as vLLM's (audit D: none until the first
    draft step); without speculation, none."""
    m = Metrics()
    m.bind("m", draft_positions=3)
    name = "llmserve:spec_decode_num_accepted_tokens_per_pos_total"
    assert [m.registry.get_sample_value(name, {"model_name": "m", "position": str(p)}) for p in range(4)] == \
        [0.0, 0.0, 0.0, None]
    plain = Metrics()
    plain.bind("m")
    assert plain.registry.get_sample_value(name, {"model_name": "m", "position": "0"}) is None


def test_tokens_and_first_token_times_count_as_they_come():
    """vLLM's engine counts the prompt and generated tokens, and the time to first token,
    each step: a long generation moves them while it runs, not at its end."""
    m = Metrics()
    m.bind("m", max_model_len=4096)
    m.on_iteration(prompt_tokens=24, generated=3, first_token_waits=[0.2, 0.3])
    m.on_iteration(prompt_tokens=0, generated=2, first_token_waits=[])
    assert _value(m, "llmserve:prompt_tokens_total") == 24
    assert _value(m, "llmserve:generation_tokens_total") == 5
    assert _value(m, "llmserve:time_to_first_token_seconds_count") == 2
    assert _value(m, "llmserve:iteration_tokens_total_sum") == 29
    # vLLM's bounds: token counts 1, 2, 5, ... up to the context; latencies up to 7680 s
    assert _value(m, "llmserve:request_prompt_tokens_bucket", le="2000.0") == 0
    assert m.registry.get_sample_value("llmserve:request_prompt_tokens_bucket",
                                       {"model_name": "m", "le": "5000.0"}) is None
    assert m.registry.get_sample_value("llmserve:e2e_request_latency_seconds_bucket",
                                       {"model_name": "m", "le": "7680.0"}) == 0


def test_each_choice_of_each_prompt_counts_as_vllm_counts_a_sequence():
    """Two prompts, n=2: four sequences, each counted by its own finish reason with its own
    prompt's tokens and max_tokens; n and the longest choice once per prompt; the latencies,
    which the choices share, once."""
    m = Metrics()
    m.bind("m")
    m.on_finish(reason="stop", prompt_lens=[5, 9], submitted=0.0, scheduled=0.1,
                first_token=0.2, finished=1.2, n=2, max_tokens=4,
                ends=[("stop", 1), ("length", 4), ("length", 4), ("tool_calls", 2)])
    # (a tool call is a stop to vLLM's engine, whose label values dashboards know)
    assert _value(m, "llmserve:request_success_total", finished_reason="stop") == 2
    assert _value(m, "llmserve:request_success_total", finished_reason="length") == 2
    assert _value(m, "llmserve:request_success_total", finished_reason="tool_calls") == 0
    assert _value(m, "llmserve:request_prompt_tokens_sum") == 5 + 5 + 9 + 9
    assert _value(m, "llmserve:request_generation_tokens_count") == 4
    assert _value(m, "llmserve:request_generation_tokens_sum") == 11
    assert _value(m, "llmserve:request_params_n_count") == 2
    assert _value(m, "llmserve:request_params_max_tokens_sum") == 4 * 4
    assert _value(m, "llmserve:request_max_num_generation_tokens_sum") == 4 + 4
    assert _value(m, "llmserve:e2e_request_latency_seconds_count") == 1
    # a failure leaves the choices' ends unknown: every sequence counts as "error"
    m.on_finish(reason="error", prompt_lens=[5, 9], submitted=0.0, scheduled=0.1,
                first_token=0.2, finished=0.4, n=2)
    assert _value(m, "llmserve:request_success_total", finished_reason="error") == 4


def test_request_params_are_observed_as_vllm_names_them():
    m = Metrics()
    m.bind("m")
    m.on_finish(reason="stop", prompt_lens=[5], submitted=0.0, scheduled=0.1,
                first_token=0.2, finished=0.5, n=3, max_tokens=100, ends=[("stop", 2), ("stop", 1), ("stop", 1)])
    assert _value(m, "llmserve:request_params_n_count") == 1
    assert _value(m, "llmserve:request_params_n_sum") == 3
    assert _value(m, "llmserve:request_params_max_tokens_count") == 3
    # completions' best_of 4 for n 1: four candidates ran (and count), n is what was asked
    m.on_finish(reason="stop", prompt_lens=[5], submitted=0.0, scheduled=0.1, first_token=0.2, finished=0.5,
                n=4, returned_n=1, ends=[("stop", 1)] * 4)
    assert _value(m, "llmserve:request_params_n_sum") == 4
    assert _value(m, "llmserve:request_success_total", finished_reason="stop") == 7


def test_time_per_output_token_is_per_choice():
    """n choices decode side by side: TPOT is the decode time over the longest choice's
    tokens after its first (vLLM times each choice), not over all choices' tokens."""
    m = Metrics()
    m.bind("m")
    m.on_finish(reason="length", prompt_lens=[5], submitted=0.0, scheduled=0.1,
                first_token=0.2, finished=3.1, n=3, max_tokens=30, ends=[("length", 30)] * 3)
    assert _value(m, "llmserve:request_time_per_output_token_seconds_sum") == pytest.approx(2.9 / 29)
    assert _value(m, "llmserve:request_max_num_generation_tokens_sum") == 30
    # an aborted request: no finished-request figures at all, as in vLLM
    m.on_finish(reason="abort", prompt_lens=[5], submitted=0.0, scheduled=0.1,
                first_token=0.2, finished=1.0, n=3, max_tokens=30)
    assert _value(m, "llmserve:request_time_per_output_token_seconds_count") == 1
    assert _value(m, "llmserve:request_max_num_generation_tokens_count") == 1


def test_lora_requests_info_names_the_adapters_running_and_waiting():
    """vLLM's lora_requests_info: one series whose labels list the adapters of the running and
    the waiting requests now, its value when they were published; none without adapters."""
    stats = {"running": 2, "waiting": 1, "kv_cache_usage": 0.1, "preemptions": 0, "prefix_hit_tokens": 0,
             "prefix_query_tokens": 0}
    plain = Metrics()
    plain.bind("m")
    plain.on_step(stats, 0.01)
    assert b"lora_requests_info{" not in plain.render()
    m = Metrics()
    m.bind("m", max_lora=3)
    m.on_step({**stats, "running_loras": ["sql", "chat"], "waiting_loras": ["sql"]}, 0.01)
    labels = {"max_lora": "3", "running_lora_adapters": "sql,chat", "waiting_lora_adapters": "sql"}
    assert m.registry.get_sample_value("llmserve:lora_requests_info", labels) > 1.7e9
    m.on_step({**stats, "running_loras": [], "waiting_loras": []}, 0.01)
    assert m.registry.get_sample_value("llmserve:lora_requests_info", labels) is None
    empty = {"max_lora": "3", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert m.registry.get_sample_value("llmserve:lora_requests_info", empty) > 1.7e9
    # (adapters loaded or unloaded while serving: the count published with the stats)
    m.on_step({**stats, "loras_served": 5}, 0.01)
    assert m.registry.get_sample_value("llmserve:lora_requests_info", {**empty, "max_lora": "5"}) > 1.7e9
    assert m.registry.get_sample_value("llmserve:lora_requests_info", empty) is None


def test_a_steps_gaps_observed_in_bulk_read_as_observed_one_by_one():
    """on_token_gaps (one increment per bucket) against on_tokens per gap: the same
    exposition, with gaps below the first bound, on bounds, between, and past the last."""
    from prometheus_client import generate_latest

    gaps = [0.0001, 0.01, 0.01, 0.0175, 0.025, 0.3, 0.31, 4.0, 5.0, 80.0, 1e6]
    bulk, single = Metrics(), Metrics()
    bulk.bind("m")
    single.bind("m")
    bulk.on_token_gaps(gaps)
    bulk.on_token_gaps([])
    for gap in gaps:
        single.on_tokens(gap)

    def samples(m: Metrics) -> list[str]:      # (a series' _created time differs between the two)
        return [line for line in generate_latest(m.registry).decode().splitlines() if "_created" not in line]

    assert samples(bulk) == samples(single)
    assert _value(bulk, "llmserve:inter_token_latency_seconds_bucket", le="0.01") == 3
    assert _value(bulk, "llmserve:time_per_output_token_seconds_count") == len(gaps)
