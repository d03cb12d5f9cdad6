"""Two gloo processes (DDP and FSDP2) train exactly like one process on the same global batch.

Generation is replaced by fixed completions, a function of the prompt alone, so that the ranks' share of the
global batch equals the single process's: then losses, gradient norms and updated weights must agree. The
reference is the single-process run of the same trainer (its own correctness is tested against naive math
elsewhere); what is tested here is the sharding of prompts, the global advantages and dapo normalizer, the
gradient averaging, and checkpoints that move between world sizes.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow
LR = 1e-3  # AdamW's: the weights are compared in its units

REWARD = """
import os, signal

def spread(completions, **kwargs):
    return [float(len(c) % 7) for c in completions]

def die_on_rank_1(completions, **kwargs):
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0 for _ in completions]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fixed_completions(model, prompt_ids, prompt_mask, G, C, return_logprobs=False, **kwargs):
    """G completions per prompt drawn from a generator seeded by the prompt's tokens: rank-independent; their
    engine log-probs NaN (not scored: the loss treats them as ratio 1)."""
    V = model.config.vocab_size if hasattr(model, "config") else 64
    ids, lens = [], []
    for p, m in zip(prompt_ids.cpu(), prompt_mask.cpu()):
        p = p[m.bool()]  # unpadded: each rank pads its own prompts
        g = torch.Generator().manual_seed(int((p * torch.arange(1, p.numel() + 1)).sum()) % 2**31)
        ids.append(torch.randint(5, V, (G, C), generator=g))
        lens.append(torch.randint(1, C + 1, (G,), generator=g))
    ids, lens = torch.cat(ids), torch.cat(lens)
    mask = (torch.arange(C)[None] < lens[:, None]).long()
    out = (ids * mask).to(prompt_ids.device), mask.to(prompt_ids.device)
    return (*out, torch.full(ids.shape, float("nan"), device=prompt_ids.device)) if return_logprobs else out


def _completion_tokens(groups, P, C):  # a packed micro-batch's cost here: its completions' tokens
    return sum(sum(lens) for _, lens in groups)


