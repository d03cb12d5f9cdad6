"""Integrations of grpo-fast's kernels into other trainers (TRL). Imports: grpo_fast.kernels, models and
rollout; never the trainer."""
