"""Stopping on SIGTERM / Ctrl-C within seconds, with the last trained step saved.

A signal sets a flag that the loop reads between steps: a step in progress (its optimizer update) is never
cut. The waits that can last minutes are *abortable*: waiting for a rollout (a generation thread, servers,
or a colocated engine), and pushing weights to servers. A signal that arrives while the trainer is in one
of them raises `Stopping` there at once (and entering one after the signal raises it too); the loop then
saves the last trained step and exits. Under torchrun only rank-local waits are abortable (never a
collective: the other ranks would be left waiting in it), and the ranks agree on the stop
(grpo_fast.trainer.rollouts.agree).
"""

import contextlib
import signal


class Stopping(Exception):
    """A stop signal arrived while the trainer waited: nothing of the step in progress is kept but what was
    trained."""


class Signals:
    """SIGTERM and SIGINT handled while installed (`install`): `stop` is set; inside `abortable()` the first
    signal raises `Stopping`."""

    def __init__(self):
        self.stop = False
        self._depth = 0  # abortable sections entered and not left

    def handler(self, signum, frame):
        first = not self.stop
        self.stop = True
        if first and self._depth:
            raise Stopping(f"{signal.Signals(signum).name} while waiting")

    @contextlib.contextmanager
    def abortable(self):
        """A section a stop signal may cut short (`Stopping`); entered after the signal, it raises at once."""
        if self.stop:
            raise Stopping("a stop was asked for")
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    @contextlib.contextmanager
    def install(self):
        old = {s: signal.signal(s, self.handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, h in old.items():
                signal.signal(s, h)


NEVER = contextlib.nullcontext  # an abortable() for sections that must run to their end