def _join(rank, world, port):
    """This spawned process as rank `rank` of a `world`-rank torchrun job on `port`, one thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)


def _worker(rank, world, port, cfg, pack=None):
    _join(rank, world, port)
    import grpo_fast.trainer.evaluate as E
    import grpo_fast.trainer.setup as U
    import grpo_fast.trainer.step as S
    import grpo_fast.trainer.train as T
    from grpo_fast.trainer.batching import Packer
    from grpo_fast.trainer.config import GRPOConfig

    S.generate_groups = E.generate_groups = _fixed_completions  # rollouts and held-out evaluation
    if pack is not None:  # micro-batches packed as under --max-memory-gb, to `pack` completion tokens
        U.plan_memory = lambda cfg, dist, device: (cfg, None, Packer(_completion_tokens, pack))
    T.train(GRPOConfig(**cfg))


def _recording_worker(rank, world, port, cfg, pack=None):
    """A rank that trains on real rollouts and keeps what each of its steps sampled (rollouts-rank<r>.pt)."""
    _join(rank, world, port)
    import grpo_fast.trainer.train as T
    from grpo_fast.trainer.config import GRPOConfig

    made, real = [], T.rollout
    keep = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "model_mask", "sampling_logps")

    def recording(run, rows, generator=None):
        ro = real(run, rows, generator)
        made.append({k: getattr(ro, k) for k in keep})
        return ro

    T.rollout = recording
    T.train(GRPOConfig(**cfg))
    torch.save(made, Path(cfg["output_dir"]) / f"rollouts-rank{rank}.pt")


def _run(tmp: Path, name: str, world: int, kind: str = "ddp", pack=None, worker=_worker, **over) -> Path:
    reward = tmp / "rewards.py"
    reward.write_text(REWARD)
    cfg = dict(
        reward=[f"{reward}:spread"],
        num_generations=4,
        prompts_per_step=4,
        max_completion_length=6,
        learning_rate=LR,
        lr_scheduler_type="constant",
        beta=0.04,  # a reference model, wrapped (and under FSDP sharded) like the policy
        scale_rewards="batch",  # the global batch's std: rewards all-gathered
        max_steps=2,
        eval_max_samples=0,
        save_steps=1,
        save_total_limit=5,
        output_dir=str(tmp / name),
        distributed=kind,
        dist_timeout_s=120.0,
        seed=0,
    )
    cfg.update(over)
    args = (world, _free_port(), cfg, pack)
    mp.start_processes(worker, args=args, nprocs=world, join=True, start_method="spawn")
    return tmp / name


def _metrics(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(ckpt / "model.safetensors")


def _optimizer_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False)["optimizer"]["state"]


# Adam's moments are sums of gradients (and their squares): two runs whose gradients agree to rounding agree
# in them to rounding too, on any CPU (measured 1e-6 of each tensor's largest entry after step 1). Step 2's
# gradients are taken at weights that may already differ by up to 2 lr per element (below; measured 8e-6
# here, 0.015 lr apart), so its metrics and moments get wider bounds. A wrong gradient sync (a missing
# all-reduce, a sum for a mean, which Adam's normalized update would hide in the weights) or a lost optimizer
# state on resume is off by O(1) of that scale.
METRIC_BOUND = {1: 1e-5, 2: 1e-4}
MOMENT_BOUND = {1: 1e-4, 2: 1e-2}


def _assert_same_run(a: Path, b: Path, step: int, steps_to_compare, saved=None):
    ma, mb = {r["step"]: r for r in _metrics(a)}, {r["step"]: r for r in _metrics(b)}
    for s in steps_to_compare:
        for key in ("loss", "grad_norm", "reward_mean", "reward_std", "kl", "clip_ratio"):
            bound = METRIC_BOUND[s] * max(1.0, abs(ma[s][key]))
            assert abs(ma[s][key] - mb[s][key]) <= bound, (s, key, ma[s], mb[s])
    for s in saved or range(1, step + 1):  # the gradients, through the moments of every step's checkpoint
        sa, sb = _optimizer_state(a / f"checkpoint-{s}"), _optimizer_state(b / f"checkpoint-{s}")
        assert sa.keys() == sb.keys()
        for k in sa:
            for moment in ("exp_avg", "exp_avg_sq"):
                x, y = sa[k][moment], sb[k][moment]
                err = ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item()
                assert err <= MOMENT_BOUND[s], f"step {s} {k} {moment}: difference {err:.3g} of its largest"
    # The weights only in units of the learning rate: each AdamW step moves an element by at most ~lr whatever
    # its gradient's size (|m_hat / sqrt(v_hat)| <= 1.001 over two steps), so a gradient at rounding level
    # whose sign differs between the runs (another summation order: thread split, AVX2 / AVX-512 / AMX
    # kernels) moves that element by up to 2 lr a step. Measured here: 0.015 lr.
    wa, wb = _weights(a / f"checkpoint-{step}"), _weights(b / f"checkpoint-{step}")
    assert wa.keys() == wb.keys()
    for k in wa:
        err = (wa[k] - wb[k]).abs().max().item() / LR
        assert err <= 2.01 * step, f"{k}: max weight difference {err:.3g} lr after {step} steps"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    return tmp, _run(tmp, "one", 1)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process(runs, kind):
    tmp, one = runs
    two = _run(tmp, f"two-{kind}", 2, kind)
    _assert_same_run(one, two, 2, steps_to_compare=(1, 2))
    first = _metrics(one)[0]
    assert first["grad_norm"] > 0 and first["loss"] != 0  # the comparison is not between two zeros
    assert _metrics(one)[1]["kl"] > 0  # the policy moved away from the reference: the KL term is live


def test_held_out_evaluation_across_ranks_equals_one_process(tmp_path):
    """Greedy and sampled (--num-generations-eval) held-out figures of two ranks, each evaluating its share
    of 5 prompts (3 and 2), are the single process's: the counts are summed over the ranks, pass@n counted
    per prompt."""
    over = dict(max_steps=1, eval_max_samples=5, num_generations_eval=3, save_steps=0)
    one, two = (_run(tmp_path, f"eval-{w}", w, **over) for w in (1, 2))
    evals = [
        [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval_accuracy" in r]
        for out in (one, two)
    ]
    assert evals[0] == evals[1] and len(evals[0]) == 2
    ev = evals[0][0]
    assert ev["eval_samples"] == 5 and 0 < ev["eval_sampled_accuracy"] < ev["eval_pass_at_n"]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_packed_micro_batches_across_ranks_equal_one_process(runs, kind):
    """Micro-batches packed from each rank's real lengths (as under --max-memory-gb): the ranks' counts differ
    (their completions do), they agree on one (FSDP gathers the weights in each forward), and the run is
    still the single unpacked process's."""
    tmp, one = runs
    two = _run(tmp, f"packed_{kind}", 2, kind, pack=8)
    _assert_same_run(one, two, 2, (1, 2))
    assert all(r["micro_batches"] > 2 for r in _metrics(two))


