"""Build the embedded default's tokenizer and weak base model (grpo_fast/tasks/assets/shop-base), or with
`--task shop-tools` the multi-turn task's (grpo_fast/tasks/assets/shop-tools-base:
grpo_fast/tasks/tools_task.py).

    python scripts/build_base_model.py [--task shop|shop-tools] [--out DIR] [--steps N]

A word-level tokenizer made offline from the task's vocabulary, and a 2-layer Llama-shaped model pretrained
by next-token prediction on the noisy teacher's corpus (grpo_fast/tasks/default_task.py): it learns the
format and the procedure, and the teacher's systematic slip. Runs in about a minute on 2 CPU cores;
deterministic.
"""

import argparse
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from grpo_fast.rollout.tools import tool_schema
from grpo_fast.tasks import default_task as task
from grpo_fast.tasks import tools_task

SPECIAL = ["<pad>", "<eos>", "<unk>", "<think>", "</think>"]


def build_tokenizer(words=None) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + (words or task.vocabulary()))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # words joined by single spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.padding_side = "left"
    return fast


def build_model(vocab_size: int, tok: PreTrainedTokenizerFast, max_positions: int = 64) -> LlamaForCausalLM:
    # Llama-shaped: AutoTokenizer honours our tokenizer.json for model_type "llama"; for "qwen2",
    # transformers 5 substitutes its BPE Qwen2Tokenizer
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def corpus_batch(tok, problems, rng, batch, tools=False):
    texts = []
    for _ in range(batch):
        p = rng.choice(problems)
        question = task.prompt_text(p, rng.randrange(len(task.TEMPLATES)))
        if tools:  # the conversation as the chat template renders it (what a rollout's tokens are)
            msgs = [{"role": "user", "content": question}, *tools_task.noisy_conversation(p, rng)]
            schemas = [tool_schema(tools_task.calculator)]
            texts.append(tok.apply_chat_template(msgs, tools=schemas, tokenize=False))
        else:
            texts.append(question + " " + task.noisy_completion(p, rng) + " " + tok.eos_token)
    enc = tok(texts, return_tensors="pt", padding=True)
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    return enc.input_ids, enc.attention_mask, labels


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--task", default="shop", choices=("shop", "shop-tools"))
    ap.add_argument("--out", default=None, help="default: the task's asset directory")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rng = random.Random(0)
    tools = args.task == "shop-tools"
    if tools:
        tok = build_tokenizer(tools_task.vocabulary())
        tok.chat_template = tools_task.CHAT_TEMPLATE
        model = build_model(len(tok), tok, max_positions=96)
    else:
        tok = build_tokenizer()
        model = build_model(len(tok), tok)
    problems = task.split_problems()["train"]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    t0 = time.time()
    for step in range(args.steps):
        ids, mask, labels = corpus_batch(tok, problems, rng, args.batch, tools)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        loss = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.time() - t0:.0f}s", flush=True)
    out = Path(args.out or (tools_task.ASSET_DIR if tools else task.ASSET_DIR))
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(
        f"saved {sum(p.numel() for p in model.parameters())} parameters to {out} in {time.time() - t0:.0f}s"
    )


if __name__ == "__main__":
    main()
