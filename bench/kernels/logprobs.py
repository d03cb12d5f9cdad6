"""Per-token log-probs from hidden states and an LM head, forward and forward+backward, side by side.

    python -m bench.kernels.logprobs [--quick]

Providers: naive torch (full logits, log_softmax, gather), TRL's selective_log_softmax on full logits,
TRL 1.16's tiled LM-head path (ChunkedLogProbFunction), Cut Cross-Entropy's torch_compile implementation
(-CE per token) and ours (fused_linear_logprobs, the twin on CPU). Each is measured in its own process.
"""

import sys

import torch

from bench._utils import measure_mode, sweep_main, worker_main

PROVIDERS = ["naive", "trl_selective", "trl_chunked", "cce_torch_compile", "grpo_fast"]


def make_provider(name, h, w, tgt):
    if name == "naive":
        return lambda: torch.log_softmax((h @ w.T).float(), -1).gather(-1, tgt[:, None]).squeeze(-1)
    if name == "trl_selective":
        from trl.trainer.utils import selective_log_softmax

        return lambda: selective_log_softmax(h @ w.T, tgt)
    if name == "trl_chunked":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        return lambda: ChunkedLogProbFunction.apply(h, w, None, tgt, 1.0, 32768, None, 1.0, ())[0]
    if name == "cce_torch_compile":
        from cut_cross_entropy import linear_cross_entropy

        return lambda: -linear_cross_entropy(h, w, tgt, reduction="none", impl="torch_compile")
    if name == "grpo_fast":
        from grpo_fast.kernels import fused_linear_logprobs

        return lambda: fused_linear_logprobs(h, w, tgt)
    raise ValueError(f"unknown provider {name!r}")


def measure_one(a):
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a["dtype"])
    N, H, V = a["N"], a["H"], a["V"]
    grad = a["mode"] == "fwd_bwd"
    h = torch.randn(N, H, device=device).to(dtype).requires_grad_(grad)
    w = (torch.randn(V, H, device=device) / H**0.5).to(dtype).requires_grad_(grad)
    tgt = torch.randint(0, V, (N,), device=device)
    up = torch.randn(N, device=device)
    fn = make_provider(a["provider"], h, w, tgt)
    return measure_mode(fn, a["mode"], (h, w), device, a["repeats"], upstream=up)


def main(argv=None):
    sweep_main(
        argv,
        module="kernels.logprobs",
        name="bench_logprobs",
        doc=__doc__,
        providers=PROVIDERS,
        title="Token log-probs from hidden states",
    )


if __name__ == "__main__":
    if not worker_main(measure_one):
        main(sys.argv[1:])
