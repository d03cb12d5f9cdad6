"""bench.profiles.decode's floor: the bytes a decode step must read, counted here module by module."""

import pytest
from tiny_models import tiny_lm

from bench.profiles.decode import decode_work


@pytest.mark.parametrize(
    "dtype,elem,head_elem,kv_elem", [("model", 4, 4, 4), ("bf16", 2, 2, 2), ("int8", 1, 4, 4)]
)
def test_decode_bytes_are_the_weights_per_step_and_the_kv_written_so_far(dtype, elem, head_elem, kv_elem):
    """An fp32 policy's KV is fp32, a bf16 rollout's bf16 (the engine's), an int8 rollout's fp32."""
    model = tiny_lm("llama", vocab=97)
    cfg = model.config
    groups, G, steps, prompt_tokens = 2, 3, 5, 11
    rows = groups * G
    per_step = 0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            per_step += lin.in_features * lin.out_features * elem
    per_step += cfg.vocab_size * cfg.hidden_size * head_elem
    d = cfg.hidden_size // cfg.num_attention_heads
    kv = 0
    for s in range(steps):  # step s: each group's prompt once, each row's s + 1 completion slots
        for _ in model.model.layers:
            kv += 2 * cfg.num_key_value_heads * d * kv_elem * (prompt_tokens + rows * (s + 1))
    work = decode_work(model, prompt_tokens, groups, rows, steps, dtype)
    assert work["weight_bytes"] == per_step * steps
    assert work["kv_bytes"] == kv
    assert work["bytes"] == per_step * steps + kv
    linear = sum(p.numel() for n, p in model.model.layers.named_parameters() if "proj" in n)
    assert work["flops"] > 2 * rows * steps * (linear + cfg.vocab_size * cfg.hidden_size)


@pytest.mark.parametrize("gb,gflop,bound", [(0.6, 4.5, "compute"), (0.6, 1.0, "bandwidth")])
def test_fractions_hold_a_step_against_the_slower_floor_and_say_the_bandwidth_ceiling(gb, gflop, bound):
    from bench.profiles.decode import fractions

    steps, seconds, bw, peak = 10, 0.4, 30.0, 200.0  # 40 ms a step, 30 GB/s, 200 GFLOP/s
    f = fractions(dict(bytes=gb * 1e9 * steps, flops=gflop * 1e9 * steps), steps, seconds, bw, peak)
    t_bytes, t_flops = gb / bw, gflop / peak  # seconds a step each floor takes
    assert f["bound"] == bound
    assert f["ms_per_step"] == pytest.approx(40.0)
    assert f["floor_ms_per_step"] == pytest.approx(1e3 * max(t_bytes, t_flops))
    assert f["bandwidth_fraction"] == pytest.approx(t_bytes / 0.04)
    assert f["roofline_fraction"] == pytest.approx(max(t_bytes, t_flops) / 0.04)
    # the most bandwidth fraction any code reaches: the step at its floor
    assert f["bandwidth_fraction_ceiling"] == pytest.approx(t_bytes / max(t_bytes, t_flops))
