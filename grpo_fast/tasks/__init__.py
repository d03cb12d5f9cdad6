"""The embedded tasks and their assets: `default_task` (`make demo`: the shop word problems, their reward, the
tiny base model in assets/shop-base, the code task), `tools_task` (`make demo-tools`: the same with a
calculator tool and its own base model), `arithmetic` (`make demo-smollm2`: additions and two-step word
problems for a real chat model), `smollm2` (SmolLM2-135M-Instruct built offline from a PyPI wheel).

Imports: the standard library and transformers / safetensors only; nothing else of grpo_fast (every other
part may import these).
"""