def test_steps_per_generation_across_ranks_equal_one_process(runs):
    """steps_per_generation 2: one rollout of 8 prompts feeds two optimizer steps of 4. Each rank holds, of
    each step's prompts, its share (not the first or last half of the rollout), so the steps train the
    single process's prompts; packed micro-batches agree on a count per step. One record and one checkpoint
    per rollout (save_steps 1 is passed once, at step 2)."""
    tmp, _ = runs
    spg = dict(steps_per_generation=2, gradient_accumulation_steps=1)
    one, two = _run(tmp, "one-spg", 1, **spg), _run(tmp, "two-spg-ddp", 2, "ddp", pack=8, **spg)
    _assert_same_run(one, two, 2, steps_to_compare=(2,), saved=(2,))
    assert [r["step"] for r in _metrics(one)] == [2] and not (one / "checkpoint-1").exists()
    assert _metrics(one)[0]["grad_norm"] > 0


def test_adaptive_entropy_across_ranks(runs):
    """use_adaptive_entropy on two packed DDP ranks: each optimizer step's entropy is summed with its token
    count over the ranks (a collective every rank reaches, whatever its micro-batch count), so the two ranks
    move the coefficient as one process does: up by the delta while the entropy is under the target, with
    the bonus from the second step on."""
    tmp, _ = runs
    adaptive = dict(
        use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.02, entropy_target=100.0
    )
    one, two = (
        _run(tmp, "one-adaptive", 1, **adaptive),
        _run(tmp, "two-adaptive", 2, "ddp", pack=8, **adaptive),
    )
    for run in (one, two):
        assert [r["entropy_coef"] for r in _metrics(run)] == pytest.approx([0.03, 0.05])
        assert all(r["loss/entropy"] > 0 for r in _metrics(run))
    # the bonus is each rank's mean over its tokens, averaged over the ranks by DDP (TRL's too): near the
    # one process's mean over all tokens, not equal to it, so only the first step (no bonus) compares exactly
    _assert_same_run(one, two, 2, steps_to_compare=(1,), saved=(1,))


def test_synced_reference_sharded_equals_one_process(runs):
    """sync_ref_model under FSDP2: each rank mixes its shard of the reference with its shard of the policy,
    and the checkpoint gathers the reference whole: the run and its saved reference are the one process's."""
    tmp, _ = runs
    sync = dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.6)
    one, two = _run(tmp, "one-synced", 1, **sync), _run(tmp, "two-synced-fsdp", 2, "fsdp", **sync)
    _assert_same_run(one, two, 2, steps_to_compare=(1, 2))
    from safetensors.torch import load_file

    from grpo_fast.tasks import default_task  # the base model both runs start from

    base = load_file(Path(default_task.ASSET_DIR) / "model.safetensors")
    for run in (one, two):  # TR-DPO's update after each step, from the policies each run's checkpoints hold
        ref = load_file(run / "checkpoint-2" / "reference" / "model.safetensors")
        p1, p2 = _weights(run / "checkpoint-1"), _weights(run / "checkpoint-2")
        assert ref.keys() == p2.keys()
        for k in ref:
            want = 0.6 * p2[k].double() + 0.4 * (0.6 * p1[k].double() + 0.4 * base[k].double())
            assert (ref[k].double() - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item()), k


