"""Convert GSM8K's rows into Molt's chat JSONL (run where the data can be downloaded; nothing here downloads).

    python -m experiments.recipes.make_gsm8k SRC_DIR [OUT_DIR]   # default OUT_DIR: experiments/recipes/data/gsm8k

SRC_DIR holds GSM8K's two splits as JSONL, `train.jsonl` and `test.jsonl`, one `{"question", "answer"}` object per
line, where `answer` is a worked solution ending in `#### <number>`: the files of the openai/grade-school-math
GitHub repository (grade_school_math/data/), or the Hugging Face copy (openai/gsm8k, config `main`) saved with
`datasets`' `to_json`. Each row becomes `{"messages": [user: question + INSTRUCTION], "answer": "<number>"}`;
the worked solution is dropped (the policy is rewarded on the final number only, see gsm8k.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments.recipes.gsm8k import INSTRUCTION, normalise


def convert(row: dict) -> dict:
    solution = row["answer"]
    if "####" not in solution:
        raise ValueError(f"no '####' final answer in {solution[-80:]!r}")
    answer = normalise(solution.rsplit("####", 1)[1].strip())
    return {"messages": [{"role": "user", "content": f"{row['question'].strip()}\n\n{INSTRUCTION}"}], "answer": answer}


def convert_file(src: Path, dst: Path) -> int:
    rows = [convert(json.loads(line)) for line in src.read_text(encoding="utf-8").splitlines() if line.strip()]
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return len(rows)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    src = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).parent / "data" / "gsm8k"
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        print(f"{out / f'{split}.jsonl'}: {convert_file(src / f'{split}.jsonl', out / f'{split}.jsonl')} rows")


if __name__ == "__main__":
    main()
