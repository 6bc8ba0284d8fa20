"""The exchange engine: one bucket's compressed exchange, written once, driven by torch.distributed or in
process for N simulated workers (its modules: docs/architecture.md; the vocabulary: core.protocol)."""
