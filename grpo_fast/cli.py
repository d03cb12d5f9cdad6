"""`grpo-fast` command line: `grpo-fast train [--flag value ...]`, `grpo-fast estimate [same flags]
[--device cpu|cuda]` (the memory of a step, grpo_fast/trainer/estimate.py), `grpo-fast serve MODEL [flags]` (a
vLLM server for --vllm-mode server, grpo_fast/rollout/server/serve.py)."""

import sys


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: grpo-fast train [--flag value ...]   (grpo-fast train --help lists the flags)\n"
            "       grpo-fast estimate [the same flags] [--device cpu|cuda]   (a step's memory, its parts)\n"
            "       grpo-fast serve MODEL [--port N] [vllm flags]   (a vLLM server for --vllm-mode server)"
        )
        sys.exit(0 if argv else 2)
    if argv[0] == "estimate":
        from .trainer.estimate import main as estimate_main

        estimate_main(argv[1:])
        return
    if argv[0] == "serve":
        from .rollout.server.serve import main as serve_main

        serve_main(argv[1:])
        return
    if argv[0] != "train":
        expected = "expected 'train', 'estimate' or 'serve'"
        print(f"grpo-fast: unknown command {argv[0]!r}; {expected}", file=sys.stderr)
        sys.exit(2)
    from .trainer.train import main as train_main

    train_main(argv[1:])


if __name__ == "__main__":
    main()
