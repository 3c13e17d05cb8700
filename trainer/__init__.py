"""The FSDP2 LoRA trainer: `TrainerWorker` (one rank), `TrainerGroup` (the ranks as Ray actors)."""
