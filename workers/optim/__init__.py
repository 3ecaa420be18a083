"""Optimizers (torch's, SM3), learning-rate schedules, gradient clipping, fp16 loss scaling."""
