"""The embedded tasks and their assets: `default_task` (`make demo`: the shop word problems, their reward, the
tiny base model in assets/shop-base, the code task), `tools_task` (`make demo-tools`: the same with a
calculator tool and its own base model), `arithmetic` (`make demo-smollm2`: additions and two-step word
problems for a real chat model; `--task smollm2-two-step`: the word problems alone), `smollm2`
(SmolLM2-135M-Instruct built offline from a PyPI wheel). `EMBEDDED` is the table of `--task` names: each
one's rows and base model (`task_rows`, `task_model`).

Imports: the standard library and transformers / safetensors only; nothing else of grpo_fast (every other
part may import these).
"""

from . import arithmetic, default_task, smollm2, tools_task

# --task NAME: its rows (a function of the split: "train" or "eval") and its base model's directory (a
# function: SmolLM2 is built on first use)
EMBEDDED = {
    "shop": (default_task.dataset_rows, lambda: str(default_task.ASSET_DIR)),
    "shop-tools": (tools_task.dataset_rows, lambda: str(tools_task.ASSET_DIR)),
    **{
        name: (lambda split, kinds=kinds: arithmetic.dataset_rows(split, kinds), lambda: str(smollm2.build()))
        for name, kinds in arithmetic.TASK_KINDS.items()
    },
}


def task_rows(name: str) -> tuple[list[dict], list[dict]]:
    """The embedded task's (train rows, eval rows)."""
    rows = EMBEDDED[name][0]
    return rows("train"), rows("eval")


def task_model(name: str) -> str:
    """The directory of the embedded task's base model."""
    return EMBEDDED[name][1]()
