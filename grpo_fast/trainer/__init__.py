"""`grpo-fast train` and `grpo-fast estimate`: the configuration (`config`), data (`data`, `batching`), the
precision recipe and optimizers (`precision`, `optimizers`), loading the policy (`modeling`), the loop
(`train`) and its phases (`step`), checkpoints (`checkpoint`), torchrun (`distributed`), the memory model and
planner (`estimate`, `memory`), plots (`plotting`).

Imports: any other part of grpo_fast (kernels, models, rollout, rewards, tasks); nothing imports it but the
command line (`grpo_fast.cli`, `python -m grpo_fast.train`).
"""
