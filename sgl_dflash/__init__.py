"""sgl-dflash runtime: scheduler, DFLASH worker, Engine, server, SGLang plugin."""
