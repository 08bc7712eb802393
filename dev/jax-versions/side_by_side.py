"""Keep two ``foldax bench`` runs of the headline workloads, one on the oldest JAX foldax accepts
and one on the newest, as ``bench/jax-versions.json``, and render BENCHMARKS.md's section of
them (:mod:`foldax._tools.bench._versions`). Every time ratio that moved by more than 10%
between the runs needs its measured cause in the causes file (``"workload | case | pass"`` ->
text): the script names the ones missing.

    .venv/bin/foldax bench --only seed --only graph --out /tmp/old          # jax 0.10.2
    .venv-newest/bin/foldax bench --only seed --only graph --out /tmp/new   # jax 0.12
    python dev/jax-versions/side_by_side.py /tmp/old/bench/results.json \\
        /tmp/new/bench/results.json dev/jax-versions/causes.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from foldax._tools import bench

ROOT = Path(__file__).resolve().parents[2]


def main(old_path: str, new_path: str, causes_path: str) -> None:
    old, new = (json.loads(Path(p).read_text()) for p in (old_path, new_path))
    causes = json.loads(Path(causes_path).read_text())
    pair = bench.compare(old, new, causes)
    out = ROOT / bench.PLOT_DIR / bench.VERSIONS_FILE
    out.write_text(json.dumps(pair, indent=1) + "\n")
    bench.render(str(ROOT))
    print(f"wrote {out} and BENCHMARKS.md; moved: {bench.moved(old, new)}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
