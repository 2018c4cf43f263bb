"""Shared by the kernel-build A/B scripts here: `code` run once per build variant and round in a
subprocess, variants alternating in order by round; each variant is "name:compiler flags"
(SGL_DFLASH_KERNEL_FLAGS). Returns name -> [the JSON line `code` printed, one per round]."""
import json, os, subprocess, sys


def run_builds(code: str, variants: list[str], rounds: int) -> dict[str, list[dict]]:
    out = {}
    for rnd in range(rounds):
        for v in (variants if rnd % 2 == 0 else variants[::-1]):
            name, flags = v.split(":", 1)
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env={**os.environ, "SGL_DFLASH_KERNEL_FLAGS": flags})
            line = [l for l in r.stdout.splitlines() if l.startswith("{")]
            if not line:
                print(r.stderr[-3000:])
                sys.exit(1)
            out.setdefault(name, []).append(json.loads(line[-1]))
        print("round", rnd, flush=True)
    return out
