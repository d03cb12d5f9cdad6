"""bench.report's headline figures: what they may be computed from."""

from bench import report


def _row(provider, tokens_per_s, **extra):
    return dict(provider=provider, label=provider, tokens_per_s=tokens_per_s, step_s=1000 / tokens_per_s,
                generate_s=1.0, train_s=1.0, peak_mem_mb=1000.0, **extra)  # fmt: skip


def test_fastest_row_is_a_measured_one():
    """A pipelined row whose step was modeled (too few steps after its head start) is not a measurement: the
    headline takes the fastest measured row, 150 / 25 = 6x here, and names the modeled row it left out, even
    though the model says 170."""
    rows = [
        _row("trl", 25.0),
        _row("grpo_fast", 150.0),
        _row("grpo_fast_async", 170.0, steady="step model: 1 step(s) after the head start, < 4"),
        _row("grpo_fast_async_mp", 140.0, steady="measured: 4 steps after the head start"),
    ]
    summary = {}
    text = report._fastest_line(rows, summary, "e2e_real")
    assert summary["e2e_real_fastest_provider"] == "grpo_fast"
    assert summary["e2e_real_fastest_speedup_vs_trl"] == 6.0
    assert "**6.00x**" in text and "left out" in text and "grpo_fast_async)" in text
    rows[3]["tokens_per_s"] = 200.0  # a pipelined row measured at steady state counts
    report._fastest_line(rows, summary, "e2e_real")
    assert summary["e2e_real_fastest_provider"] == "grpo_fast_async_mp"
