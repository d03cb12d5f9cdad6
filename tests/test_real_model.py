"""A real pretrained model (SmolLM2-135M-Instruct, built offline by grpo_fast.tasks.smollm2): chat prompts of
different lengths, left padding, EOS at various points. Greedy completions equal HF `generate`, shared and
unshared. Also run under the oldest transformers we support (make test), where a misnamed cache argument
once garbled every completion silently."""

import pytest
from oracle import assert_greedy_row_equal

from grpo_fast.rollout import generate_groups

pytestmark = pytest.mark.transformers_range
ENGINES = ["native", "reference"]

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors, one per line, and say nothing else about them.",
    "2+2?",
]


def _chat_batch(tok):
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    tok.padding_side = "left"
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("share_prefix", [True, False])
def test_greedy_chat_completions_equal_hf_generate(smollm2, share_prefix, engine):
    model, tok = smollm2
    enc = _chat_batch(tok)
    lengths = enc.attention_mask.sum(1)
    assert len(set(lengths.tolist())) == len(QUESTIONS)  # left padding is exercised
    G, C = 2, 40
    ids, mask = generate_groups(
        model,
        enc.input_ids,
        enc.attention_mask,
        G,
        C,
        temperature=0.0,
        eos_token_id=tok.eos_token_id,
        share_prefix=share_prefix,
        engine=engine,
        compile=False,
    )
    ended = 0
    for i in range(len(QUESTIONS)):
        prompt = enc.input_ids[i][enc.attention_mask[i].bool()][None]
        ref = model.generate(prompt, max_new_tokens=C, do_sample=False, eos_token_id=tok.eos_token_id)
        ref = ref[0, prompt.shape[1] :]
        for g in range(G):
            got = ids[i * G + g][mask[i * G + g].bool()]
            assert_greedy_row_equal(model, prompt[0], got, ref)
        ended += int(ref[-1] == tok.eos_token_id and len(ref) < C)
    assert ended >= 2  # completions end at EOS at different lengths, not all at C
    first = tok.decode(ids[0][mask[0].bool()], skip_special_tokens=True)
    assert "Paris" in first, first
