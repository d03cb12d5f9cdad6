"""Which weights sampled a rollout, told by transformers: the log-probs of a completion's model-written
tokens under the weights of a version (the initial model, or the checkpoint saved after that many steps),
against the log-probs the engine reported while sampling."""

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def version_model(base, out, version: int, dtype=torch.float32):
    """The model `base` as trained for `version` steps by the run in `out` (its checkpoint-<version>)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if version:
        state = load_file(Path(out) / f"checkpoint-{version}" / "model.safetensors")
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
