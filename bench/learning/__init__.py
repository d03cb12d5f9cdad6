"""Learning against TRL on a real model: SmolLM2-135M-Instruct on the arithmetic task, same everything,
several seeds (`python -m bench.learning.vs_trl`)."""
