"""The first step's batch of a tiny trainer run, rebuilt outside the trainer: the same prompts (the sampler's
first draw), the same sampled completions (the engine with the run's seed: the samples are the step's inputs,
not what a test checks), rewards from the task's own function and advantages from the fp64 oracle. Tests then
score it with full logits and plain formulas and compare with the trainer's update."""

from dataclasses import dataclass

import torch
from oracle import naive_advantages
from transformers import AutoTokenizer

from grpo_fast.rollout import generate_groups
from grpo_fast.tasks import default_task
from grpo_fast.trainer.data import PromptSampler, train_and_eval_rows
from grpo_fast.trainer.train import encode_prompts


@dataclass
class Batch:
    completion_ids: torch.Tensor  # (n * G, C)
    completion_mask: torch.Tensor
    advantages: torch.Tensor  # (n * G,) fp64
    full_ids: torch.Tensor  # (n * G, P + C): each completion behind its prompt
    full_mask: torch.Tensor
    position_ids: torch.Tensor
    P: int


def first_step_batch(cfg, model, seed: int, G: int = 4, C: int = 16, temperature: float = 1.0) -> Batch:
    """The batch of step 1 of `cfg` (QUICK-sized: 2 prompts, G completions of up to C tokens) on the
    embedded task, sampled by `model` (the base)."""
    tok = AutoTokenizer.from_pretrained(default_task.ASSET_DIR)
    rows = PromptSampler(train_and_eval_rows(cfg)[0], 2, seed).next()
    _, ids, mask = encode_prompts(rows, tok, cfg.max_prompt_length, "cpu")
    gen = torch.Generator().manual_seed(seed)
    c_ids, c_mask = generate_groups(
        model, ids, mask, G, C, temperature=temperature, eos_token_id=tok.eos_token_id, generator=gen
    )
    comps = tok.batch_decode(c_ids * c_mask, skip_special_tokens=True)
    answers = [r["answer"] for r in rows for _ in range(G)]
    adv = naive_advantages(torch.tensor(default_task.shop_answer_reward(None, comps, answers)), G)
    full = torch.cat([ids.repeat_interleave(G, 0), c_ids], 1)
    fmask = torch.cat([mask.repeat_interleave(G, 0), c_mask], 1)
    return Batch(c_ids, c_mask, adv, full, fmask, (fmask.cumsum(-1) - 1).clamp(min=0), ids.shape[1])
