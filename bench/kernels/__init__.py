"""Kernel micro-benchmarks: the fused log-probs (`python -m bench.kernels.logprobs`) and the fused GRPO loss
(`python -m bench.kernels.loss`) against naive torch, Liger and TRL's loss, time and peak memory."""
