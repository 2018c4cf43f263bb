"""The DFlash drafter: one PyTorch module, run eagerly or lowered to JAX through torchax."""
