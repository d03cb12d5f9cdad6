"""The model side shared by rollouts and training: where things are inside a Hugging Face causal LM
(`model_parts`), the KV-cache argument across transformers versions (`hf_compat`), and the shared-prefix
training layout (`shared_prefix`: each group's prompt once, exact).

Imports: torch and transformers only; nothing else of grpo_fast.
"""
