"""A push is verified before any sample is drawn from it: the server's log-probs of a fixed probe sequence
must equal the trainer's within the dtype's tolerance, and must have moved with the trainer's when those
moved: a transport that does nothing is an error, never stale training. Mixed into ServerEngine."""

import math

import torch

from ...models.model_parts import causal_lm
from .. import lora_adapters
from ..lora_adapters import ADAPTER
from .client import PROBE_LEN, Server, ServerError

# the largest |server - trainer| log-prob on the probe a push may leave, by the server's dtype (vLLM's kernels
# are not the trainer's: fp32 differs by rounding, 16-bit by its precision)
PROBE_TOLERANCE = {"float32": 2e-3, "bfloat16": 0.25, "float16": 0.05}


class Verification:
    """ServerEngine's probe checks (its servers, dtype, vocab, anchor, noise, last_probe and stats)."""

    def probe_ids(self, vocab: int) -> list:
        """PROBE_LEN fixed random tokens (fewer when a server's context is shorter)."""
        n = min([PROBE_LEN, *(s.max_model_len - 1 for s in self.servers)])
        g = torch.Generator().manual_seed(20_251_202)
        return torch.randint(vocab, (n,), generator=g).tolist()

    def server_logprobs(self, s: Server, ids: list, what: str, model: str | None = None) -> torch.Tensor:
        """The server's log-probs of ids[1:] given their prefix (temperature 1, whole vocabulary), from the
        served model `model` (default: what generation samples from, `served_name`)."""
        body = {"prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        out = s.call("/v1/completions", {"model": model or self.served_name(s), **body}, what=what)
        try:
            rows = out["choices"][0]["prompt_logprobs"][1:]
            return torch.tensor([row[str(t)]["logprob"] for row, t in zip(rows, ids[1:], strict=True)],
                                dtype=torch.float64)  # fmt: skip
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise ServerError(
                f"vLLM server {s.url}: {what}: an answer without the probe's log-probs ({exc!r})"
            ) from exc

    def trainer_probe(self, model, names=()):
        """The trainer's log-probs of the probe (fp64, CPU), from `model`'s own forward in eval mode; when
        LoRA adapters are pushed alone and `names` (the push's) hold base weights, (those, the base
        model's)."""
        if self.adapters and any(not n.startswith(ADAPTER) for n in names):
            with lora_adapters.without_adapters(model):
                base = self._probe(model)
            return self._probe(model), base
        return self._probe(model)

    def _probe(self, model) -> torch.Tensor:
        lm = causal_lm(model)
        x = torch.tensor([self.probe_ids(self.vocab)], device=next(lm.parameters()).device)
        was_training = lm.training
        lm.eval()
        logits = lm(input_ids=x).logits[0, :-1].double()
        lm.train(was_training)
        return logits.log_softmax(-1).gather(-1, x[0, 1:, None].to(logits.device))[:, 0].cpu()

    def _verify(self, mine: torch.Tensor, at: str, bytes_changed: bool = True) -> None:
        """The server's probe log-probs are finite, equal the trainer's (`mine`) within the dtype's tolerance,
        and moved with them. Two movement checks, so that a transport that does nothing fails at the first
        push that changes anything, in fp32 and in 16 bits alike:

        - exact: when the pushed bytes changed and the trainer's probe moved, the server's must differ from
          what it answered after the previous push (the same weights and the same request give the same bits;
          a 16-bit step too small to move the probe beyond the noise still flips some bits);
        - by size: since the last push at which the trainer's moved by more than 16x the noise (the error of
          the first push, where both hold the same weights; at least 1% of the tolerance), the server's must
          have moved by at least half as much (a push that lands somewhere else)."""
        if not bool(torch.isfinite(mine).all()):
            raise RuntimeError(
                f"weight push{at}: the policy's own log-probs of the probe are not finite (the trained "
                "weights hold NaN or inf): training diverged"
            )
        ids = self.probe_ids(self.vocab)
        tol = PROBE_TOLERANCE.get(self.dtype, 0.25)
        anchored = self.anchor is not None
        moved = float((mine - self.anchor[0]).abs().max()) if anchored else 0.0
        telling = anchored and moved > 16 * max(self.noise, tol / 100)
        last = self.last_probe
        expect_change = bytes_changed and last is not None and not torch.equal(mine, last[0])
        errors, theirs_all = [], []
        for s in self.alive:
            theirs = self.server_logprobs(s, ids, f"verification probe{at}")
            err = float((theirs - mine).abs().max())
            theirs_moved = float((theirs - self.anchor[1][s.url]).abs().max()) if anchored else 0.0
            if not math.isfinite(err) or not err <= tol:  # a NaN or inf answer fails too
                why = f"max |server - trainer| {err:.3g} > {tol:g}"
            elif expect_change and s.url in last[1] and torch.equal(theirs, last[1][s.url]):
                why = (
                    "they are bit for bit what it answered before this push, though the pushed weights and "
                    "the trainer's log-probs changed: the push changed nothing there"
                )
            elif telling and theirs_moved < moved / 2:
                why = (
                    f"they did not move with the trainer's (the trainer's moved {moved:.3g} since the last "
                    f"check, the server's {theirs_moved:.3g}): the push changed nothing there"
                )
            else:
                errors.append(err)
                theirs_all.append((s.url, theirs))
                continue
            raise ServerError(
                f"vLLM server {s.url}: weight push{at} not verified: its log-probs of the probe do not equal "
                f"the trainer's ({self.dtype}): {why}"
            )
        if not anchored:
            self.noise = max(errors, default=0.0)
        self.stats["probe_error"] = max(errors, default=0.0)
        self.stats["probe_moved"] = moved
        if not anchored or telling:
            self.anchor = (mine, dict(theirs_all))
        self.last_probe = (mine, dict(theirs_all))

    def _check_base(self, mine: torch.Tensor, at: str) -> None:
        """The servers' base model (adapters off) gives the trainer's base log-probs `mine` on the probe
        (the base weights, pushed once when LoRA adapters travel alone)."""
        tol = PROBE_TOLERANCE.get(self.dtype, 0.25)
        ids = self.probe_ids(self.vocab)
        for s in self.alive:
            theirs = self.server_logprobs(s, ids, f"verification probe{at}", model=s.model_name)
            err = float((theirs - mine).abs().max())
            if not math.isfinite(err) or not err <= tol:
                raise ServerError(
                    f"vLLM server {s.url}: base weight push{at} not verified: its base model's log-probs of "
                    f"the probe do not equal the trainer's base model's ({self.dtype}): max |server - "
                    f"trainer| {err:.3g} > {tol:g}"
                )
