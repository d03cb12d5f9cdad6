"""grpo_fast.integrations.trl.GRPOTrainer gives TRL's GRPOTrainer's numbers on one fixed batch.

The reference is TRL 1.16's own GRPOTrainer on an identical copy of the model (its chunked LM head, its loss
code); ours takes the fused kernels and the shared-prefix forward. Same prompts, completions, advantages,
old and reference log-probs; loss and every parameter gradient must agree.

Agree means the STYLE.md rule against TRL's own code run in fp64 on the same batch: our fp32 error at most
about twice TRL's fp32 error, plus a floor from the loss's condition at fp32 rounding (`_fp64_reference`).
Thresholds (the top-entropy quantile, the clip edges, the off-policy mask) are where rounding can move a
token across: a token closer to one in fp64 than fp32 rounding can resolve may be decided either way, and the
reference is then TRL's loss with either decision (GRPO batches always have such ties: a group's samples share
their first completion position's context, so its entropies are equal in exact arithmetic).
"""

import copy
import itertools
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_fast.integrations.trl as integ
from grpo_fast.tasks import default_task

trl = pytest.importorskip("trl")

G, N_PROMPTS, C = 4, 3, 7

EPS32 = torch.finfo(torch.float32).eps
# An fp32 forward's per-token log-prob or entropy is within this many eps of fp64's, relative to
# max(1, |value|): measured <= 16 on an AMD Zen 3 (avx2) for this model (3.8e-6 at entropies ~2), 4x that for
# other instruction sets' reduction orders. It sets the loss's rounding floor (through its fp64 condition),
# the gradients' (relative to their size, 4x for the cancellation between tokens: measured <= 35 eps, VESPO's
# exponential weights 142 with TRL's own at 133) and the band around a threshold inside which a token may
# fall on either side.
ROUNDING_EPS = 64


_RNG = torch.Generator().manual_seed(0)


def _reward(completions, **kwargs):
    """Random rewards: groups always have spread, so every step has a gradient (the model is near-greedy)."""
    return torch.rand(len(completions), generator=_RNG).tolist()


