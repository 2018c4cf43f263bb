"""Speculative decoding: the algorithm registry and the DFLASH worker."""
