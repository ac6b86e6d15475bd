"""The roofline latency model: its presets, and how step time responds to the batch."""

from __future__ import annotations

import pytest

from kvroute.simulator.engine import (
    PRESETS,
    Engine,
    EngineConfig,
    EngineRequest,
    LatencyModel,
    latency_preset,
)

H100_8B = latency_preset("llama-3.1-8b-h100")
H200_8B = latency_preset("llama-3.1-8b-h200")
H100_70B_TP4 = latency_preset("llama-3.1-70b-4xh100")
H100_70B_TP8 = latency_preset("llama-3.1-70b-8xh100")


def decode_step(model: LatencyModel, batch: int, context: int) -> float:
    """A step of ``batch`` decoding sequences, each with ``context`` tokens of KV."""
    return model.step_time(batch, batch * context, batch * context)


def prefill_step(model: LatencyModel, tokens: int, cached: int = 0) -> float:
    """A step that prefills ``tokens`` new tokens after ``cached`` prefix-hit tokens."""
    return model.step_time(tokens, tokens * cached + tokens * (tokens + 1) // 2, cached + tokens)


def test_reference_figures_are_in_the_presets() -> None:
    assert H100_8B.kv_bytes_per_token == 131_072
    assert H100_70B_TP4.kv_bytes_per_token == 327_680
    assert H100_8B.weight_bytes == pytest.approx(16.06e9)
    assert H100_70B_TP4.weight_bytes == pytest.approx(141.1e9, rel=1e-3)
    # Decode floor: weights once per step, 16.06 GB / 3.35 TB/s = 4.8 ms before efficiency.
    floor = H100_8B.weight_bytes / H100_8B.mem_bandwidth
    assert floor == pytest.approx(4.8e-3, rel=0.01)
    one = decode_step(H100_8B, 1, 100)
    assert one == pytest.approx(floor / 0.85 + 1.5e-3, rel=0.01)


def test_step_time_grows_with_uncached_prompt_tokens() -> None:
    times = [prefill_step(H100_8B, n) for n in (512, 1024, 2048, 4096)]
    assert times == sorted(times) and len(set(times)) == 4
    # Compute-bound: 4096 tokens of 8B at 53% MFU is at least 0.12 s.
    assert times[-1] > 4096 * 2 * 8.03e9 / (989e12 * 0.53)


def test_prefix_hit_makes_the_prefill_step_faster_in_the_engine() -> None:
    engine = Engine(EngineConfig(latency=H100_8B, max_num_batched_tokens=8192))
    prompt = list(range(4000))
    engine.add_request(EngineRequest("cold", prompt, 1, 0.0))
    cold = engine.step(0.0)
    engine.add_request(EngineRequest("warm", prompt, 1, 0.0))
    warm = engine.step(0.0)
    assert warm.outputs[0].num_cached_tokens == 3984
    assert cold.duration_s > 5 * warm.duration_s


def test_step_time_grows_with_batch_size() -> None:
    times = [decode_step(H100_8B, b, 2048) for b in (1, 8, 64, 256)]
    assert times == sorted(times) and len(set(times)) == 4
    # Reference: 64 requests x 4k context add ~33.5 GB of KV reads, ~10 ms more on H100.
    extra = decode_step(H100_8B, 64, 4096) - decode_step(H100_8B, 1, 4096)
    assert extra == pytest.approx(33.5e9 / (3.35e12 * 0.85), rel=0.05)


def test_engine_step_time_grows_with_the_running_batch() -> None:
    def decode_time(n: int) -> float:
        engine = Engine(
            EngineConfig(latency=H100_8B, num_blocks=8192, max_num_batched_tokens=65536)
        )
        for i in range(n):
            engine.add_request(EngineRequest(f"r{i}", [i + 1] * 1000, 5, 0.0))
        engine.step(0.0)  # the prefills
        return engine.step(0.0).duration_s  # all decoding

    assert decode_time(1) < decode_time(16) < decode_time(64)


def test_presets_differ_sensibly() -> None:
    for model in (H100_8B, H200_8B, H100_70B_TP4, H100_70B_TP8):
        assert decode_step(model, 16, 2000) < prefill_step(model, 2048)
    # 70B is slower than 8B, for decode and for prefill.
    assert decode_step(H100_70B_TP4, 16, 2000) > decode_step(H100_8B, 16, 2000)
    assert prefill_step(H100_70B_TP4, 2048) > prefill_step(H100_8B, 2048)
    # H200's bandwidth makes decode faster; the same compute leaves prefill equal.
    assert decode_step(H200_8B, 32, 4000) < 0.8 * decode_step(H100_8B, 32, 4000)
    assert prefill_step(H200_8B, 4096) == pytest.approx(prefill_step(H100_8B, 4096))
    # More GPUs, less time, though not twice less: the all-reduces cost something.
    tp4, tp8 = decode_step(H100_70B_TP4, 32, 2000), decode_step(H100_70B_TP8, 32, 2000)
    assert tp8 < tp4 < 2 * tp8
    assert H100_70B_TP8._tp_time(1) > H100_70B_TP4._tp_time(1) > 0 == H100_8B._tp_time(1)


def test_tiny_cpu_preset_costs_a_few_milliseconds_per_step() -> None:
    tiny = latency_preset("tiny-cpu")
    assert 1e-3 < decode_step(tiny, 1, 50) < 5e-3
    # Reference observation: 48 prompt tokens and 20 output tokens in about 50 ms.
    total = prefill_step(tiny, 48) + sum(decode_step(tiny, 1, 48 + i) for i in range(1, 20))
    assert 0.03 < total < 0.08


def test_empty_step_is_free() -> None:
    assert H100_8B.step_time(0, 0, 0) == 0.0


def test_latency_preset_lookup_lists_the_names() -> None:
    assert set(PRESETS) >= {
        "llama-3.1-8b-h100",
        "llama-3.1-8b-h200",
        "llama-3.1-70b-4xh100",
        "llama-3.1-70b-8xh100",
        "tiny-cpu",
    }
    assert all(PRESETS[name].name == name for name in PRESETS)
    with pytest.raises(ValueError, match=r"unknown latency preset 'gpt-9'.*llama-3\.1-8b-h100"):
        latency_preset("gpt-9")


def test_latency_model_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="mfu"):
        LatencyModel("x", 1e9, 2, 64, 1, 64, 1e12, 1e12, mfu=0)
