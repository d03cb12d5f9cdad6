"""The reference engine's shared-prefix generation and the shared-prefix training forward equal the plain
per-sample computation."""

import pytest
import torch
from oracle import assert_greedy_equal, assert_greedy_row_equal
from tiny_models import tiny_lm

from grpo_fast.models.shared_prefix import shared_prefix_forward
from grpo_fast.rollout.reference import generate_plain as plain_generate
from grpo_fast.rollout.reference import generate_shared

pytestmark = pytest.mark.transformers_range

V = 97


def _model(kind):
    return tiny_lm(kind, V)


def _batch(n=3, P=7, G=4, C=6):
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([7, 4, 1][:n])  # ragged, left-padded
    prompt_mask = (torch.arange(P)[None, :] >= P - lengths[:, None]).long()
    prompt_ids = torch.randint(2, V, (n, P), generator=g) * prompt_mask
    comp_len = torch.randint(1, C + 1, (n * G,), generator=g)
    comp_len[0] = C
    completion_mask = (torch.arange(C)[None, :] < comp_len[:, None]).long()
    completion_ids = torch.randint(2, V, (n * G, C), generator=g) * completion_mask
    return prompt_ids, prompt_mask, completion_ids, completion_mask, G


def _plain_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, G):
    """Each sample alone: its unpadded prompt then its (unpadded) completion, one plain forward."""
    outs = []
    for s in range(completion_ids.shape[0]):
        p = prompt_ids[s // G][prompt_mask[s // G].bool()]
        c = completion_ids[s][completion_mask[s].bool()]
        ids = torch.cat([p, c])[None]
        h = model.model(input_ids=ids).last_hidden_state[0]
        out = torch.zeros(completion_ids.shape[1], h.shape[-1])
        out[: len(c)] = h[len(p) - 1 : len(p) - 1 + len(c)]
        outs.append(out)
    return torch.stack(outs)


def test_ragged_groups_equal_plain_forward():
    """Prompts with different numbers of completions (a micro-batch packed to a memory budget cuts groups
    anywhere): each completion's states equal its own plain forward, shared and unshared."""
    from grpo_fast.trainer.modeling import completion_hidden_states

    model = _model("llama").eval()
    p_ids, p_mask, c_ids, c_mask, G = _batch()
    counts = [3, 1, 4]  # rows 0-2 answer prompt 0, row 3 prompt 1, rows 4-7 prompt 2
    prompt_of = [0, 0, 0, 1, 2, 2, 2, 2]
    rows = torch.arange(8)
    with torch.no_grad():
        one = lambda r, i: (p_ids[i : i + 1], p_mask[i : i + 1], c_ids[r : r + 1], c_mask[r : r + 1])  # noqa
        want = torch.stack([_plain_hidden(model, *one(r, i), 1)[0] for r, i in zip(rows.tolist(), prompt_of)])
        for share in (True, False):
            got = completion_hidden_states(model, p_ids, p_mask, c_ids[rows], c_mask[rows], share, counts)
            valid = c_mask[rows].bool()
            assert (got - want)[valid].abs().max().item() < 1e-5, share
        for attention in ("segments", "varlen", "mask"):
            got = shared_prefix_forward(
                model, p_ids, p_mask, c_ids[rows], c_mask[rows], attention=attention, counts=counts
            )
            assert (got - want)[valid].abs().max().item() < 1e-5, attention
    with pytest.raises(ValueError, match="counts must give each"):
        shared_prefix_forward(model, p_ids, p_mask, c_ids[rows], c_mask[rows], counts=[4, 4])


@pytest.mark.parametrize(
    "kind,attention",
    [(k, a) for a in ("segments", "mask", "varlen") for k in ("qwen2", "llama")] + [("llama", "auto")],
)
def test_shared_prefix_forward_equals_plain_forward_and_gradients(kind, attention):
    _assert_shared_equals_plain(_model(kind).train(), attention)


@pytest.mark.parametrize("attention", ["segments", "varlen", "auto"])
def test_gradient_checkpointing_recomputes_the_same_attention(attention):
    """A checkpointed layer is recomputed in the backward, after the forward returned: with the trainer's
    checkpointing_kwargs it runs the forward's own attention again (gradients equal the plain forward's)."""
    from grpo_fast.models.model_parts import checkpointing_kwargs, enable_checkpointing

    model = _model("llama").train()
    enable_checkpointing(model, checkpointing_kwargs(model))
    _assert_shared_equals_plain(model, attention)


def test_foreign_gradient_checkpointing_keeps_the_mask():
    """Checkpointing enabled without checkpointing_kwargs (as TRL does) recomputes a layer with the model's
    own attention: "auto" takes the 4D mask, which reaches the recomputation as a forward argument, and a
    layout that needs its own attention is refused rather than silently recomputed without it."""
    from grpo_fast.models.model_parts import enable_checkpointing

    model = _model("qwen2").train()
    enable_checkpointing(model, {"use_reentrant": False})
    _assert_shared_equals_plain(model, "auto")
    with pytest.raises(ValueError, match="checkpointing_kwargs"):
        shared_prefix_forward(model, *_batch()[:4], attention="segments")


@pytest.mark.parametrize("attention", ["segments", "varlen"])
def test_per_segment_layouts_run_real_tokens_only(attention):
    """The per-segment attentions never cross a segment, so every group's real tokens run in one row: the
    decoder's layers see as many tokens as the prompts and completions hold, not groups padded to the
    longest (the linear layers' work is per token)."""
    model = _model("llama").eval()
    p_ids, p_mask, c_ids, c_mask, _ = _batch()
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    with torch.no_grad():
        shared_prefix_forward(model, p_ids, p_mask, c_ids, c_mask, attention=attention)
    hook.remove()
    assert seen == [(1, int(p_mask.sum() + c_mask.sum()), 32)]


def _assert_shared_equals_plain(model, attention):
    batch = _batch()
    valid = batch[3].bool()
    weights = torch.randn(*batch[2].shape, 32, generator=torch.Generator().manual_seed(2))

    shared = shared_prefix_forward(model, *batch[:4], attention=attention)
    (shared * weights * valid[..., None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    plain = _plain_hidden(model, *batch)
    (plain * weights * valid[..., None]).sum().backward()

    err = (shared - plain)[valid].abs().max().item()
    assert err < 1e-5, f"hidden states max err {err:.3g}"
    assert shared.shape == (12, 6, 32)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        e = (grads[name] - p.grad).abs().max().item()
        assert e < 1e-4 * max(1.0, p.grad.abs().max().item()), f"{name}: grad max err {e:.3g}"
    assert len(grads) == sum(1 for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_greedy_generation_identical_shared_and_unshared(kind):
    model = _model(kind)
    prompt_ids, prompt_mask, _, _, G = _batch()
    a = generate_shared(model, prompt_ids, prompt_mask, G, 10, temperature=0.0, eos_token_id=1)
    b = plain_generate(model, prompt_ids, prompt_mask, G, 10, temperature=0.0, eos_token_id=1)
    assert_greedy_equal(model, prompt_ids, prompt_mask, G, a, b)
    # greedy groups equal HF's own greedy decoding of each prompt
    for i in range(prompt_ids.shape[0]):
        ids = prompt_ids[i][prompt_mask[i].bool()][None]
        ref = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=1, pad_token_id=1)[
            0, ids.shape[1] :
        ]
        assert_greedy_row_equal(model, ids[0], a[0][i * G][a[1][i * G].bool()], ref)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_sampled_generation_matches_with_a_fixed_generator(kind):
    model = _model(kind)
    prompt_ids, prompt_mask, _, _, G = _batch()
    kw = dict(temperature=1.0, top_p=0.9, top_k=20, eos_token_id=1)
    a = generate_shared(
        model, prompt_ids, prompt_mask, G, 12, generator=torch.Generator().manual_seed(3), **kw
    )
    b = plain_generate(
        model, prompt_ids, prompt_mask, G, 12, generator=torch.Generator().manual_seed(3), **kw
    )
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert len({tuple(r.tolist()) for r in a[0][:G]}) > 1  # samples of a group differ


def test_flash_attention_models_take_the_varlen_path():
    # a 4D mask cannot go to flash-attention kernels: those models run the grouped layout packed as varlen
    # sequences (flash-attn's kernel on CUDA; here, without it, its PyTorch equivalent)
    model = _model("qwen2")
    batch = _batch()
    expected = shared_prefix_forward(model, *batch[:4], attention="mask")
    model.config._attn_implementation = "flash_attention_2"  # as loaded with attn_implementation=...
    got = shared_prefix_forward(model, *batch[:4])
    assert model.config._attn_implementation == "flash_attention_2"
    valid = batch[3].bool()
    assert torch.allclose(got[valid], expected[valid], atol=1e-5)
    with pytest.raises(ValueError, match="attention must be"):
        shared_prefix_forward(model, *batch[:4], attention="flash")


@pytest.mark.parametrize("share_prefix", [True, False])
def test_one_prompt_one_completion_is_the_plain_forward(share_prefix):
    """--group-split 1 trains sub-batches of one prompt and one completion: the maskless path, against each
    sample's plain forward (padding on both sides, a completion ending early)."""
    from grpo_fast.trainer.modeling import completion_hidden_states

    model = _model("llama").train()
    batch = _batch()
    plain = _plain_hidden(model, *batch)
    p_ids, p_mask, c_ids, c_mask, G = batch
    for s in (0, 5, 11):  # full-length completion, a shorter one, the 1-token prompt's
        i = s // G
        got = completion_hidden_states(model, p_ids[i : i + 1], p_mask[i : i + 1], c_ids[s : s + 1],
                                       c_mask[s : s + 1], share_prefix=share_prefix)  # fmt: skip
        valid = c_mask[s].bool()
        assert got.shape == (1, 6, 32)
        assert (got[0][valid] - plain[s][valid]).abs().max() < 1e-5
