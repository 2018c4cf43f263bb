"""Lets the CUDA-built torchvision wheel import with CPU torch (see scripts/setup.sh).

Its `_meta_registrations.py` registers fake kernels for `torchvision::nms` / `qnms` without
checking that the C++ ops loaded (all its other meta registrations check
`torchvision.extension._has_ops()`); with CPU torch they never load, and torch 2.13 raises
"operator torchvision::nms does not exist" at `import torchvision`. This guards those two
decorators the same way. Idempotent; a no-op when the ops load (a CPU build of torchvision).
"""

import importlib.util
import re
from pathlib import Path

spec = importlib.util.find_spec("torchvision")
path = Path(spec.origin).parent / "_meta_registrations.py"
text = path.read_text()
patched = re.sub(
    r'^@torch\.library\.register_fake\(("torchvision::\w+")\)$',
    r"@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))",
    text,
    flags=re.M,
)
if patched != text:
    path.write_text(patched)
    print(f"patched {path}")
