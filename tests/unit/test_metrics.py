"""The engine's Prometheus metrics, fed directly (no engine runs)."""

import pytest

from llmserve.engine.metrics import Metrics


def _value(m: Metrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_prompt_tokens_count_only_prompts_that_were_processed():
    """vLLM's prompt_tokens counts prefilled tokens: a request aborted while it waited adds
    none, though it still counts as an aborted request."""
    m = Metrics()
    m.bind("m")
    m.on_finish(reason="abort", prompt_tokens=36, generated=0, submitted=0.0, scheduled=None,
                first_token=None, finished=1.0)
    assert _value(m, "llmserve:prompt_tokens_total") == 0
    assert _value(m, "llmserve:request_success_total", finished_reason="abort") == 1
    m.on_finish(reason="length", prompt_tokens=12, generated=3, submitted=0.0, scheduled=0.1,
                first_token=0.2, finished=0.5)
    assert _value(m, "llmserve:prompt_tokens_total") == 12
    assert _value(m, "llmserve:generation_tokens_total") == 3


def test_request_params_are_observed_as_vllm_names_them():
    m = Metrics()
    m.bind("m")
    m.on_finish(reason="stop", prompt_tokens=5, generated=4, submitted=0.0, scheduled=0.1,
                first_token=0.2, finished=0.5, n=3, max_tokens=100)
    assert _value(m, "llmserve:request_params_n_count") == 1
    assert _value(m, "llmserve:request_params_n_sum") == 3
    assert _value(m, "llmserve:request_params_max_tokens_sum") == 100


def test_time_per_output_token_is_per_choice():
    """n choices decode side by side: TPOT is the decode time over the longest choice's
    tokens after its first (vLLM times each choice), not over all choices' tokens."""
    m = Metrics()
    m.bind("m")
    m.on_finish(reason="length", prompt_tokens=5, generated=90, submitted=0.0, scheduled=0.1,
                first_token=0.2, finished=3.1, n=3, max_tokens=30, longest=30)
    assert _value(m, "llmserve:time_per_output_token_seconds_sum") == pytest.approx(2.9 / 29)
    assert _value(m, "llmserve:request_time_per_output_token_seconds_sum") == pytest.approx(2.9 / 29)
    assert _value(m, "llmserve:request_max_num_generation_tokens_sum") == 30
    # an aborted n > 1 request: the longest choice is unknown, so neither is observed
    m.on_finish(reason="abort", prompt_tokens=5, generated=7, submitted=0.0, scheduled=0.1,
                first_token=0.2, finished=1.0, n=3, max_tokens=30, longest=None)
    assert _value(m, "llmserve:time_per_output_token_seconds_count") == 1
    assert _value(m, "llmserve:request_max_num_generation_tokens_count") == 1