@pytest.mark.parametrize("first_world,then_world,kind", [(2, 1, "fsdp"), (1, 2, "fsdp"), (2, 1, "ddp")])
def test_checkpoints_resume_with_another_world_size(runs, first_world, then_world, kind):
    tmp, one = runs
    name = f"resume-{first_world}-{then_world}-{kind}"
    out = _run(tmp, name, first_world, kind, max_steps=1)
    _run(tmp, name, then_world, kind, max_steps=2, resume=True)
    _assert_same_run(one, out, 2, steps_to_compare=(2,))


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_bf16_weights_keep_fp32_masters_across_ranks(runs, kind):
    """--dtype bf16 (fp32 masters in AdamW16, seeded from the fp32 checkpoint: under FSDP each rank its shard)
    replicated or sharded: two ranks train as one process does and the checkpoint holds the masters whole.
    In bf16 the two runs' gradients differ by bf16 rounding (their GEMMs see other batch shapes), so moments
    agree to 5e-2 of their largest and the masters to AdamW's 2 lr per step (see _assert_same_run)."""
    tmp, _ = runs
    one = tmp / "bf16-one"
    if not (one / "checkpoint-1").is_dir():  # one single-process run for both kinds
        _run(tmp, "bf16-one", 1, dtype="bf16", max_steps=1)
    two = _run(tmp, f"bf16-two-{kind}", 2, kind, dtype="bf16", max_steps=1)
    sa, sb = _optimizer_state(one / "checkpoint-1"), _optimizer_state(two / "checkpoint-1")
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k]["master"].dtype == torch.float32 and sa[k]["master"].shape == sb[k]["master"].shape
        for moment in ("exp_avg", "exp_avg_sq"):
            x, y = sa[k][moment], sb[k][moment]
            err = ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item()
            assert err <= 5e-2, f"{k} {moment}: difference {err:.3g} of its largest"
        err = (sa[k]["master"] - sb[k]["master"]).abs().max().item() / LR
        assert err <= 2.01, f"{k}: masters {err:.3g} lr apart"
    wa, wb = _weights(one / "checkpoint-1"), _weights(two / "checkpoint-1")
    assert all(w.dtype == torch.bfloat16 for w in wb.values())
    for k in wa:  # the saved bf16 weights are the masters' rounding: at most an ulp apart where those differ
        assert (wa[k].float() - wb[k].float()).abs().max().item() <= 2.01 * LR + 2**-8 * wa[k].abs().max()


def test_a_dead_rank_makes_the_other_exit_with_an_error(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARD)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
        env.update(LOCAL_RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "grpo_fast.trainer.train", "--output-dir", str(tmp_path / "run")]
        cmd += ["--reward", f"{tmp_path / 'rewards.py'}:die_on_rank_1", "--max-steps", "3"]
        cmd += ["--eval-max-samples", "0", "--dist-timeout-s", "30", "--prompts-per-step", "4"]
        pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(subprocess.Popen(cmd, env=env, **pipe))
    out0, _ = procs[0].communicate(timeout=240)
    procs[1].wait(timeout=60)
    assert procs[1].returncode == -9
    assert procs[0].returncode not in (0, None), out0[-2000:]
    assert "a collective with the other ranks failed" in out0, out0[-2000:]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_colocated_async_ranks_sample_the_versions_they_report(tmp_path, kind):
    """--max-staleness 1 colocated under torchrun: each rank's generation thread samples its share of the
    prompts from its own whole copy of the weights, which the push after every step refreshes (FSDP2: the
    changed shards gathered). transformers, under each version's checkpoint, reads every rank's samples: the
    engine's log-probs equal those of a version at most 1 step stale (rank 0's: exactly the version its log
    reports), to fp32 rounding, and not those of the next version."""
    from types import SimpleNamespace

    from versions import logprob_error, version_model

    from grpo_fast.tasks import default_task

    steps, G, T_ = 4, 4, 3.0
    out = _run(
        tmp_path, f"async-{kind}", 2, kind, worker=_recording_worker, max_steps=steps, max_staleness=1,
        learning_rate=3e-3, temperature=T_, beta=0.0, scale_rewards="group", max_completion_length=10,
    )  # fmt: skip
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all("loss/is_ratio_mean" in r for r in records)  # corrected
    staleness = [r["async/staleness"] for r in records]  # rank 0's
    assert set(staleness) <= {0, 1} and 1 in staleness, staleness
    models = {v: version_model(default_task.ASSET_DIR, out, v) for v in range(steps)}
    for rank in range(2):
        made = torch.load(out / f"rollouts-rank{rank}.pt")
        assert len(made) == steps
        for step, fields in enumerate(made, start=1):
            ro, rows = SimpleNamespace(**fields), range(fields["completion_ids"].shape[0])
            fresh = [v for v in (step - 2, step - 1) if v >= 0]  # at most 1 step stale
            errors = {v: max(logprob_error(models[v], ro, r, G, T_) for r in rows) for v in fresh}
            version = min(errors, key=errors.get)
            assert errors[version] < 1e-4, (rank, step, errors)
            if rank == 0:
                assert version == step - 1 - staleness[step - 1], (step, errors, staleness)
            if version + 1 < steps:  # the check tells versions apart
                assert max(logprob_error(models[version + 1], ro, r, G, T_) for r in rows) > 1e-2


