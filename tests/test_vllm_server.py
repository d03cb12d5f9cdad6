"""Server mode against a real vLLM server on this CPU (`grpo-fast serve`'s launcher, stock vLLM's OpenAI
server, the embedded default model): weight pushes checked against the trainer's own forward (log-probs of a
random sequence that is not the probe, computed in the test), a push that moves nothing refused, changed
layers only, the sampled tokens' log-probs against the trainer's forward, and the faults: unreachable, wrong
model, a request past its time-out, the server killed during generation and during a push, and `--resume`
once it is back. Runs where vLLM is installed (`make test` runs it in .venv-vllm)."""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from server_runs import server_trainer, trained_steps
from tiny_models import eos_likely_lm

from grpo_fast.rollout.server import ServerEngine, ServerError, serve

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "grpo_fast" / "tasks" / "assets" / "shop-base"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    with serve.launch(str(MODEL), port=free_port(), python=sys.executable, max_model_len=64, log=log) as url:
        yield url


def policy():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def trainer_logprobs(model, ids) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from the HF forward, in fp64."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]


def random_ids(model, n=40, seed=7):
    return torch.randint(
        model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def perturb(module, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_push_is_seen_by_the_server_and_a_noop_transport_fails(server):
    model = policy()
    engine = ServerEngine(model, [server])
    assert engine.push(model, 0) == len(engine.versions) > 0  # the first push: everything
    ids = random_ids(model)
    s = engine.servers[0]
    assert (engine.server_logprobs(s, ids, "test") - trainer_logprobs(model, ids)).abs().max() < 1e-3
    perturb(model)
    engine.push(model, 1)
    theirs, mine = engine.server_logprobs(s, ids, "test"), trainer_logprobs(model, ids)
    assert (theirs - mine).abs().max() < 1e-3
    # a transport that does nothing: the server keeps the old weights, the check says so
    perturb(model, seed=1)
    engine._load = lambda server, path, at: None
    with pytest.raises(ServerError, match="not verified"):
        engine.push(model, 2)


def test_only_changed_layers_travel(server):
    model = policy()
    engine = ServerEngine(model, [server])
    engine.push(model, 0)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(1.5)
    assert engine.push(model, 1) == 3  # q, k, v: vLLM loads them as one layer
    want = sum(p.numel() * 4 for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
    assert engine.stats["sync_bytes"] == want
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(0.5)
    assert engine.push(model, 2) == 1
    assert engine.push(model, 3) == 0  # nothing changed: nothing sent
    ids = random_ids(model, seed=3)
    assert (
        engine.server_logprobs(engine.servers[0], ids, "t") - trainer_logprobs(model, ids)
    ).abs().max() < 1e-3


def test_samples_and_their_logprobs_match_the_trainer(server):
    model = policy()
    perturb(model, scale=0.02, seed=5)  # not the weights the server started from
    engine = ServerEngine(model, [server])
    ids = torch.tensor([[0, 0, 5, 9, 14], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    eos = 2
    c_ids, c_mask, c_logp = engine.generate(
        model,
        ids,
        mask,
        4,
        12,
        temperature=1.0,
        eos_token_id=eos,
        generator=torch.Generator(),
        return_logprobs=True,
    )
    assert c_ids.shape[0] == 8 and c_ids.shape[1] <= 12
    for r in range(8):
        k = int(c_mask[r].sum())
        row = c_ids[r, :k].tolist()
        assert eos not in row[:-1] and (k == 12 or row[-1] == eos)  # EOS kept, nothing after it
        assert bool((c_mask[r, k:] == 0).all())
        prompt = ids[r // 4][mask[r // 4].bool()].tolist()
        mine = trainer_logprobs(model, prompt + row)[len(prompt) - 1 :]
        assert (c_logp[r, :k].double() - mine).abs().max() < 1e-3
    # servers report processed log-probs (any temperature): after min-p they are renormalized, so a request
    # that wants them is refused before it is sent, as with top-p / top-k
    with pytest.raises(ValueError, match="min_p=0.05"):
        engine.generate(model, ids, mask, 4, 12, temperature=1.0, min_p=0.05, return_logprobs=True)


def test_wrong_model_refused(server):
    other = eos_likely_lm("llama", 97, 1, 0, head_dim=32)
    with pytest.raises(ServerError, match="another model"):
        ServerEngine(other, [server])


def test_unreachable_url_fails_within_its_timeout():
    model = policy()
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="did not answer /health within vllm_server_timeout=2s"):
        ServerEngine(model, [url], wait_s=2)
    assert time.monotonic() - t0 < 15


def test_request_past_its_timeout(server):
    model = policy()
    engine = ServerEngine(model, [server], timeout=0.001, auto_push=False)  # generation's time-out
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="timed out"):
        engine.generate(model, ids, mask, 4, 12, eos_token_id=2)
    assert time.monotonic() - t0 < 10


def gone(pgid, wait_s=20.0) -> bool:
    """Whether no process of the group `pgid` is left (killed children are reaped by init a moment later)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _train(out, url, *more):
    return server_trainer(out, url, ["--max-staleness", "1", "--max-steps", "8", "--save-steps", "2",
                                     "--eval-steps", "0", "--time-budget-s", "0", "--vllm-request-timeout-s",
                                     "20", "--vllm-server-timeout", "20", *more])  # fmt: skip


_steps = trained_steps


def test_server_killed_mid_run_then_resume(tmp_path):
    """The server dies while the trainer runs: a clear error within the time-out, the last completed step
    saved, nothing of ours left; with the server back, --resume trains every remaining step once."""
    port, out = free_port(), tmp_path / "run"
    log = open(tmp_path / "server.log", "w")
    with serve.launch(str(MODEL), port=port, python=sys.executable, max_model_len=64, log=log) as url:
        trainer = _train(out, url, "--overwrite-output-dir")
        deadline = time.monotonic() + 120
        while len(_steps(out)) < 3 and time.monotonic() < deadline and trainer.poll() is None:
            time.sleep(0.05)
        assert len(_steps(out)) >= 3, trainer.stdout.read()
        pgid = os.getpgid(
            int(subprocess.check_output(["pgrep", "-f", "--", f"--port {port}"], text=True).split()[0])
        )
        os.killpg(pgid, signal.SIGKILL)  # the server and its engine, mid-run
        t0 = time.monotonic()
        text, _ = trainer.communicate(timeout=90)
        assert time.monotonic() - t0 < 60
    assert trainer.returncode != 0
    assert "vLLM server" in text and "run again with --resume" in text, text
    stopped = int(text.split("stopped at step ")[1].split(":")[0])
    ckpt = out / f"checkpoint-{stopped}"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "trainer_state.json").is_file(), list(
        ckpt.iterdir()
    )
    assert gone(pgid)  # nothing of the server left
    assert not list(Path("/dev/shm").glob(f"grpo-fast-weights-{socket.gethostname()}-{trainer.pid}-*"))
    # the server is back: the run continues from the saved step, each remaining step once
    with serve.launch(str(MODEL), port=port, python=sys.executable, max_model_len=64, log=log) as url:
        resumed = _train(out, url, "--resume")
        text, _ = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, text
        assert _steps(out) == list(range(1, 9)), _steps(out)
        # a push to a server that is gone: the error names the server and the step
        model = policy()
        engine = ServerEngine(model, [url])
        engine.push(model, 0)
        pgid = os.getpgid(
            int(subprocess.check_output(["pgrep", "-f", "--", f"--port {port}"], text=True).split()[0])
        )
        os.killpg(pgid, signal.SIGKILL)
        perturb(model)
        with pytest.raises(ServerError, match=f"vLLM server {url}: pause before the weight push at step 1"):
            engine.push(model, 1)


def test_tokenizer_checked(server):
    from transformers import AutoTokenizer

    model = policy()
    ServerEngine(model, [server], tokenizer=AutoTokenizer.from_pretrained(MODEL))  # the same: accepted
    swapped = _shifted(AutoTokenizer.from_pretrained(MODEL))
    with pytest.raises(ServerError, match="tokenizes differently"):
        ServerEngine(model, [server], tokenizer=swapped)


def _shifted(tok):
    """A tokenizer that maps every text to other ids than `tok` does (ids shifted by one)."""

    class Shifted:
        all_special_ids = tok.all_special_ids

        def __len__(self):
            return len(tok)

        def decode(self, ids, **kw):
            return tok.decode(ids, **kw)

        def convert_ids_to_tokens(self, ids):
            return tok.convert_ids_to_tokens(ids)

        def __call__(self, text, add_special_tokens=False):
            ids = tok(text, add_special_tokens=add_special_tokens)["input_ids"]
            return {"input_ids": [i + 1 for i in ids]}

    return Shifted()


def test_several_servers_route_and_survive_one_failure(server):
    """Two entries (the same server twice): prompts go to both; when one fails its requests are retried on the
    other, the failed one is left out of later generations and pushes."""
    model = policy()
    engine = ServerEngine(model, [server, server + "/"])
    engine.push(model, 0)
    first, second = engine.servers
    seen = []
    real_call = second.call

    def failing(path, payload=None, **kw):
        if path == "/v1/completions":
            seen.append(path)
            raise ServerError(f"vLLM server {second.url}: generation failed: connection reset")
        return real_call(path, payload, **kw)

    second.call = failing
    ids, mask = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]]), torch.ones(3, 3, dtype=torch.long)
    c_ids, c_mask = engine.generate(model, ids, mask, 2, 6, eos_token_id=2)
    assert c_ids.shape[0] == 6 and bool((c_mask.sum(1) > 0).all())
    assert seen and not second.alive and engine.stats["failed_servers"] == 1
    perturb(model)
    engine.push(model, 1)  # only the live server: the failed one is not asked
    assert engine.alive == [first]


def test_a_push_within_tolerance_that_changes_nothing_is_caught(server):
    """The probe moves by ~1.2e-3: under the fp32 tolerance (2e-3) yet far above the noise; a transport that
    does nothing fails on the movement check, a real push of the same change passes."""
    model = policy()
    engine = ServerEngine(model, [server])
    engine.push(model, 0)
    ids = engine.probe_ids(model.config.vocab_size)
    w = model.model.layers[0].mlp.down_proj.weight
    direction = torch.randn(w.shape, generator=torch.Generator().manual_seed(3))

    def nudge():
        before = trainer_logprobs(model, ids)
        with torch.no_grad():
            w.add_(direction * 1e-3)
        d = float((trainer_logprobs(model, ids) - before).abs().max())
        with torch.no_grad():
            w.add_(direction * 1e-3 * (1.2e-3 / d - 1))  # log-probs are linear in so small a change
        return float((trainer_logprobs(model, ids) - before).abs().max())

    moved = nudge()
    assert 16 * max(engine.noise, 2e-5) < moved < 2e-3, (moved, engine.noise)
    engine.push(model, 1)  # a real push of it: verified
    moved = nudge()
    assert 16 * max(engine.noise, 2e-5) < moved < 2e-3, (moved, engine.noise)
    engine._load = lambda *args: None
    with pytest.raises(ServerError, match="the push changed nothing there"):
        engine.push(model, 2)


def test_torchrun_ranks_share_the_server(server, tmp_path, kind="fsdp"):
    """Two gloo ranks train against one server asynchronously, each generating its share of the prompts
    there; the push is gathered whole from FSDP2's shards (the harder case: DDP's replica is whole already;
    `kind="ddp"` passes too, left out of the suite for time) and verified every step. At the end the server
    holds the trained weights: its log-probs of a random sequence equal those of the final checkpoint,
    computed here by transformers, and differ from the starting weights'."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    ServerEngine(policy(), [server]).release()  # this test process's earlier engines give the server up
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "grpo_fast.train", "--distributed", kind, "--output-dir", str(out),
           "--rollout", "vllm", "--vllm-mode", "server", "--vllm-server-base-url", server,
           "--max-staleness", "1", "--max-steps", "3", "--save-steps", "3", "--eval-max-samples", "0",
           "--time-budget-s", "0", "--learning-rate", "1e-4", "--dist-timeout-s", "120"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    pushes = [r for r in records if "sync/bytes" in r]
    assert [r["step"] for r in pushes] == [1, 2, 3]
    assert all(r["sync/bytes"] > 0 and r["sync/probe_error"] < 2e-3 for r in pushes), pushes
    assert all(r["async/staleness"] <= 1 for r in pushes)
    base, trained = policy(), policy()
    state = load_file(out / "checkpoint-3" / "model.safetensors")
    missing, unexpected = trained.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    engine = ServerEngine(trained, [server])  # connects and checks; pushes nothing
    ids = random_ids(trained, seed=11)
    theirs = engine.server_logprobs(engine.servers[0], ids, "test")
    assert (theirs - trainer_logprobs(trained, ids)).abs().max() < 1e-3
    moved = (trainer_logprobs(trained, ids) - trainer_logprobs(base, ids)).abs().max()
    print(f"{kind}: the final weights moved the sequence's log-probs by {moved:.3g}")
    assert moved > 1e-2


def _server_group(url) -> int:
    port = url.rsplit(":", 1)[1]
    return os.getpgid(
        int(subprocess.check_output(["pgrep", "-f", "--", f"--port {port}"], text=True).split()[0])
    )


def test_a_second_trainer_is_refused_and_sigterm_on_a_hung_server_stops_within_seconds(server, tmp_path):
    """Two trainers against one server: the second is refused, naming both runs, and the first goes on. Then
    the server hangs (SIGSTOP) while the first waits on it: SIGTERM stops it within 10 s with its last step
    saved and no weight file left; with the server back, --resume trains every remaining step once."""
    ServerEngine(policy(), [server]).release()
    first, second = tmp_path / "first", tmp_path / "second"
    more = ["--max-steps", "30", "--save-steps", "0", "--vllm-request-timeout-s", "120"]  # hangs: no time-out
    trainer = _train(first, server, "--overwrite-output-dir", *more)
    deadline = time.monotonic() + 120
    while len(_steps(first)) < 2 and time.monotonic() < deadline and trainer.poll() is None:
        time.sleep(0.05)
    assert len(_steps(first)) >= 2, trainer.communicate()[0][-3000:]
    other = _train(second, server, "--overwrite-output-dir")
    text, _ = other.communicate(timeout=120)
    assert other.returncode != 0 and "serves another run" in text and str(first) in text, text[-3000:]
    assert "before training a step" in text and not list(second.glob("checkpoint-*"))
    assert trainer.poll() is None  # the first run goes on
    pgid = _server_group(server)
    os.killpg(pgid, signal.SIGSTOP)  # the server hangs: every request waits
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        trainer.send_signal(signal.SIGTERM)
        text, _ = trainer.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        os.killpg(pgid, signal.SIGCONT)
    print(f"SIGTERM on a hung server: exit in {took:.1f}s")
    assert trainer.returncode == 130 and took < 10, (took, text[-3000:])
    done = _steps(first)
    assert (
        json.loads((first / f"checkpoint-{done[-1]}" / "trainer_state.json").read_text())["step"] == done[-1]
    )
    assert not list(Path("/dev/shm").glob(f"grpo-fast-weights-{socket.gethostname()}-{trainer.pid}-*"))
    resumed = _train(first, server, "--resume", *more)
    text, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, text[-3000:]
    assert _steps(first) == list(range(1, 31)), _steps(first)


def nudge(model, scale, seed):
    """Every weight moved by `scale` of its own size (a relative step, as an optimizer's)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean())


def test_bf16_server_noop_transport_caught_within_3_pushes(tmp_path):
    """A bf16 server: small steps (the probe moves ~1e-3 a push, under the first push's noise) and large ones
    are verified when pushed for real; a transport that loads nothing fails by the third push."""
    log = open(tmp_path / "server.log", "w")
    with serve.launch(str(MODEL), port=free_port(), python=sys.executable, max_model_len=64, log=log,
                      dtype="bfloat16") as url:  # fmt: skip
        for scale in (1e-4, 1e-2):
            model = policy()
            engine = ServerEngine(model, [url])
            engine.push(model, 0)
            for k in range(1, 4):
                nudge(model, scale, seed=k)
                engine.push(model, k)
            moved = engine.stats["probe_moved"]
            print(f"bf16, step {scale:g}: noise {engine.noise:.3g}, last probe move {moved:.3g}")
            engine._load = lambda *args: None
            caught = None
            for k in range(4, 7):
                nudge(model, scale, seed=k)
                try:
                    engine.push(model, k)
                except ServerError as exc:
                    caught = (k - 3, str(exc))
                    break
            assert caught is not None and "not verified" in caught[1], (scale, caught)
            print(f"bf16, step {scale:g}: a no-op transport caught at push {caught[0]}")


def test_multi_turn_trajectories_on_a_real_server_sample_the_version_they_report(tmp_path, monkeypatch):
    """--tools on a real vLLM server (the tools task's base model, which calls its calculator): every turn
    after the first is a request from the whole conversation so far, tool turns included. Each model-written
    token's log-prob from the server equals transformers' under the version the step reports (the initial
    model, then each step's checkpoint) within vLLM's fp32 rounding, and not the next version's; the turns end
    at the server's EOS, so the tool runs and its tokens are in the trajectories."""
    from versions import assert_sampled_by, assert_tools_ran, train_recording, version_argv

    from grpo_fast.tasks import tools_task

    G, steps, T_ = 4, 3, 1.5
    log = open(tmp_path / "server.log", "w")
    model = str(tools_task.ASSET_DIR)
    with serve.launch(model, port=free_port(), python=sys.executable, max_model_len=96, log=log) as url:
        records, made = train_recording(monkeypatch, version_argv(tmp_path, G, steps, T_) + [
            "--task", "shop-tools", "--rollout", "vllm", "--vllm-mode", "server", "--vllm-server-base-url",
            url, "--max-completion-length", "48",
        ])  # fmt: skip
    out = tmp_path / "run"
    assert_tools_ran(records, made)
    # synchronous: each step samples the weights of the step before; vLLM's fp32 kernels round otherwise
    assert_sampled_by(made, list(range(steps)), tools_task.ASSET_DIR, out, G, T_, same=1e-3)


def test_lora_adapter_pushed_alone_to_a_real_server(tmp_path, monkeypatch):
    """A server started for LoRA (grpo-fast serve --lora-rank 8): the base goes once, then each push carries
    the adapter alone (its bytes), under a new name; after each of 3 steps the server's log-probs through it
    of a random sequence (not the probe) equal the PEFT model's forward within vLLM's fp32 rounding and differ
    from the base model's; its samples' log-probs too; an adapter transport that leaves the files of the
    version before is caught. Then `grpo-fast train --lora-r 8 --max-staleness 1` on that server samples the
    versions it reports (PEFT merging each step's saved adapter), pushing adapters only."""
    from peft import LoraConfig, get_peft_model
    from versions import assert_sampled_by, train_recording, version_argv

    from grpo_fast.rollout import lora_adapters

    model = get_peft_model(policy(), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).eval()
    ids = random_ids(model)
    adapter_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" in n)
    log = open(tmp_path / "server.log", "w")
    with serve.launch(str(MODEL), port=free_port(), python=sys.executable, max_model_len=64, log=log,
                      lora_rank=8) as url:  # fmt: skip
        engine = ServerEngine(model, [url], auto_push=False, weight_dir=str(tmp_path))
        assert engine.stats["push"] == "adapter"
        engine.push(model, 0)
        s = engine.servers[0]
        for step in (1, 2, 3):
            g = torch.Generator().manual_seed(step)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_" in n:
                        p.add_(torch.randn(p.shape, generator=g) * 0.05)
            engine.push(model, step)
            assert engine.stats["sync_bytes"] == adapter_bytes
            theirs, mine = engine.server_logprobs(s, ids, "test"), trainer_logprobs(model, ids)
            base = engine.server_logprobs(s, ids, "test", model=s.model_name)
            err, moved = float((theirs - mine).abs().max()), float((theirs - base).abs().max())
            print(f"LoRA step {step}: |server - PEFT| {err:.2e}, adapter moved the log-probs {moved:.3g}")
            assert err < 1e-3 < moved, (step, err, moved)
        prompt = ids[:6]
        out = engine.generate(model, torch.tensor([prompt]), torch.ones(1, 6, dtype=torch.long), 2, 6,
                              eos_token_id=1, return_logprobs=True)  # fmt: skip
        for r in range(2):
            k = int(out[1][r].sum())
            written = trainer_logprobs(model, prompt + out[0][r, :k].tolist())[5:]
            assert float((out[-1][r, :k].double() - written).abs().max()) < 1e-3
        # a transport that leaves the files of the version before: caught at the push
        stale = {}
        real = lora_adapters.write_adapter

        def write_stale(directory, tensors, config):
            stale.setdefault("tensors", {n: t.clone() for n, t in tensors.items()})
            return real(directory, stale["tensors"], config)

        monkeypatch.setattr(lora_adapters, "write_adapter", write_stale)
        caught = None
        for step in (4, 5, 6):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.mul_(1.0 + 1e-3)
            try:
                engine.push(model, step)
            except ServerError as exc:
                caught = (step, str(exc))
                break
        assert caught and "not verified" in caught[1], caught
        monkeypatch.undo()
        engine.release()
        G, steps, T_ = 4, 3, 1.5
        records, made = train_recording(monkeypatch, version_argv(tmp_path, G, steps, T_) + [
            "--rollout", "vllm", "--vllm-mode", "server", "--vllm-server-base-url", url,
            "--max-completion-length", "8", "--lora-r", "8", "--lora-alpha", "16", "--learning-rate", "3e-2",
            "--max-staleness", "1",
        ])  # fmt: skip
    pushed = [r["sync/bytes"] for r in records if r.get("sync/bytes")]
    assert pushed and max(pushed) == adapter_bytes, pushed
    staleness = [r["async/staleness"] for r in records]
    versions = [step - 1 - st for step, st in enumerate(staleness, start=1)]
    assert_sampled_by(made, versions, MODEL, tmp_path / "run", G, T_, same=1e-3)
