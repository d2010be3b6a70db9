"""lm-evaluation-harness during training and afterwards, on real DeepSpeed engines: the scores are the harness's own.

The reference is lm-eval itself on the run's export, `lm_eval run --model hf` (its CLI, in a process of its own) or
its Python API with `--model hf`'s model (HFLM from the folder): the in-loop scores under ZeRO-3 on two ranks, ZeRO-1 on
one and LoRA under ZeRO-2 with CPU offload, and scripts/evaluate.py's on one process and on two ranks, must match them
(accuracies within one item, perplexities within 1e-3 relative, fp32), and so must the generation task's outputs. Tasks:
tests/fixtures/lm_eval (multiple choice, rolling perplexity, greedy generation; local JSONL, nothing downloaded).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.harness import FAST_FLAGS, REPO, VENV_BIN, check_ok, child_env, launch, read_metrics, run

pytestmark = pytest.mark.slow

TASKS = REPO / "tests" / "fixtures" / "lm_eval"
TASK_FILES = [str(p) for p in sorted(TASKS.glob("*.yaml"))]
DOCUMENTS = {"docstring_generation": 12, "docstring_module": 40, "docstring_perplexity": 20}
RELATIVE = ("perplexity", "bits_per_byte")  # metrics compared within 1e-3 relative; the others within one item


def train(run_dir: Path, cache: Path, config: str, nprocs: int, *extra: str):
    flags = ["--config", f"ds_configs/{config}.json", "--output_dir", str(run_dir), "--max_steps", "4", *FAST_FLAGS]
    proc = launch(REPO / "train.py", [*flags, *extra], "deepspeed" if nprocs > 1 else "python", cache, nprocs=nprocs)
    check_ok(proc)
    return proc


def cli_reference(model_dir: Path, out: Path, cache: Path) -> tuple:
    """`lm_eval run --model hf` on the folder, fp32 on the CPU, with its samples: (results, {task: samples})."""
    cmd = [
        str(VENV_BIN / "lm_eval"),
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model_dir}",
        "dtype=float32",
    ]
    cmd += ["--tasks", *TASK_FILES, "--batch_size", "8", "--device", "cpu", "--output_path", str(out), "--log_samples"]
    check_ok(run(cmd, child_env(cache), timeout=600, cwd=Path.cwd()))
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = {task: _jsonl(next(out.rglob(f"samples_{task}_*.jsonl"))) for task in DOCUMENTS}
    return results, samples


def api_reference(model_dir: Path) -> dict:
    """lm-eval's Python API with `--model hf`'s model on the folder (in this process)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model = HFLM(pretrained=str(model_dir), dtype="float32", batch_size=8, device="cpu")
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=TASK_FILES, task_manager=manager, log_samples=False)


def _jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_same_scores(ours: dict, theirs: dict) -> None:
    """Every metric of lm-eval's results, task by task."""
    assert set(ours["results"]) == set(theirs["results"]) == set(DOCUMENTS)
    for task, metrics in theirs["results"].items():
        compared = 0
        for key, value in metrics.items():
            if not isinstance(value, float) or "_stderr" in key:
                continue
            got = ours["results"][task][key]
            if any(word in key for word in RELATIVE):
                assert math.isclose(got, value, rel_tol=1e-3), (task, key, got, value)
            else:
                assert abs(got - value) <= 1 / DOCUMENTS[task] + 1e-9, (task, key, got, value)
            compared += 1
        assert compared, task


def generations(samples: list) -> dict:
    return {item["doc_id"]: item["filtered_resps"] for item in samples}


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, cache_dir) -> tuple:
    """Two ranks, ZeRO-3, scored every 2 of 4 steps with every item's samples; its export's CLI reference."""
    run_dir = tmp_path_factory.mktemp("lm_eval") / "zero3"
    scoring = ["--lm_eval_tasks", str(TASKS), "--lm_eval_steps", "2", "--lm_eval_log_samples"]
    proc = train(run_dir, cache_dir, "zero3", 2, *scoring)
    reference = cli_reference(run_dir, run_dir.parent / "reference", cache_dir)
    return run_dir, proc, reference


def test_in_loop_scores_on_two_zero3_ranks_are_the_harness_own(zero3_run):
    run_dir, proc, (reference, reference_samples) = zero3_run
    final = json.loads((run_dir / "lm_eval" / "step4.json").read_text())
    assert_same_scores(final, reference)
    ours = {task: _jsonl(run_dir / "lm_eval" / f"step4_samples_{task}.jsonl") for task in DOCUMENTS}
    assert generations(ours["docstring_generation"]) == generations(reference_samples["docstring_generation"])
    assert [item["doc_id"] for item in ours["docstring_module"]] == list(range(40))  # both ranks' items gathered
    # Where users look: the metrics at both scoring steps (the model moved between them), the log line, the time.
    records = read_metrics(run_dir)
    scored = {r["step"]: r for r in records if "lm_eval/docstring_module/acc" in r}
    assert sorted(scored) == [2, 4]
    assert scored[4]["lm_eval/docstring_perplexity/word_perplexity"] == pytest.approx(
        reference["results"]["docstring_perplexity"]["word_perplexity,none"], rel=1e-3
    )
    perplexity = "lm_eval/docstring_perplexity/word_perplexity"
    assert scored[2][perplexity] != scored[4][perplexity]
    assert "lm_eval/docstring_module/acc_stderr" in scored[4]
    assert sorted(p.name for p in (run_dir / "lm_eval").glob("step2*")) == sorted(
        ["step2.json", *(f"step2_samples_{task}.jsonl" for task in DOCUMENTS)]
    )
    assert "lm-eval at step 2: docstring_generation exact_match" in proc.stdout + proc.stderr
    step4 = next(r for r in records if r["step"] == 4 and "loss" in r)
    assert step4["evaluation_s"] > 0  # the evaluation at step 2 held step 3: the step profile's evaluation phase
    ledger = json.loads((run_dir / "goodput.json").read_text())
    assert ledger["seconds"]["eval"] > 0


