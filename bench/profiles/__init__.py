"""Per-operator profiles held against the machine's physical floor: a rollout's decode (`python -m
bench.profiles.decode`: bytes and FLOPs per token step against read bandwidth and GEMM peak) and a training
phase (`python -m bench.profiles.train`: its GEMMs against the GEMM peak)."""
