"""Multi-LoRA serving: PEFT adapters of the base model, several in one batch (punica's
per-token adapter index and one batched low-rank product per projection)."""
