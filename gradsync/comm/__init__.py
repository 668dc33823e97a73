"""Reusable transport pieces over torch.distributed (c10d)."""
