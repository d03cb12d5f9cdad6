"""`python -m grpo_fast.train [--flag value ...]`: the trainer's entry point (also `grpo-fast train`, and what
torchrun runs); the loop itself is grpo_fast/trainer/train.py."""

from .trainer.train import main

if __name__ == "__main__":
    main()
