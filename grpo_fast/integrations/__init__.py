"""Integrations of grpo-fast's kernels into other trainers (TRL)."""
