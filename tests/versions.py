"""Which weights sampled a rollout, told by transformers: the log-probs of a completion's model-written
tokens under the weights of a version (the initial model, or the checkpoint saved after that many steps),
against the log-probs the engine reported while sampling."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def version_model(base, out, version: int, dtype=torch.float32):
    """The model `base` as trained for `version` steps by the run in `out` (its checkpoint-<version>; a LoRA
    run's adapter merged by PEFT)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ckpt = Path(out) / f"checkpoint-{version}"
    if version and (ckpt / "adapter_model.safetensors").is_file():  # LoRA: PEFT's own loading and merge
        from peft import PeftModel

        return PeftModel.from_pretrained(model, ckpt).merge_and_unload().eval().to(dtype)
    if version:
        state = load_file(ckpt / "model.safetensors")
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.to(dtype)


def logprob_error(model, ro, r: int, G: int, temperature: float) -> float:
    """max |reported - transformers'| log-prob over the tokens the model wrote in completion r of `ro`
    (a step.Rollout, or anything with its prompt_ids, prompt_mask, completion_ids, completion_mask,
    model_mask and sampling_logps): transformers reads the whole completion, tool turns included."""
    prompt = ro.prompt_ids[r // G][ro.prompt_mask[r // G].bool()]
    k = int(ro.completion_mask[r].sum())
    ids = torch.cat([prompt, ro.completion_ids[r, :k]])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1].double() / temperature
    theirs = logits.log_softmax(-1).gather(-1, ids[0, prompt.numel() :, None])[:, 0]
    written = ro.model_mask[r, :k].bool()
    return float((ro.sampling_logps[r, :k].double() - theirs)[written].abs().max())


def assert_sampled_by(made, versions, base, out, G: int, temperature: float, same: float, apart=1e-2,
                      dtype=torch.float32) -> None:  # fmt: skip
    """Rollout made[i] was sampled by version versions[i] of `base` as the run in `out` trained it: every
    completion's model-written tokens have the engine's log-probs within `same` of transformers' under that
    version, and the largest difference under the next version (where `out` saved it) is over `apart` (the
    check tells versions apart)."""
    models = {}

    def model(v):
        if v not in models:
            models[v] = version_model(base, out, v, dtype)
        return models[v]

    for i, (ro, v) in enumerate(zip(made, versions, strict=True)):
        rows = range(ro.completion_ids.shape[0])
        errors = [logprob_error(model(v), ro, r, G, temperature) for r in rows]
        assert max(errors) < same, (i, v, errors)
        if v + 1 < len(made) and (Path(out) / f"checkpoint-{v + 1}").is_dir():
            others = [logprob_error(model(v + 1), ro, r, G, temperature) for r in rows]
            assert max(others) > apart, (i, v, others)


def assert_tools_ran(records, made) -> None:
    """Multi-turn rollouts in which the tool was called and its turns' tokens are attended, out of the
    loss (`tool_mask` 0)."""
    assert sum(r["tools/call_frequency"] for r in records) > 0
    assert sum(float((ro.completion_mask * (1 - ro.tool_mask)).sum()) for ro in made) > 0


def version_argv(tmp_path, G: int, steps: int, temperature: float) -> list:
    """`grpo-fast train` flags for a version check: a checkpoint after every step, into tmp_path/run, a
    reward that varies within every group and lr 3e-3 (every step moves the weights well past rounding)."""
    reward = tmp_path / "rewards.py"
    reward.write_text(
        "def spread(completions, completion_ids, **kw):\n"
        "    return [float(sum(t * (k + 1) for k, t in enumerate(ids)) % 7) for ids in completion_ids]\n"
    )
    return [
        "--output-dir", str(tmp_path / "run"), "--reward", f"{reward}:spread", "--num-generations", str(G),
        "--prompts-per-step", "2", "--eval-max-samples", "0", "--save-steps", "1", "--save-total-limit",
        str(steps + 1), "--max-steps", str(steps), "--learning-rate", "3e-3", "--warmup-steps", "0",
        "--lr-scheduler-type", "constant", "--time-budget-s", "0", "--temperature", str(temperature),
    ]  # fmt: skip


def train_recording(monkeypatch, argv) -> tuple[list, list]:
    """Train `argv` in this process, keeping every rollout the trainer trained: (the step records, the
    rollouts), one each per step."""
    import grpo_fast.trainer.train as T
    from grpo_fast.trainer.config import parse_config

    made, real = [], T.rollout

    def recording(run, rows, generator=None):
        made.append(real(run, rows, generator))
        return made[-1]

    monkeypatch.setattr(T, "rollout", recording)
    cfg = parse_config(argv)
    T.train(cfg)
    lines = (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, cfg.max_steps + 1)) and len(made) == cfg.max_steps
    return records, made