def _trainer(cls, model, tmp_path, trainer_kwargs=None, **overrides):
    tok = AutoTokenizer.from_pretrained(default_task.ASSET_DIR)
    args = dict(
        output_dir=str(tmp_path / cls.__module__),
        per_device_train_batch_size=G * N_PROMPTS,
        num_generations=G,
        max_completion_length=C,
        learning_rate=1e-3,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    args.update(overrides)
    data = Dataset.from_list([{"prompt": p["prompt"]} for p in default_task.dataset_rows("train")[:12]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = cls(
            model=model,
            reward_funcs=_reward,
            args=trl.GRPOConfig(**args),
            train_dataset=data,
            processing_class=tok,
            **(trainer_kwargs or {}),
        )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop; _compute_loss reads it
    return trainer


def _batch(model, beta):
    """Left-padded prompts of three lengths, G ragged completions each, rows shuffled (groups apart)."""
    g = torch.Generator().manual_seed(0)
    V, P = model.config.vocab_size, 9
    lengths = torch.tensor([9, 5, 2])
    prompt_mask = (torch.arange(P)[None] >= P - lengths[:, None]).long()
    prompt_ids = torch.randint(3, V, (N_PROMPTS, P), generator=g) * prompt_mask
    comp_len = torch.randint(1, C + 1, (N_PROMPTS * G,), generator=g)
    completion_mask = (torch.arange(C)[None] < comp_len[:, None]).long()
    completion_ids = torch.randint(3, V, (N_PROMPTS * G, C), generator=g) * completion_mask
    perm = torch.randperm(N_PROMPTS * G, generator=g)
    batch = {
        "prompt_ids": prompt_ids.repeat_interleave(G, 0)[perm],
        "prompt_mask": prompt_mask.repeat_interleave(G, 0)[perm],
        "completion_ids": completion_ids[perm],
        "completion_mask": completion_mask[perm],
        "advantages": torch.randn(N_PROMPTS * G, generator=g),
        "num_items_in_batch": completion_mask.sum(),
        # old log-probs a little off the policy, so ratios differ from 1 and some get clipped
        "old_per_token_logps": -7.0 + 0.3 * torch.randn(N_PROMPTS * G, C, generator=g),
    }
    if beta:
        batch["ref_per_token_logps"] = -7.0 + 0.3 * torch.randn(N_PROMPTS * G, C, generator=g)
    return batch


def _loss_and_grads(trainer, batch):
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None
    }


def _loss_condition(trainer, batch):
    """First-order change of TRL's loss when every token's log-prob and entropy moves by one unit of
    max(1, |value|) (fp64): sum |dL/dx| max(1, |x|) over both, the loss's condition at fp32 rounding."""
    leaves = []
    real = trainer._get_per_token_logps_and_entropies

    def as_leaves(*a, **k):
        logps, ent, aux = real(*a, **k)
        out = [None if t is None else t.detach().requires_grad_() for t in (logps, ent)]
        leaves.extend(t for t in out if t is not None)
        return out[0], out[1], aux

    trainer._get_per_token_logps_and_entropies = as_leaves
    try:
        loss = trainer._compute_loss(trainer.model, batch)
    finally:
        del trainer._get_per_token_logps_and_entropies
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    valid = batch["completion_mask"].bool()
    return sum(
        (g.abs() * x.detach().abs().clamp(min=1.0))[valid].sum().item()
        for g, x in zip(grads, leaves)
        if g is not None
    )


def _fp64_reference(base_model, tmp_path, kw, batch):
    """TRL's own loss code on an fp64 copy of the model: [(loss, grads)] once per way fp32 rounding may decide
    the top-entropy mask (the tokens within ROUNDING_EPS of its threshold in or out; one entry when none is),
    and the loss's fp32 rounding floor. Every other threshold must be out of rounding's reach (asserted)."""
    exact = _trainer(trl.GRPOTrainer, copy.deepcopy(base_model).double(), tmp_path, **kw)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    valid = batch["completion_mask"].bool()
    with torch.no_grad():
        logps, ent, _ = exact._get_per_token_logps_and_entropies(
            exact.model, ids, mask, C, compute_entropy=True
        )
    _assert_far_from_edges(logps, batch, valid, exact)
    masks = [None]
    if exact.top_entropy_quantile < 1.0:
        thr = torch.quantile(ent[valid], 1 - exact.top_entropy_quantile)
        # both the token's entropy and the threshold (an interpolation of two entropies) carry the rounding
        band = 2 * ROUNDING_EPS * EPS32 * max(1.0, thr.item())
        near = ((ent - thr).abs() <= band) & valid
        flips = near.nonzero().tolist()
        assert len(flips) <= 6, f"{len(flips)} entropies within {band:.2g} of the threshold; pick a seed"
        exact_mask = (ent >= thr) & valid  # TRL's rule, decided in fp64
        masks = []
        for chosen in itertools.product((False, True), repeat=len(flips)):
            m = exact_mask.clone()
            for (r, c), flip in zip(flips, chosen):
                m[r, c] ^= flip
            masks.append(m)
    refs = []
    for m in masks:
        if m is not None:
            exact.get_high_entropy_mask = lambda *a, m=m: m
        refs.append(_loss_and_grads(exact, batch))
    exact.__dict__.pop("get_high_entropy_mask", None)
    floor = ROUNDING_EPS * EPS32 * _loss_condition(exact, batch)
    return refs, floor


def _assert_far_from_edges(logps, batch, valid, exact):
    """The ratio clip edges (and delta, the off-policy KL threshold) are out of fp32 rounding's reach in fp64:
    the clip metrics count tokens past them, a token within rounding of one could count on either side."""
    log_ratio = (logps - batch["old_per_token_logps"].double())[valid]
    edges = [1 - exact.epsilon_low, 1 + exact.epsilon_high] + [exact.args.delta or 1.0]
    band = 2 * ROUNDING_EPS * EPS32 * max(1.0, log_ratio.abs().max().item())
    for e in edges:
        gap = (log_ratio - torch.log(torch.tensor(float(e), dtype=torch.float64))).abs().min().item()
        assert gap > band, f"a log-ratio {gap:.3g} from log({e}); pick a seed"
    if exact.off_policy_mask_threshold is not None:
        m = batch["completion_mask"].double()
        kl = ((batch["old_per_token_logps"].double() - logps) * m).sum(1) / m.sum(1).clamp(min=1.0)
        gap = (kl - exact.off_policy_mask_threshold).abs().min().item()
        assert gap > band, f"a sequence KL {gap:.3g} from the off-policy threshold; pick a seed"


def _assert_within_rounding(loss, grads, ref_loss, ref_grads, refs, floor):
    """Ours within about twice TRL's fp32 error of TRL in fp64 (STYLE.md), each against the reference with
    the decisions of the ambiguous tokens nearest its own loss; the floor is fp32 rounding of the loss."""

    def nearest(x):
        return min(refs, key=lambda r: abs(x.item() - r[0].item()))

    (exact_loss, exact_grads), (trl_loss, trl_grads) = nearest(loss), nearest(ref_loss)
    err, err_trl = abs(loss.item() - exact_loss.item()), abs(ref_loss.item() - trl_loss.item())
    assert err <= 2 * err_trl + floor, (
        f"loss: ours {loss.item():.8g} (fp64 {exact_loss.item():.8g}, err {err:.3g}), "
        f"TRL {ref_loss.item():.8g} (err {err_trl:.3g}), floor {floor:.3g}"
    )
    assert grads.keys() == ref_grads.keys() == exact_grads.keys()
    for name, exact in exact_grads.items():
        scale = exact.abs().max().item()
        e = (grads[name].double() - exact).abs().max().item()
        e_trl = (ref_grads[name].double() - trl_grads[name]).abs().max().item()
        bound = 2 * e_trl + 4 * ROUNDING_EPS * EPS32 * scale
        assert e <= bound, f"{name}: grad max err ours {e:.3g}, TRL {e_trl:.3g}, |grad| {scale:.3g}"


@pytest.fixture(scope="module")
def base_model():
    return AutoModelForCausalLM.from_pretrained(default_task.ASSET_DIR, dtype=torch.float32)


@pytest.mark.parametrize(
    "loss_type,beta,level,extra",
    [
        ("grpo", 0.0, "token", {}),
        ("bnpo", 0.0, "token", {}),
        ("dr_grpo", 0.0, "token", {}),
        ("dapo", 0.0, "token", {}),
        ("dapo", 0.04, "token", {}),
        ("grpo", 0.04, "sequence", {}),
        ("cispo", 0.0, "token", {"epsilon_high": 1.3}),
        ("sapo", 0.04, "token", {}),
        ("luspo", 0.0, "sequence", {}),
        ("vespo", 0.0, "token", {}),
        ("dapo", 0.0, "token", {"delta": 1.5}),
        ("dapo", 0.0, "token", {"off_policy_mask_threshold": 0.2}),
        ("dapo", 0.0, "token", {"top_entropy_quantile": 0.5}),
        ("grpo", 0.0, "token", {"entropy_coef": 0.05, "top_entropy_quantile": 0.6}),
    ],
)
def test_loss_and_gradients_equal_trl(base_model, tmp_path, monkeypatch, loss_type, beta, level, extra):
    kw = {
        "loss_type": loss_type,
        "beta": beta,
        "importance_sampling_level": level,
        "epsilon_high": 0.28,
        **extra,
    }
    theirs = _trainer(trl.GRPOTrainer, copy.deepcopy(base_model), tmp_path, **kw)
    ours = _trainer(integ.GRPOTrainer, copy.deepcopy(base_model), tmp_path, **kw)
    assert ours.fused_fallback_reason is None
    shared_calls = []
    real = integ.shared_prefix_forward
    monkeypatch.setattr(
        integ, "shared_prefix_forward", lambda *a, **k: shared_calls.append(1) or real(*a, **k)
    )

    batch = _batch(base_model, beta)
    ref_loss, ref_grads = _loss_and_grads(theirs, batch)
    loss, grads = _loss_and_grads(ours, batch)

    assert shared_calls, "the shuffled batch of whole groups should take the shared-prefix forward"
    refs, floor = _fp64_reference(base_model, tmp_path, kw, batch)
    _assert_within_rounding(loss, grads, ref_loss, ref_grads, refs, floor)
    logged = set(ours._metrics["train"]) - {"entropy"}  # TRL logs the entropy always, we when computed
    assert logged and logged <= set(theirs._metrics["train"])
    for key in logged:
        mine, ref = ours._metrics["train"][key][-1], theirs._metrics["train"][key][-1]
        assert abs(mine - ref) <= 1e-5 * max(1.0, abs(ref)), (key, mine, ref)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo") and not extra:
        assert theirs._metrics["train"]["clip_ratio/region_mean"][-1] > 0  # clipping is exercised


def test_a_tie_parted_by_rounding_stays_where_exact_arithmetic_puts_it():
    """A group's first completion tokens share their context: equal entropies, which fp32 can part by a few
    ulp with the token's row (issue 44, Intel AVX-512). With the quantile inside the tie, TRL's rule in exact
    arithmetic keeps all of them; a plain >= on the parted values would drop the one rounded down."""
    from grpo_fast.kernels.loss_variants import top_entropy_mask

    tie = torch.tensor(2.0411649)
    parted = tie - 6 * torch.finfo(torch.float32).eps * 2  # six ulp below, as measured between rows here
    ent = torch.tensor([[1.0, 1.5, parted, tie], [tie, tie, 3.0, 3.5]])
    mask = torch.ones_like(ent)
    threshold = torch.quantile(ent.flatten(), 0.4)  # TRL's, for top_entropy_quantile=0.6: inside the tie
    assert parted < threshold <= tie  # the plain rule would drop the parted token
    kept = top_entropy_mask(ent, mask, 0.6)
    assert kept.tolist() == [[0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.0), ("grpo", 0.04)])
def test_bf16_mixed_precision_within_twice_trl_bf16_error(base_model, tmp_path, loss_type, beta):
    """TRL's default bf16=True (autocast on the fp32 model): our fused head runs inside the same autocast
    (bf16 GEMM, fp32 accumulation and log-probs), so the loss and every gradient are within about twice TRL's
    own bf16 error of TRL in fp64 (STYLE.md's rule, tol 1e-2 of the size for bf16), gradients in fp32. Old and
    reference log-probs near the policy's, as in training: ratios ~7 (the _batch default) would multiply the
    decoder's bf16 error in the loss for both."""
    kw = dict(loss_type=loss_type, beta=beta, epsilon_high=0.28)
    exact = _trainer(trl.GRPOTrainer, copy.deepcopy(base_model).double(), tmp_path, **kw)
    theirs = _trainer(trl.GRPOTrainer, copy.deepcopy(base_model), tmp_path, bf16=True, **kw)
    ours = _trainer(integ.GRPOTrainer, copy.deepcopy(base_model), tmp_path, bf16=True, **kw)
    batch = _batch(base_model, beta)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps = exact._get_per_token_logps_and_entropies(exact.model, ids, mask, C, len(ids))[0]
    g = torch.Generator().manual_seed(1)
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        if key in batch:
            batch[key] = (logps + 0.1 * torch.randn(logps.shape, generator=g, dtype=logps.dtype)).float()
    ref_loss, ref_grads = _loss_and_grads(exact, batch)
    results = {}
    for name, t in (("trl", theirs), ("ours", ours)):
        with t.accelerator.autocast():  # the training loop's autocast around compute_loss
            results[name] = _loss_and_grads(t, batch)
    (loss, grads), (trl_loss, trl_grads) = results["ours"], results["trl"]
    tol = 1e-2
    err, err_trl = abs(loss.item() - ref_loss.item()), abs(trl_loss.item() - ref_loss.item())
    assert err <= 2 * err_trl + tol * abs(ref_loss.item()), (err, err_trl)
    for name, ref in ref_grads.items():
        assert grads[name].dtype == torch.float32
        e = (grads[name].double() - ref).abs().max().item()
        e_trl = (trl_grads[name].double() - ref).abs().max().item()
        bound = 2 * e_trl + tol * ref.abs().max().item()
        assert e <= bound, f"{name}: ours {e:.3g}, TRL {e_trl:.3g}"
    assert err_trl > 0  # TRL's run was in bf16: the comparison is not between two fp32 runs


def test_reference_logps_and_entropy_equal_trl(base_model, tmp_path):
    theirs = _trainer(trl.GRPOTrainer, copy.deepcopy(base_model), tmp_path, temperature=0.7)
    ours = _trainer(integ.GRPOTrainer, copy.deepcopy(base_model), tmp_path, temperature=0.7)
    b = _batch(base_model, 0.0)
    ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
    mask = torch.cat([b["prompt_mask"], b["completion_mask"]], 1)
    with torch.no_grad():
        ref = theirs._get_per_token_logps_and_entropies(theirs.model, ids, mask, C, 5, compute_entropy=True)
        got = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, C, 5, compute_entropy=True)
    valid = b["completion_mask"].bool()
    # fp32 log-probs of random tokens reach -20, where an ulp is 2e-6: the bound is relative to their size
    for mine, theirs_ in zip(got[:2], ref[:2]):
        scale = max(1.0, theirs_[valid].abs().max().item())
        assert (mine - theirs_)[valid].abs().max().item() < 1e-5 * scale


