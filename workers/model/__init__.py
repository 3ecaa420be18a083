"""Model families and what changes their weights' shape: the GPT reference, LoRA/QLoRA adapters, NF4 (fine-tuning's
setup, which reads checkpoints, is ``workers.finetune``, above the training state)."""
