"""Target model side of sgl-dflash: pure JAX models over a paged KV cache."""