def test_unsupported_options_fall_back_to_trl_with_a_warning(base_model, tmp_path):
    # a model whose config scales its logits (Cohere's logit_scale; this Llama's forward ignores it): the
    # fused path, which reads the LM head's weight directly, would not scale them, so TRL's own loss runs
    scaled = copy.deepcopy(base_model)
    scaled.config.logit_scale = 0.5
    theirs = _trainer(trl.GRPOTrainer, copy.deepcopy(scaled), tmp_path)
    with pytest.warns(UserWarning, match=r"scales or soft-caps its logits \(logit_scale\)"):
        ours = _trainer(integ.GRPOTrainer, copy.deepcopy(scaled), tmp_path)
    batch = _batch(base_model, 0.0)
    ref_loss, _ = _loss_and_grads(theirs, batch)
    loss, _ = _loss_and_grads(ours, batch)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item()))


def test_three_training_steps_run(base_model, tmp_path):
    model = copy.deepcopy(base_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = _trainer(integ.GRPOTrainer, model, tmp_path)
    trainer.train()
    assert trainer.state.global_step == 3
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert any((p.detach() - before[n]).abs().max() > 0 for n, p in model.named_parameters())


def test_low_precision_native_rollout_is_corrected(base_model, tmp_path):
    """rollout_dtype="bf16": the native engine's log-probs reach TRL's batch and the loss applies TRL's
    correction (the default sequence_mask), its ratio logged; bad values are named."""
    model = copy.deepcopy(base_model)
    trainer = _trainer(integ.GRPOTrainer, model, tmp_path, {"rollout": "native", "rollout_dtype": "bf16"})
    trainer.train()
    ratios = trainer.state.log_history[-2].get("sampling/importance_sampling_ratio/mean")
    assert trainer.state.global_step == 3 and ratios is not None and 0.5 < ratios < 1.5, (
        trainer.state.log_history
    )
    with pytest.raises(ValueError, match="rollout_dtype must be one of"):
        _trainer(integ.GRPOTrainer, copy.deepcopy(base_model), tmp_path, {"rollout_dtype": "bf16"})


def test_native_rollout_opt_in_generates_what_trl_generates(tmp_path):
    # near-greedy sampling (a temperature so low that the softmax is one-hot): the native engine's completions
    # for TRL's batch (each prompt repeated for its samples) equal TRL's own `model.generate` ones
    model = AutoModelForCausalLM.from_pretrained(default_task.ASSET_DIR)
    trl_gen = _trainer(integ.GRPOTrainer, model, tmp_path, temperature=1e-4)
    native = _trainer(integ.GRPOTrainer, model, tmp_path / "n", {"rollout": "native"}, temperature=1e-4)
    prompts = _grouped_prompts(trl_gen, 3)
    calls = []
    orig = integ.generate_groups
    integ.generate_groups = lambda *a, **k: calls.append(k) or orig(*a, **k)
    try:
        got, _ = native._generate_single_turn(prompts, None, {}, 2)
    finally:
        integ.generate_groups = orig
    ref, _ = trl_gen._generate_single_turn(prompts, None, {}, 2)
    assert calls and calls[0]["share_prefix"] is True and calls[0]["engine"] == "native"
    assert got == ref and len({len(c) for c in got}) >= 1
    # and it trains: two steps through TRL's loop with our generation
    native.train()
    assert native.state.global_step == 3
    with pytest.raises(ValueError, match="rollout must be 'trl'"):
        integ.GRPOTrainer(model=model, reward_funcs=_reward, rollout="vllm")


def _grouped_prompts(trainer, n: int) -> list:
    """The first n training prompts' ids, each twice in a row (TRL's batch for G=2)."""
    rows = default_task.dataset_rows("train")[:n]
    return [
        trainer._tokenizer(r["prompt"], add_special_tokens=False).input_ids for r in rows for _ in range(2)
    ]


def test_native_rollout_with_generation_kwargs_is_trls_generation(tmp_path, monkeypatch):
    """TRL's generation_kwargs (here no_repeat_ngram_size, which the native engine does not implement) are
    not ignored: TRL's own generation runs, with a warning naming them, and samples what TRL samples."""
    model = AutoModelForCausalLM.from_pretrained(default_task.ASSET_DIR)
    kw = dict(temperature=1e-4, generation_kwargs={"no_repeat_ngram_size": 2})
    trl_gen = _trainer(integ.GRPOTrainer, model, tmp_path, **kw)
    native = _trainer(integ.GRPOTrainer, model, tmp_path / "n", {"rollout": "native"}, **kw)
    prompts = _grouped_prompts(native, 2)
    monkeypatch.setattr(integ, "generate_groups", lambda *a, **k: pytest.fail("the native engine ran"))
    with pytest.warns(
        UserWarning, match="TRL's generation runs because of generation_kwargs no_repeat_ngram"
    ):
        got, _ = native._generate_single_turn(prompts, None, {}, 2)
    ref, _ = trl_gen._generate_single_turn(prompts, None, {}, 2)
    assert got == ref
    for c in got:  # the option took effect: no bigram twice
        bigrams = list(zip(c, c[1:]))
        assert len(bigrams) == len(set(bigrams)), c


def test_native_rollout_honours_the_generation_kwargs_it_has(tmp_path, monkeypatch):
    """generation_kwargs override TRL's own sampling options (TRL's transformers path): keys the engine has
    (temperature, repetition_penalty, max_new_tokens, ...) reach it, with no fallback, and near-greedy its
    completions equal TRL's own `model.generate` under the same generation_kwargs; do_sample=False (greedy,
    no sampling log-probs) keeps TRL's generation, named."""
    import warnings

    model = AutoModelForCausalLM.from_pretrained(default_task.ASSET_DIR)
    gen = {
        "temperature": 1e-4,
        "repetition_penalty": 3.0,
        "max_new_tokens": 5,
        "top_k": 40,
        "use_cache": True,
    }
    kw = dict(temperature=1.0, generation_kwargs=gen)  # TRL's own temperature is overridden
    trl_gen = _trainer(integ.GRPOTrainer, model, tmp_path, **kw)
    native = _trainer(integ.GRPOTrainer, model, tmp_path / "n", {"rollout": "native"}, **kw)
    prompts = _grouped_prompts(native, 3)
    calls, orig = [], integ.generate_groups
    monkeypatch.setattr(integ, "generate_groups", lambda *a, **k: calls.append((a, k)) or orig(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to TRL's generation warns
        got, logps = native._generate_single_turn(prompts, None, {}, 2)
    ((args, options),) = calls
    assert args[4] == 5 and options["temperature"] == 1e-4 and options["repetition_penalty"] == 3.0
    assert options["top_k"] == 40 and options["eos_token_id"] == list(trl_gen.eos_token_ids)
    ref, _ = trl_gen._generate_single_turn(prompts, None, {}, 2)
    assert got == ref and max(len(c) for c in got) <= 5 < native.max_completion_length
    assert [len(lp) for lp in logps] == [len(c) for c in got]
    greedy = _trainer(
        integ.GRPOTrainer,
        model,
        tmp_path / "g",
        {"rollout": "native"},
        generation_kwargs={"do_sample": False},
    )
    monkeypatch.setattr(integ, "generate_groups", lambda *a, **k: pytest.fail("the native engine ran"))
    with pytest.warns(UserWarning, match="generation_kwargs do_sample=False"):
        greedy._generate_single_turn(prompts[:2], None, {}, 2)
    # a key set to None: transformers takes the model's generation_config.json or its own default (top_k 50)
    unset = _trainer(
        integ.GRPOTrainer, model, tmp_path / "u", {"rollout": "native"}, generation_kwargs={"top_k": None}
    )
    assert unset._generation_kwargs_reason() == "generation_kwargs top_k set to None (transformers' defaults)"
    # another EOS: TRL's generate stops there, then TRL cuts after the first of its own: either ends it
    other = _trainer(
        integ.GRPOTrainer, model, tmp_path / "e", {"rollout": "native"}, generation_kwargs={"eos_token_id": 5}
    )
    assert other._generation_kwargs_reason() is None
    assert other._native_sampling()["eos_token_id"] == [5, *[e for e in trl_gen.eos_token_ids if e != 5]]


def test_native_rollout_takes_the_repetition_penalty_and_generates_what_trl_generates(tmp_path, monkeypatch):
    """TRL's repetition_penalty reaches the native engine (no fallback): near-greedy (temperature 1e-4, a
    one-hot softmax) its completions equal TRL's own `model.generate` ones under the same penalty, and the
    penalty is real: without it they differ."""
    import warnings

    model = AutoModelForCausalLM.from_pretrained(default_task.ASSET_DIR)
    kw = dict(temperature=1e-4, repetition_penalty=3.0)  # strong enough to act within C = 7 tokens
    trl_gen = _trainer(integ.GRPOTrainer, model, tmp_path, **kw)
    native = _trainer(integ.GRPOTrainer, model, tmp_path / "n", {"rollout": "native"}, **kw)
    plain = _trainer(integ.GRPOTrainer, model, tmp_path / "p", {"rollout": "native"}, temperature=1e-4)
    prompts = _grouped_prompts(native, 3)
    calls, orig = [], integ.generate_groups
    monkeypatch.setattr(integ, "generate_groups", lambda *a, **k: calls.append(k) or orig(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to TRL's generation warns
        got, _ = native._generate_single_turn(prompts, None, {}, 2)
    assert len(calls) == 1 and calls[0]["repetition_penalty"] == 3.0
    ref, _ = trl_gen._generate_single_turn(prompts, None, {}, 2)
    assert got == ref
    unpenalized, _ = plain._generate_single_turn(prompts, None, {}, 2)
    assert unpenalized != got


def test_native_rollout_takes_min_p(tmp_path, monkeypatch):
    """TRL's min_p reaches the native engine (transformers' order: after top-k and top-p), no fallback."""
    import warnings

    model = AutoModelForCausalLM.from_pretrained(default_task.ASSET_DIR)
    native = _trainer(integ.GRPOTrainer, model, tmp_path, {"rollout": "native"}, min_p=0.1)
    prompts = _grouped_prompts(native, 2)
    calls, orig = [], integ.generate_groups
    monkeypatch.setattr(integ, "generate_groups", lambda *a, **k: calls.append(k) or orig(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to TRL's generation warns
        got, _ = native._generate_single_turn(prompts, None, {}, 2)
    assert len(calls) == 1 and calls[0]["min_p"] == 0.1 and len(got) == 4
