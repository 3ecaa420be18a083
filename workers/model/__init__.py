"""Model families and what changes their weights' shape: the GPT reference, LoRA/QLoRA adapters, fine-tuning setup."""
