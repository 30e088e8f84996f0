"""Data path throughput, each against a named baseline measured in the same invocation:

1. `python -m launch prepare-data` (read + tokenize + Megatron's IndexedDatasetBuilder) against the `tokenizers`
   library's own `encode_batch_fast` over the same documents: tokens/s of each and the ratio (the command's own
   tokenizing phase, as its summary prints it, and the whole command with its process start and imports).
2. The loader inside a training run: `data_time_s` / `step_time_s` of a tiny recipe on a text corpus (target < 2%).

    python bench/bench_data.py [documents=20000] [steps=30] [recipe=recipes/tiny_zero2]

The corpus is tests/fixtures/text/corpus.jsonl's documents repeated (each copy numbered) up to `documents`, tokenized
with the fixture tokenizer (tests/fixtures/tokenizer); the machine's cores are shared by both sides in turn.
"""
from _cli import help_or_usage  # bench/ is the folder of the script run (python bench/NAME.py)

help_or_usage(__doc__)

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "fixtures" / "text" / "corpus.jsonl"
TOKENIZER = REPO / "tests" / "fixtures" / "tokenizer"


def main(argv: list[str]) -> None:
    opts = dict(a.split("=", 1) for a in argv)
    n, steps, recipe = int(opts.get("documents", 20000)), int(opts.get("steps", 30)), opts.get("recipe", "recipes/tiny_zero2")
    base = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if line.strip()]
    docs = [f"{i}. {base[i % len(base)]}" for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
        t0 = time.perf_counter()
        base_tokens = sum(len(e.ids) for e in tok.encode_batch_fast(docs))
        base_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "launch", "prepare-data", str(corpus), f"out={Path(tmp) / 'p'}",
                            f"data.tokenizer={TOKENIZER}"], cwd=REPO, capture_output=True, text=True, check=True)
        whole_s = time.perf_counter() - t0
        m = re.search(r"([\d,]+) tokens, [\d,]+ bytes, ([\d,]+) tokens/s", p.stdout)
        tokens, phase_rate = int(m[1].replace(",", "")), int(m[2].replace(",", ""))
        base_rate = base_tokens / base_s
        print(f"corpus: {n:,} documents, {corpus.stat().st_size:,} bytes; {base_tokens:,} tokens "
              f"(+{n:,} end-of-document ids written by prepare-data: {tokens:,})")
        print(f"tokenizers encode_batch_fast:       {base_rate:12,.0f} tokens/s  ({base_s:.2f} s)")
        print(f"prepare-data, its tokenizing phase: {phase_rate:12,.0f} tokens/s  ratio {phase_rate / base_rate:.2f}")
        print(f"prepare-data, the whole command:    {tokens / whole_s:12,.0f} tokens/s  ratio "
              f"{tokens / whole_s / base_rate:.2f} ({whole_s:.2f} s, process start and imports included)")

        env = {**os.environ, "LAYOUTLAB_RUNS": str(Path(tmp) / "runs")}
        subprocess.run(["bash", "launch/run.sh", recipe, "data.source=text", f"data.path={corpus}",
                        f"data.tokenizer={TOKENIZER}", f"train.steps={steps}", "run.save_final=false",
                        "train.checkpoint_every=0", "run.resume=never"], cwd=REPO, env=env, check=True,
                       capture_output=True)
        (run,) = (Path(tmp) / "runs").glob("*/*")
        shares = []
        for rank_file in sorted((run / "metrics").glob("rank*.jsonl")):
            recs = [json.loads(line) for line in rank_file.read_text().splitlines()]
            shares += [r["data_time_s"] / r["step_time_s"] for r in recs if r["kind"] == "step" and not r["warmup"]]
        print(f"loader in {recipe} ({steps} steps, text corpus): data_time_s / step_time_s median "
              f"{statistics.median(shares):.2%}, max {max(shares):.2%} (target < 2%)")


if __name__ == "__main__":
    main(sys.argv[1:])