def test_evaluate_script_gives_the_harness_numbers_on_one_process_and_two_ranks(zero3_run, cache_dir):
    run_dir, _, (reference, _) = zero3_run
    one = launch(REPO / "scripts" / "evaluate.py", [str(run_dir), "--tasks", str(TASKS)], "python", cache_dir)
    check_ok(one)
    assert "|docstring_module" in one.stdout  # lm-eval's table
    written = sorted((run_dir / "lm_eval").glob("evaluate_step4_*.json"))
    assert len(written) == 1
    assert_same_scores(json.loads(written[0].read_text()), reference)
    export = run_dir.parent / "export_only"  # the export alone, as a user copies it elsewhere
    export.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (export / name).write_bytes((run_dir / name).read_bytes())
    check_ok(launch(REPO / "scripts" / "evaluate.py", [str(export), "--tasks", str(TASKS)], "python", cache_dir))
    [exported] = sorted((export / "lm_eval").glob("evaluate_*.json"))
    assert "step" not in exported.name
    assert_same_scores(json.loads(exported.read_text()), reference)
    checkpoint = run_dir / "checkpoints" / "step4"
    two = launch(
        REPO / "scripts" / "evaluate.py", [str(checkpoint), "--tasks", str(TASKS)], "deepspeed", cache_dir, nprocs=2
    )
    check_ok(two)
    [sharded] = sorted((checkpoint / "lm_eval").glob("evaluate_step4_*.json"))
    assert_same_scores(json.loads(sharded.read_text()), reference)
    assert not list((checkpoint / "lm_eval").glob(".export*"))  # the temporary export is gone


def test_zero1_on_one_rank_scores_as_the_harness_and_trains_as_a_run_without_it(tmp_path, cache_dir):
    with_scores = train(tmp_path / "scored", cache_dir, "zero1", 1, "--lm_eval_tasks", ",".join(TASK_FILES))
    without = train(tmp_path / "plain", cache_dir, "zero1", 1)
    assert with_scores.returncode == without.returncode == 0
    final = json.loads((tmp_path / "scored" / "lm_eval" / "step4.json").read_text())
    assert [p.name for p in (tmp_path / "scored" / "lm_eval").iterdir()] == ["step4.json"]  # at the end only
    assert_same_scores(final, api_reference(tmp_path / "scored"))
    losses = [[r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r] for name in ("scored", "plain")]
    assert losses[0] == losses[1]


def test_zero3_on_one_rank_scores_as_the_harness(tmp_path, cache_dir):
    """ZeRO-3's partitioned module on one rank (its forwards gather the weights; no lockstep needed)."""
    train(tmp_path / "zero3", cache_dir, "zero3", 1, "--lm_eval_tasks", str(TASKS))
    final = json.loads((tmp_path / "zero3" / "lm_eval" / "step4.json").read_text())
    assert_same_scores(final, api_reference(tmp_path / "zero3"))


def test_lora_under_zero2_cpu_offload_scores_as_the_harness_on_its_merged_model(tmp_path, cache_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    base, run_dir = tmp_path / "base", tmp_path / "lora"  # a pretrained model for LoRA to adapt: the tiny Llama's
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "data" / "tiny-llama")).save_pretrained(base)
    AutoTokenizer.from_pretrained(REPO / "data" / "tiny-llama").save_pretrained(base)
    lora = ["--model_name_or_path", str(base), "--use_peft", "--merge_lora", "--lm_eval_tasks", str(TASKS)]
    train(run_dir, cache_dir, "zero2_offload", 1, *lora)
    final = json.loads((run_dir / "lm_eval" / "step4.json").read_text())
    assert_same_scores(final, api_reference(run_dir / "merged"))


def test_tensor_parallelism_is_refused_before_training(tmp_path, cache_dir):
    run_dir = tmp_path / "tp"
    flags = ["--config", "ds_configs/zero1.json", "--output_dir", str(run_dir), "--tensor_parallel_size", "2"]
    proc = launch(
        REPO / "train.py", [*flags, *FAST_FLAGS, "--lm_eval_tasks", str(TASKS)], "deepspeed", cache_dir, nprocs=2
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--lm_eval_tasks" in proc.stderr and "not supported with tensor, sequence or pipeline" in proc.stderr
    assert "Traceback" not in proc.stderr and not (run_dir / "checkpoints").exists()


def test_the_forward_lockstep_pairs_uneven_forwards_of_zero3_ranks(tmp_path, cache_dir):
    """Rank 0 needs three forwards, rank 1 one: rank 1 stands in for two, and both return (without the lockstep the
    second forward's all-gathers would wait for rank 1 forever)."""
    proc = launch(REPO / "tests" / "helpers" / "lockstep_ranks.py", [str(tmp_path)], "deepspeed", cache_dir, nprocs=2)
    check_ok(proc)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["forwards"], r["stand_ins"]) for r in ranks] == [(3, 0), (1, 2)]
    assert ranks[0]["first"] == ranks[1]["first"]  # the same input, the same logits on both ranks
