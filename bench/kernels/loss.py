"""GRPO loss from the last hidden state, forward and forward+backward: ours vs naive torch, TRL and Liger.

    python -m bench.kernels.loss [--quick]
    python -m bench.kernels.loss --options [--ns 512]   # each loss-family option vs our dapo path

Every provider computes the same TRL-semantics loss (dapo, beta 0.04 with reference log-probs, old log-probs,
two-sided clip) from hidden (N, H) and an LM head (V, H), each measured in its own process.
"""

import statistics
import sys

import torch
from grpo_fast.kernels.logprobs import twin_chunk_rows

from bench._utils import measure_mode, sweep_main, worker_main

PROVIDERS = ["naive", "trl_selective", "trl_chunked", "liger", "grpo_fast"]
T_LEN = 256  # completion length: N tokens are N / 256 sequences
BETA, EPS = 0.04, 0.2


def trl_loss(logps, old, ref, adv, mask):
    """TRL 1.16 GRPOTrainer's dapo loss on per-token log-probs (the part that follows the LM head)."""
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - EPS, 1 + EPS)
    per_token = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    per_token = per_token + BETA * (torch.exp(ref - logps) - (ref - logps) - 1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def make_provider(name, h, w, tgt, mask, adv, old, ref):
    B, T, H = h.shape
    if name == "naive":
        return lambda: trl_loss(
            torch.log_softmax((h @ w.T).float(), -1).gather(-1, tgt[..., None]).squeeze(-1),
            old,
            ref,
            adv,
            mask,
        )
    if name == "trl_selective":
        from trl.trainer.utils import selective_log_softmax

        return lambda: trl_loss(selective_log_softmax(h @ w.T, tgt), old, ref, adv, mask)
    if name == "trl_chunked":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        def f():
            lp = ChunkedLogProbFunction.apply(
                h.reshape(-1, H), w, None, tgt.reshape(-1), 1.0, 32768, None, 1.0, ()
            )
            return trl_loss(lp[0].view(B, T), old, ref, adv, mask)

        return f
    if name == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        # compiled=False on CPU: torch.compile of Liger's chunk function takes minutes on 2 cores
        lg = LigerFusedLinearGRPOLoss(
            beta=BETA,
            compiled=h.is_cuda,
            use_ref_model=True,
            epsilon_low=EPS,
            epsilon_high=EPS,
            loss_type="dapo",
        )
        return lambda: lg(h, w, tgt, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)[0]
    if name == "grpo_fast" or name.startswith("grpo_fast:"):
        from grpo_fast.kernels import fused_linear_grpo_loss

        kw = dict(old_logps=old, ref_logps=ref, beta=BETA, epsilon_low=EPS, loss_type="dapo")
        kw.update(OPTIONS[name.partition(":")[2]] if ":" in name else {})
        if "sampling_correction" in kw or "off_policy_mask_threshold" in kw:
            kw["sampling_logps"] = old + 0.05 * torch.randn_like(old)  # an engine a little off the trainer
        return lambda: fused_linear_grpo_loss(h, w, tgt, mask, adv, **kw)[0]
    raise ValueError(f"unknown provider {name!r}")


# each option of the loss family, measured against "grpo_fast" (dapo, token level) in the same run
OPTIONS = {
    "gspo": dict(importance_sampling_level="sequence"),  # today's row-wise (two-pass) path
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo": dict(loss_type="sapo"),
    "luspo": dict(loss_type="luspo"),
    "vespo": dict(loss_type="vespo"),
    "delta": dict(delta=1.5),
    "token_truncate": dict(sampling_correction="token_truncate"),
    "token_mask": dict(sampling_correction="token_mask"),
    "sequence_mask": dict(sampling_correction="sequence_mask"),
    "off_policy_mask": dict(off_policy_mask_threshold=0.5),
    "top_entropy": dict(top_entropy_quantile=0.2),
    "entropy_coef": dict(entropy_coef=0.01),
}


def options_main(argv):
    """Each option's fwd+bwd time and memory on the CPU shape next to the dapo path, one process each."""
    import argparse

    from bench._utils import cpu_line, machine_info, markdown_table, sweep, write_results

    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds over every option")
    ap.add_argument("--hv", default="1024,151936", help="hidden size, vocabulary (576,49152: SmolLM2)")
    ap.add_argument("--name", default="bench_loss_options", help="results file name")
    args = ap.parse_args(argv)
    H, V = (int(x) for x in args.hv.split(","))
    base = dict(H=H, V=V, dtype="float32", repeats=args.repeats)
    providers = (["grpo_fast"] + [f"grpo_fast:{k}" for k in OPTIONS]) * args.rounds + ["grpo_fast"]
    runs = sweep("kernels.loss", providers, [int(n) for n in args.ns.split(",")], ["fwd_bwd"], base)
    rows = []  # per (N, option): the median over rounds of each process's median
    for n in sorted({r["N"] for r in runs}):
        for p in dict.fromkeys(providers):
            mine = [r for r in runs if r["N"] == n and r["provider"] == p and "error" not in r]
            if not mine:
                rows.append(next(r for r in runs if r["N"] == n and r["provider"] == p))
                continue
            times = sorted(r["median_ms"] for r in mine)
            rows.append(
                dict(
                    N=n,
                    provider=p,
                    median_ms=statistics.median(times),
                    rounds_ms=", ".join(f"{t:.0f}" for t in times),
                    peak_mem_mb=max(r["peak_mem_mb"] for r in mine),
                )
            )
    for r in rows:
        dapo = next(x for x in rows if x["provider"] == "grpo_fast" and x["N"] == r["N"])
        if "error" not in r:
            r["time_vs_dapo"] = r["median_ms"] / dapo["median_ms"]
            r["mem_vs_dapo"] = r["peak_mem_mb"] / max(dapo["peak_mem_mb"], 1e-9)
    info = machine_info()
    cols = [
        ("N", "N"),
        ("provider", "option"),
        ("median_ms", "median ms"),
        ("rounds_ms", "each round's ms"),
        ("peak_mem_mb", "peak MiB above inputs"),
        ("time_vs_dapo", "time / dapo"),
        ("mem_vs_dapo", "memory / dapo"),
        ("error", "error"),
    ]
    md = (
        f"# Loss-family options, fused loss forward+backward on the twin (H={H}, V={V}, fp32)\n\nMachine: "
        f"{cpu_line(info)}, torch {info['versions']['torch']}, commit {info['git_commit']}; rows of {T_LEN} "
        f"tokens, {twin_chunk_rows(V)} tokens per twin chunk. Rounds "
        f"interleaved ({args.rounds}, each option in its own process, dapo also last); each row the median "
        "over rounds.\n\n" + markdown_table(rows, cols) + "\n"
    )
    out = write_results(args.name, {"machine": info, "config": base, "rows": rows}, md)
    print(md)
    print(f"wrote {out}/{args.name}.{{json,md}}")


def measure_one(a):
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a["dtype"])
    N, H, V = a["N"], a["H"], a["V"]
    B = max(1, N // T_LEN)
    T = N // B
    h = torch.randn(B, T, H, device=device).to(dtype).requires_grad_(a["mode"] == "fwd_bwd")
    w = (torch.randn(V, H, device=device) / H**0.5).to(dtype).requires_grad_(a["mode"] == "fwd_bwd")
    tgt = torch.randint(0, V, (B, T), device=device)
    mask = torch.ones(B, T, device=device)
    adv = torch.randn(B, device=device)
    base = -torch.rand(B, T, device=device) * 2 - 10  # log-probs near log(1/V): ratios around 1
    old, ref = base + 0.1 * torch.randn_like(base), base + 0.1 * torch.randn_like(base)
    loss_fn = make_provider(a["provider"], h, w, tgt, mask, adv, old, ref)
    return measure_mode(loss_fn, a["mode"], (h, w), device, a["repeats"])


def main(argv=None):
    sweep_main(
        argv,
        module="kernels.loss",
        name="bench_loss",
        doc=__doc__,
        providers=PROVIDERS,
        title="GRPO loss from hidden states (dapo, beta 0.04)",
    )


if __name__ == "__main__":
    if not worker_main(measure_one):
        options_main(sys.argv[2:]) if sys.argv[1:2] == ["--options"] else main(sys.argv[1:])
