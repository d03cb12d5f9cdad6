"""GRPO loss from the last hidden state, forward and forward+backward: ours vs naive torch, TRL and Liger.

    python -m bench.bench_loss [--quick]

Every provider computes the same TRL-semantics loss (dapo, beta 0.04 with reference log-probs, old log-probs,
two-sided clip) from hidden (N, H) and an LM head (V, H), each measured in its own process.
"""

import sys

import torch

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
    if name == "grpo_fast":
        from grpo_fast.kernels import fused_linear_grpo_loss

        return lambda: fused_linear_grpo_loss(
            h, w, tgt, mask, adv, old_logps=old, ref_logps=ref, beta=BETA, epsilon_low=EPS, loss_type="dapo"
        )[0]
    raise ValueError(f"unknown provider {name!r}")


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
        module="bench_loss",
        doc=__doc__,
        providers=PROVIDERS,
        title="GRPO loss from hidden states (dapo, beta 0.04)",
    )


if __name__ == "__main__":
    if not worker_main(measure_one):
        main(sys.argv[1:])
