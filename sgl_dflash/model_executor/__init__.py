"""The target model behind the worker interface (jax_backend underneath)."""
