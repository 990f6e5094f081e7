"""What a trajectory page (molt/view.py) costs the step that makes it, and how it scales.

    PYTHONPATH=. python experiments/benchmarks/viewer.py --browser                               # the table below
    PYTHONPATH=. python experiments/benchmarks/viewer.py --cases 1024x8192 --browser --max-tokens 0  # its last row
    PYTHONPATH=. python experiments/benchmarks/viewer.py --model smollm2_135m --cases 64x512,64x8192 --browser

Each case is one step of R rollouts of T tokens (a quarter prompt, the rest generated, as one segment; groups of 8,
GRPO-like advantages, per-token behaviour and actor log-probs, versions), built as the loop's own Rollout objects.
It times what the loop adds on a page step: `view.records` (the dump records, with the IS weights of
is_correction.level=token) and `view.write` (decode with the tiny model's tokenizer, the page JSON, the file), and
prints the page's size; --browser also times headless Chromium loading the page and rendering its rows and the
first rollout (--dump-dom). The step's rollouts are random ids of the tiny tokenizer (512 ids): a real vocabulary
adds one table entry per distinct id (150k ids: about 2 MB).

Measured on the 2-core CPU machine, another test run beside it (load average 5-7, 2026-12-05; `--max-tokens 0`
for the last row):

| rollouts x tokens (a step) | tokens on the page | `view.records` s | `view.write` s | page MB | gzipped MB | Chromium opens it, s |
|---|---|---|---|---|---|---|
| 64 x 24 (the quickstart's size) | all 64 rollouts | 0.00 | 0.02 | 0.05 | 0.02 | 1.1 |
| 64 x 8,192 | 61 rollouts (500k tokens) | 0.20 | 0.23 | 5.37 | 3.88 | 3.4 |
| 1,024 x 1,024 | 488 rollouts | 0.24 | 0.41 | 5.59 | 4.01 | 3.9 |
| 1,024 x 8,192 | 61 rollouts | 3.16 | 3.87 | 5.55 | 3.91 | 8.9 |
| 1,024 x 8,192, `view.max_tokens=0` | all 1,024 rollouts (8.4M tokens) | 6.33 | 7.21 | 89.8 | 65.1 | 50.3 |

At load 3-4 the same cases took about half as long (1,024 x 8,192 capped: 2.3 s, 2.2 s, 4.0 s). The first page of a
fresh process also imports torch and transformers and loads the tokenizer (a few seconds; the loop has them already).

With SmolLM2-135M's tokenizer (49,152 ids; `--model smollm2_135m --cases 64x512,64x8192 --browser`, nothing else
running): 64 x 512, all 64 rollouts, records 0.01 s, write 0.13 s, 0.80 MB (0.44 gzipped), Chromium 1.2 s;
64 x 8,192, 61 rollouts, records 0.09 s, write 0.61 s, 6.23 MB (4.35 gzipped), Chromium 2.2 s.
"""
from __future__ import annotations

import argparse
import gzip
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from molt import view
from molt.assets import ensure_model
from molt.config import IsCorrectionConfig, ViewConfig
from molt.types import Group, Rollout, Segment

REPO = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def step(rollouts: int, tokens: int, vocab: int, seed: int = 0):
    """(groups, advantages per segment, actor log-probs per segment) of one synthetic step, ids below `vocab`."""
    rng = np.random.default_rng(seed)
    prompt, gen = tokens // 4, tokens - tokens // 4
    groups, advantages, kept = [], [], []
    for g in range(rollouts // 8):
        group = Group(f"g{g}", {})
        for i in range(8):
            s = Segment()
            s.append(rng.integers(3, vocab, prompt).tolist())
            lp = (-rng.exponential(1.0, gen)).tolist()
            s.append(rng.integers(3, vocab, gen).tolist(), generated=True, logprobs=lp, version=5)
            group.rollouts.append(Rollout(f"g{g}/{i}", f"g{g}", [s], float(rng.random()),
                                          {"turns": 1.0, "tokens": float(tokens), "gen_tokens": float(gen)}))
            advantages.append(float(rng.normal()))
            kept.append((np.asarray(s.logprobs) + rng.normal(0, 1e-3, tokens) * np.asarray(s.loss_mask)).tolist())
        groups.append(group)
    return groups, advantages, kept


def browse(page: Path, tmp: Path) -> float:
    """Seconds for headless Chromium to load the page, run its script and print the DOM."""
    t0 = time.time()
    out = subprocess.run([shutil.which("chromium"), *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'profile'}",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and 'class="g"' in out.stdout, out.stderr[-2000:]
    return time.time() - t0


def case(rollouts: int, tokens: int, tokenizer: Path, browser: bool, tmp: Path, max_tokens: int) -> dict:
    from transformers import AutoTokenizer

    groups, advantages, kept = step(rollouts, tokens, len(AutoTokenizer.from_pretrained(tokenizer)))
    t0 = time.time()
    records = view.records(groups, [], advantages, 5, kept, IsCorrectionConfig(level="token"))
    t1 = time.time()
    page = view.write(tmp, records, 5, str(tokenizer), max_tokens)
    t2 = time.time()
    html = page.read_text()
    shown = html.count('"segs":[{')
    return {"case": f"{rollouts} x {tokens}", "tokens": f"{rollouts * tokens:,}", "shown": f"{shown} rollouts",
            "records s": f"{t1 - t0:.2f}", "write s": f"{t2 - t1:.2f}", "page MB": f"{len(html) / 1e6:.2f}",
            "gzip MB": f"{len(gzip.compress(html.encode(), 6)) / 1e6:.2f}",
            "Chromium s": f"{browse(page, tmp):.1f}" if browser else "-"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="64x24,64x8192,1024x1024,1024x8192", help="comma-separated ROLLOUTSxTOKENS")
    ap.add_argument("--browser", action="store_true", help="also time headless Chromium (needs /usr/bin/chromium)")
    ap.add_argument("--max-tokens", type=int, default=ViewConfig.max_tokens, help="view.max_tokens (0: no cap)")
    ap.add_argument("--model", default="tiny", help="model recipe whose tokenizer decodes the page (tiny, smollm2_135m)")
    a = ap.parse_args()
    tokenizer = ensure_model(REPO / "assets" / a.model, a.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()  # the first page of a process imports torch and transformers and loads the tokenizer
        case(8, 24, tokenizer, False, Path(tmp), 0)
        print(f"first page in a fresh process: {time.time() - t0:.1f} s (imports, tokenizer); not in the table",
              file=sys.stderr)
        for c in a.cases.split(","):
            r, t = map(int, c.split("x"))
            rows.append(case(r, t, tokenizer, a.browser, Path(tmp), a.max_tokens))
            print(rows[-1], file=sys.stderr, flush=True)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(r[c] for c in cols) + " |")


if __name__ == "__main__":
    main()
