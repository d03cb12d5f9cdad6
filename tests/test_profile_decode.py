"""bench.profiles.decode's floor: the bytes a decode step must read, counted here module by module."""

import pytest
from tiny_models import tiny_lm

from bench.profiles.decode import decode_work


@pytest.mark.parametrize("dtype,elem,head_elem", [("model", 4, 4), ("bf16", 2, 2), ("int8", 1, 4)])
def test_decode_bytes_are_the_weights_per_step_and_the_kv_written_so_far(dtype, elem, head_elem):
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
            kv += 2 * cfg.num_key_value_heads * d * 4 * (prompt_tokens + rows * (s + 1))
    work = decode_work(model, prompt_tokens, groups, rows, steps, dtype)
    assert work["weight_bytes"] == per_step * steps
    assert work["kv_bytes"] == kv
    assert work["bytes"] == per_step * steps + kv
    linear = sum(p.numel() for n, p in model.model.layers.named_parameters() if "proj" in n)
    assert work["flops"] > 2 * rows * steps * (linear + cfg.vocab_size * cfg.hidden_size)
