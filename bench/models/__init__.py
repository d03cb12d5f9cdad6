"""Model benchmarks, ours against the alternatives on the same machine in the same run: one GRPO step end to
end against TRL (e2e), rollouts against HF generate and vLLM (generate), shared-prefix training (prefix), the
memory estimate against measured peaks (memory), the longest completions in a memory budget (frontier), bf16
against fp32 GEMMs and optimizers (precision), LoRA adapter pushes to vLLM servers (lora_push)."""