def test_multi_turn_ranks_under_ddp_sample_the_versions_they_report(tmp_path):
    """--tools under torchrun (DDP, colocated, synchronous): each rank runs its own prompts' trajectories,
    which take different numbers of turns and tokens on each rank (DDP's no-grad forwards are rank-local;
    FSDP2 is refused at start). transformers, under each step's checkpoint, reads every rank's samples: every
    model-written token's engine log-prob equals that of the version before the step, to fp32 rounding, and
    not the next version's; the tool ran and its turns are out of the loss."""
    from types import SimpleNamespace

    from versions import logprob_error, version_model

    from grpo_fast.tasks import tools_task
    from grpo_fast.trainer.config import TOOLS_TASK_PRESET

    steps, G, T_ = 3, 4, 1.5
    preset = {k: TOOLS_TASK_PRESET[k] for k in ("tools", "max_tool_calling_iterations", "max_prompt_length")}
    out = _run(
        tmp_path, "tools-ddp", 2, "ddp", worker=_recording_worker, max_steps=steps, task="shop-tools",
        learning_rate=3e-3, temperature=T_, beta=0.0, scale_rewards="group", max_completion_length=48,
        **preset,
    )  # fmt: skip
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert sum(r["tools/call_frequency"] for r in records) > 0
    models = {v: version_model(tools_task.ASSET_DIR, out, v) for v in range(steps)}
    tool_tokens = 0
    for rank in range(2):
        made = torch.load(out / f"rollouts-rank{rank}.pt")
        assert len(made) == steps
        for step, fields in enumerate(made, start=1):
            ro, rows = SimpleNamespace(**fields), range(fields["completion_ids"].shape[0])
            tool_tokens += int((ro.completion_mask * (1 - ro.model_mask)).sum())
            assert max(logprob_error(models[step - 1], ro, r, G, T_) for r in rows) < 1e-4, (rank, step)
            if step < steps:
                assert max(logprob_error(models[step], ro, r, G, T_) for r in rows) > 1e-2, (rank, step)
    assert tool_tokens > 0


def test_multi_turn_under_fsdp_is_refused_with_its_reason():
    from grpo_fast.trainer.config import GRPOConfig
    from grpo_fast.trainer.distributed import DistInfo
    from grpo_fast.trainer.setup import check_distributed

    cfg = GRPOConfig(task="shop-tools", tools=["tools.py:x"], prompts_per_step=4)
    with pytest.raises(ValueError, match="--distributed fsdp: FSDP2 gathers the shards in every forward"):
        check_distributed(cfg, DistInfo(rank=0, world=2, local_rank=0, kind="fsdp"))
    check_distributed(cfg, DistInfo(rank=0, world=2, local_rank=0, kind="ddp"))
