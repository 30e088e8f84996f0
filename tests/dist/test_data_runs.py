"""A real corpus through every source and backend: the same text as .jsonl (DeepSpeed, 2 ranks; torch, 2 pipeline
stages), as Parquet (torch FSDP2, 2 ranks) and as a prepared Megatron prefix (Megatron-Core, 2 pipeline stages) trains
on the same rows, so the runs' training and validation losses agree; a resumed run continues at the exact next row."""
import shutil
import subprocess
import sys

import pytest

from launch.run.checkpoints import MARKER, complete_checkpoints
from tests.conftest import REPO
from tests.dist.conftest import SHORT, TORCH, train

# -m full (CI): the three data sources and their resume; text data trains in README's suite (test_deepspeed_run).
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.full]
CORPUS = REPO / "tests" / "fixtures" / "text" / "genesis.jsonl"  # public domain (its README)
TOKENIZER = REPO / "tests" / "fixtures" / "tokenizer"
REAL = (*SHORT, "train.steps=12", "train.checkpoint_every=6", "train.eval_every=4", "data.valid_fraction=0.15",
        f"data.tokenizer={TOKENIZER}")
EVALUATED = [4, 8, 12]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("corpus")
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if line.strip()]
    pq.write_table(pa.table({"text": texts}), d / "corpus.parquet")
    p = subprocess.run([sys.executable, "-m", "launch", "prepare-data", str(CORPUS), f"out={d / 'corpus'}",
                        f"data.tokenizer={TOKENIZER}"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return {"text": CORPUS, "parquet": d / "corpus.parquet", "megatron": d / "corpus"}


@pytest.fixture(scope="module")
def runs(sources, runs_root):
    recipes = {"text": "recipes/tiny_zero2", "parquet": TORCH, "megatron": "recipes/tiny_pp2"}
    out = {s: train(runs_root / f"data_{s}", *REAL, f"data.source={s}", f"data.path={sources[s]}", recipe=recipes[s])
           for s in recipes}
    # the torch backend's pipeline evaluates through its schedule's eval(), one global batch per call
    out["torch_pp"] = train(runs_root / "data_torch_pp", *REAL, "data.source=text", f"data.path={CORPUS}",
                            "parallel.pp=2", recipe=TORCH)
    return out


def test_each_source_trains_with_a_validation_loss(runs):
    for source, t in runs.items():
        steps = t.metrics().steps
        losses = [s.loss for s in steps]
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, (source, losses)
        assert [s.step for s in steps if s.valid_loss is not None] == EVALUATED, source
        assert all(s.tokens == 8 * 32 and 0 < s.data_time_s < s.step_time_s for s in steps), source
        assert "data: text" in t.proc.stdout or source != "text"


def test_the_three_sources_train_on_the_same_rows(runs):
    """Three backends, three readers of one corpus: equal losses mean equal rows in equal order (fp32, to 1e-4); the
    validation losses average the same train.eval_batches (2) global batches everywhere."""
    ref = runs["text"].metrics().steps
    for source in ("parquet", "megatron", "torch_pp"):
        steps = runs[source].metrics().steps
        for a, b in zip(ref, steps, strict=True):
            assert abs(a.loss - b.loss) <= 1e-4, (source, a.step, a.loss, b.loss)
            assert (a.valid_loss is None) == (b.valid_loss is None)
            if a.valid_loss is not None:
                assert abs(a.valid_loss - b.valid_loss) <= 1e-4, (source, a.step)


def test_resume_reads_exactly_the_rows_the_uninterrupted_run_read(runs, runs_root):
    whole = runs["text"]
    copy = runs_root / "data_cut" / whole.root.parent.name / whole.root.name
    shutil.copytree(whole.root, copy)
    (copy / "checkpoints" / "step12" / MARKER).unlink()  # as if killed while saving the last step
    assert [c.step for c in complete_checkpoints(copy / "checkpoints")] == [6]
    resumed = train(runs_root / "data_resumed", *REAL, "data.source=text", f"data.path={CORPUS}",
                    f"run.resume={copy}")
    after = resumed.metrics().steps
    assert [s.step for s in after] == list(range(7, 13))
    for a, b in zip(whole.metrics().steps[6:], after, strict=True):
        assert abs(a.loss - b.loss) <= 1e-5, (a.step, a.loss, b.loss)
        assert (a.valid_loss is None) == (b.valid_loss is None)
        if a.valid_loss is not None:
            assert abs(a.valid_loss - b.valid_loss) <= 1e-5


def test_the_export_of_a_text_run_loads_model_and_tokenizer_in_transformers(runs, tmp_path):
    """The export holds what the run read with: AutoTokenizer loads it and encodes the corpus as the tokenizer
    folder does (read here with `tokenizers`), and the model scores those ids below the loss the run started at."""
    import json

    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export"
    p = subprocess.run([sys.executable, "-m", "launch", "export", str(runs["parquet"].root), f"out={out}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[-1].startswith(f"and AutoTokenizer.from_pretrained({str(out)!r}) (copied from")
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    text = json.loads(CORPUS.read_text().splitlines()[0])["text"]
    ids = tok(text).input_ids
    assert ids == Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).encode(text).ids
    with torch.no_grad():
        loss = model(torch.tensor([ids[:32]]), labels=torch.tensor([ids[:32]])).loss.item()
    assert loss < runs["parquet"].metrics().steps[0].loss  # trained: below where the run started
