"""LoRA adapters pushed alone to vLLM servers, against the stand-in server (tests/fake_vllm.py, which merges
the adapter it is sent from the files on its own, W + alpha / r B A, in the server's dtype);
tests/test_vllm_server.py checks the same on a real vLLM server. The base goes once, then only the adapter,
under a new name each time, the old one unloaded; what the server answers through the adapter equals the
trainer's PEFT model after every step; a transport that serves a stale adapter is caught; what a plain
adapter cannot carry, or a server not set up for adapters, falls back to merged pushes and says why; a
server set up for too small a rank is an error; and `grpo-fast train --lora-r` samples the versions it
reports, synchronously and with --max-staleness 1."""

import pytest
import torch
from fake_vllm import FakeServer
from test_server_engine import MODEL, _fake_of, _register_fakes, policy  # noqa: F401 (the fixture)

from grpo_fast.rollout.lora_adapters import ADAPTER
from grpo_fast.rollout.server import ServerEngine, ServerError

peft = pytest.importorskip("peft")


def lora_policy(r=8, **options):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=16, target_modules="all-linear", **options)
    return get_peft_model(policy(), config)


def train_adapter(model, seed, scale=0.05):
    """An optimizer step's worth of change to every adapter tensor (B starts at zero: it moves off it)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * scale)


def peft_logprobs(model, ids) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from the PEFT model's own forward, in fp64."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]


def adapter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.25)])
def test_the_adapter_travels_alone_and_the_server_answers_as_the_trainers_lora_model(dtype, tol):
    model = lora_policy().eval()
    ids = torch.randint(model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    with FakeServer(policy(), dtype, lora_rank=8) as url:
        fake = _fake_of(url)
        engine = ServerEngine(model, [url], auto_push=False)
        assert engine.stats["push"] == "adapter"
        engine.push(model, 0)  # the base (every weight) and the adapter
        size = 2 if dtype == "bfloat16" else 4
        base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
        head = model.config.vocab_size * model.config.hidden_size  # tied here, untied on the server
        assert engine.stats["sync_bytes"] == (base + head) * size + adapter_bytes(model) // 4 * size
        served = []
        for step in (1, 2, 3):
            train_adapter(model, step)
            adapter = [n for n in engine.weights(model) if n.startswith(ADAPTER)]
            assert engine.push(model, step) == len(adapter)
            assert engine.stats["sync_bytes"] == adapter_bytes(model) // 4 * size  # the adapter, nothing else
            name = engine.served_name(engine.servers[0])
            served.append(name)
            assert list(fake.adapters) == [name]  # the new version loaded, the last one unloaded
            theirs = engine.server_logprobs(engine.servers[0], ids, "test")
            err = float((theirs - peft_logprobs(model, ids)).abs().max())
            base = engine.server_logprobs(engine.servers[0], ids, "t", model="fake")
            moved = float((theirs - base).abs().max())
            assert err < tol and moved > 10 * err, (step, err, moved)
        assert len(set(served)) == 3  # a new name every version
        # generation names the adapter: its samples' log-probs are the adapted model's
        out = engine.generate(model, torch.tensor([ids[:6]]), torch.ones(1, 6, dtype=torch.long), 2, 5,
                              eos_token_id=1, return_logprobs=True)  # fmt: skip
        done, logps = out[0], out[-1]
        for r in range(2):
            full = ids[:6] + done[r].tolist()
            mine = peft_logprobs(model, full)[5 : 5 + done.shape[1]]
            assert float((logps[r].double() - mine).abs().max()) < max(tol, 1e-4) * 10


@pytest.mark.parametrize("scale,why", [(1e-6, "changed nothing there"), (0.05, "do not equal")])
def test_an_adapter_transport_that_serves_a_stale_adapter_is_caught(scale, why):
    """The new name loads but answers with the previous adapter: a step within the probe's tolerance is
    caught by the exact check (the same bits as before), a large one by the tolerance."""
    model = lora_policy().eval()
    with FakeServer(policy(), lora_rank=8) as url:
        engine = ServerEngine(model, [url], auto_push=False)
        engine.push(model, 0)
        train_adapter(model, 1)
        engine.push(model, 1)
        _fake_of(url).noop_adapter = True
        train_adapter(model, 2, scale)
        with pytest.raises(ServerError, match=f"weight push at step 2 not verified.*{why}"):
            engine.push(model, 2)


def test_an_adapter_unloaded_under_the_run_is_caught_before_its_samples_are_used():
    model = lora_policy().eval()
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    with FakeServer(policy(), lora_rank=8) as url:
        engine = ServerEngine(model, [url], auto_push=False)
        engine.push(model, 0)
        engine.generate(model, ids, mask, 2, 4, eos_token_id=1)
        fake = _fake_of(url)
        name = engine.served_name(engine.servers[0])
        fake.adapters[name] = ("/elsewhere", fake.model)  # another client reloaded that name elsewhere
        with pytest.raises(ServerError, match="adapter .* gone or was replaced"):
            engine.generate(model, ids, mask, 2, 4, eos_token_id=1)


def test_a_new_owner_unloads_the_adapters_a_dead_run_left():
    model = lora_policy().eval()
    with FakeServer(policy(), lora_rank=8) as url:
        first = ServerEngine(model, [url], auto_push=False, run="run A")
        first.push(model, 0)
        first.release()
        ServerEngine(model, [url], auto_push=False, run="run B")
        assert _fake_of(url).adapters == {}


def test_failed_unloads_are_retried_counted_and_warned_until_the_server_holds_what_is_allowed(capsys):
    """The server refuses the first 5 unload calls: each push retries the unloads still owed; the engine
    counts every failed call (`failed_unloads`), reports the adapters the server holds (`adapters_loaded`,
    read from the server's model list) and warns, naming the server, once they exceed what is allowed; when
    unloads work again, the server ends with the allowed one adapter, the current version."""
    model = lora_policy().eval()
    with FakeServer(policy(), lora_rank=8) as url:
        fake = _fake_of(url)
        engine = ServerEngine(model, [url], auto_push=False, adapters_allowed=1)
        engine.push(model, 0)
        fake.fail["/v1/unload_lora_adapter"] = 500
        step, held = 0, []
        while fake.calls.count("/v1/unload_lora_adapter") < 5:
            step += 1
            train_adapter(model, step)
            engine.push(model, step)
            held.append((len(fake.adapters), engine.stats["adapters_loaded"]))
        assert engine.stats["failed_unloads"] == fake.calls.count("/v1/unload_lora_adapter") == 5
        assert all(mine == theirs for theirs, mine in held) and held[-1][0] == step + 1, held
        warned = capsys.readouterr().out
        assert f"vLLM server {url} holds 2 LoRA adapters" in warned and f"holds {step + 1} LoRA" in warned
        del fake.fail["/v1/unload_lora_adapter"]
        for more in (1, 2):
            train_adapter(model, step + more)
            engine.push(model, step + more)
            assert list(fake.adapters) == [engine.served_name(engine.servers[0])]
            assert engine.stats["adapters_loaded"] == 1 and engine.stats["failed_unloads"] == 5
        assert "LoRA adapters" not in capsys.readouterr().out  # nothing more to say


@pytest.mark.parametrize(
    "server_rank,options,reason",
    [
        (0, {}, "started without LoRA .*--lora-rank 8"),
        (8, {"use_dora": True}, "DoRA"),
        (8, {"target_modules": ["q_proj", "lm_head"]}, "LM head or the embeddings"),
        (8, {"bias": "lora_only"}, "trains biases"),
    ],
    ids=["no-lora-server", "dora", "lm-head", "bias"],
)
def test_what_cannot_travel_as_an_adapter_is_pushed_merged_and_says_why(server_rank, options, reason, capsys):
    from peft import LoraConfig, get_peft_model

    config = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", **options}
    model = get_peft_model(policy(), LoraConfig(**config)).eval()
    ids = torch.randint(model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    with FakeServer(policy(), lora_rank=server_rank) as url:
        engine = ServerEngine(model, [url], auto_push=False)
        assert engine.stats["push"] == "merged"
        assert "LoRA pushed merged" in capsys.readouterr().out
        engine.push(model, 0)
        train_adapter(model, 1)
        engine.push(model, 1)
        assert _fake_of(url).adapters == {}
        theirs = engine.server_logprobs(engine.servers[0], ids, "test")
        assert float((theirs - peft_logprobs(model, ids)).abs().max()) < 1e-4
    import re

    assert re.search(reason, capsys.readouterr().out + str(engine_reason(model, server_rank)))


def engine_reason(model, server_rank):
    from grpo_fast.rollout import lora_adapters

    config = lora_adapters.lora_config(model)
    info = {"lora": {"max_lora_rank": server_rank, "max_loras": 2} if server_rank else None,
            "runtime_lora_updating": True}  # fmt: skip
    return lora_adapters.unservable(config) or lora_adapters.server_refusal(info, "u", config)


def test_a_server_set_up_for_too_small_a_rank_is_an_error():
    model = lora_policy(r=16)
    with FakeServer(policy(), lora_rank=8) as url:
        with pytest.raises(ValueError, match="lora_r=16.*--max-lora-rank 16"):
            ServerEngine(model, [url])


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_lora_training_on_a_server_samples_the_version_it_reports(tmp_path, monkeypatch, async_):
    """`grpo-fast train --lora-r 8` on a server that takes adapters: every push after the first carries the
    adapter alone, and transformers (PEFT merging each step's saved adapter) gives the engine's log-probs of
    every sample under the version the step reports, and not the next one."""
    from transformers import AutoModelForCausalLM
    from versions import assert_sampled_by, train_recording, version_argv

    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    G, steps, T_ = 4, 3, 1.5  # the shop model is near-greedy at T = 1: groups of one completion
    with FakeServer(base, max_model_len=64, lora_rank=8) as url:
        records, made = train_recording(monkeypatch, version_argv(tmp_path, G, steps, T_) + [
            "--rollout", "vllm", "--vllm-mode", "server", "--vllm-server-base-url", url, "--vllm-weight-dir",
            str(tmp_path), "--max-completion-length", "8", "--lora-r", "8", "--lora-alpha", "16",
            "--learning-rate", "3e-2", "--max-staleness", "1" if async_ else "0",
        ])  # fmt: skip
        assert len(_fake_of(url).adapters) == 1
    assert [(r["vllm/adapters_loaded"], r["vllm/failed_unloads"]) for r in records] == [(1, 0)] * steps
    pushed = [r["sync/bytes"] for r in records if r.get("sync/bytes")]
    assert pushed and max(pushed) < 2**20, pushed  # an adapter's bytes (the whole model is ~1.3 MB in fp32)
    staleness = [r.get("async/staleness", 0) for r in records]
    versions = [step - 1 - st for step, st in enumerate(staleness, start=1)]
    assert_sampled_by(made, versions, MODEL, tmp_path / "run", G, T_, same=1e-4)


def test_torchrun_ranks_push_the_adapter(tmp_path, kind="ddp"):
    """Two gloo ranks (DDP: FSDP2 with LoRA is refused at start) train --lora-r 8 against one server with
    --max-staleness 1: each push after the first carries the adapter alone (rank 0 writes it, every rank
    agrees on the verdict), and at the end the server's adapter answers as PEFT's merge of the final
    checkpoint does."""
    import json
    import os
    import subprocess
    import sys

    from peft import PeftModel
    from test_server_engine import free_port

    out, reward = tmp_path / "run", tmp_path / "rewards.py"
    reward.write_text(
        "def spread(completions, completion_ids, **kw):\n"
        "    return [float(sum(t * (k + 1) for k, t in enumerate(ids)) % 7) for ids in completion_ids]\n"
    )
    model = lora_policy()
    with FakeServer(policy(), lora_rank=8) as url:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "grpo_fast.train", "--distributed", kind, "--output-dir", str(out),
               "--rollout", "vllm", "--vllm-mode", "server", "--vllm-server-base-url", url,
               "--vllm-weight-dir", str(tmp_path), "--lora-r", "8", "--lora-alpha", "16", "--temperature",
               "1.5", "--max-staleness", "1", "--max-steps", "3", "--save-steps", "3", "--eval-max-samples",
               "0", "--time-budget-s", "0", "--learning-rate", "3e-2", "--max-completion-length", "8",
               "--dist-timeout-s", "120", "--reward", f"{reward}:spread", "--prompts-per-step", "4",
               "--num-generations", "4"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        fake = _fake_of(url)
        (name,) = fake.adapters
        # every rank's requests named the adapter version of the last push (rank 0 loads it, all use it)
        named = fake.sampled_from
        assert named and all(m.startswith("grpo-fast-") for m in named), named
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(model.config.vocab_size, (40,), generator=g).tolist()
        theirs = fake.served(name)(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    pushes = [r["sync/bytes"] for r in records if r.get("sync/bytes")]
    assert pushes and set(pushes) == {adapter_bytes(model)}, pushes
    trained = PeftModel.from_pretrained(policy(), out / "checkpoint-3").merge_and_unload().eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        mine = trained(input_ids=x).logits[0, :-1].double()
    gather = x[0, 1:, None]
    err = (theirs.log_softmax(-1).gather(-1, gather) - mine.log_softmax(-1).gather(-1, gather)).abs().max()
    moved = (mine.log_softmax(-1).gather(-1, gather) - peft_logprobs(model, ids)[:, None]).abs().max()
    assert err < 1e-4 < moved, (err, moved)
