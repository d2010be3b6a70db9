"""The lm-evaluation-harness wing's parts on their own: the tasks looked up (real TaskManager, the local tasks of
tests/fixtures/lm_eval), lm-eval's results as metric names and a log line, and an evaluation that leaves the
training's random state and module mode as they were."""

from __future__ import annotations

import json
import random
import sys

import pytest

from scaletrain.errors import UsageError
from scaletrain.harness.results import flatten, summary
from scaletrain.harness.scoring import training_untouched
from scaletrain.harness.tasks import INSTALL_COMMAND, resolve_tasks
from tests.harness import REPO

TASKS = REPO / "tests" / "fixtures" / "lm_eval"


def test_results_become_one_metric_per_task_and_metric_with_the_stderr_beside():
    results = {
        "results": {
            "arc": {"alias": "arc", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.25},
            "wiki": {"word_perplexity,none": 12.5, "word_perplexity_stderr,none": "N/A"},
            "gsm8k": {"exact_match,strict-match": 0.125, "exact_match_stderr,strict-match": 0.02},
        },
        "groups": {"mmlu": {"acc,none": 0.3, "acc_stderr,none": 0.01}},
    }
    assert flatten(results) == {
        "lm_eval/arc/acc": 0.5,
        "lm_eval/arc/acc_stderr": 0.1,
        "lm_eval/arc/acc_norm": 0.25,
        "lm_eval/wiki/word_perplexity": 12.5,
        "lm_eval/gsm8k/exact_match_strict-match": 0.125,
        "lm_eval/gsm8k/exact_match_strict-match_stderr": 0.02,
        "lm_eval/mmlu/acc": 0.3,
        "lm_eval/mmlu/acc_stderr": 0.01,
    }
    line = summary(flatten(results), 40, 12.34)
    assert line.startswith("lm-eval at step 40: arc acc 0.5 ± 0.1, wiki word_perplexity 12.5, ") and "(12.3 s)" in line


def test_a_folder_of_task_files_is_every_task_in_it_with_its_documents():
    tasks = resolve_tasks((str(TASKS),))
    assert [spec.rsplit("/", 1)[1] for spec in tasks.specs] == [
        "docstring_generation.yaml",
        "docstring_module.yaml",
        "docstring_perplexity.yaml",
    ]
    assert tasks.documents == {"docstring_generation": 12, "docstring_module": 40, "docstring_perplexity": 20}
    limited = resolve_tasks((str(TASKS / "docstring_module.yaml"),), limit=7, ranks=2)
    assert limited.documents == {"docstring_module": 7}


def test_a_task_with_fewer_documents_than_ranks_is_refused_naming_it():
    with pytest.raises(UsageError, match="task docstring_module scores 3 document.*fewer than the 4 ranks"):
        resolve_tasks((str(TASKS / "docstring_module.yaml"),), limit=3, ranks=4)


def test_a_folder_without_task_files_is_refused(tmp_path):
    with pytest.raises(UsageError, match="is a folder without task YAML files"):
        resolve_tasks((str(tmp_path),))


def test_without_lm_eval_installed_the_error_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what an environment without the package imports: nothing
    with pytest.raises(UsageError) as caught:
        resolve_tasks(("arc_easy",))
    assert "lm-evaluation-harness is not installed" in str(caught.value) and INSTALL_COMMAND in caught.value.hint


def test_an_evaluation_leaves_the_random_state_and_the_module_mode_as_they_were():
    """lm-eval reseeds Python's, NumPy's and torch's generators at every call: a run that evaluates must draw the
    same numbers afterwards as one that does not."""
    import numpy as np
    import torch

    module = torch.nn.Linear(2, 2).train()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    with training_untouched(module):
        assert not module.training
        random.seed(0), np.random.seed(0), torch.manual_seed(0)  # what simple_evaluate does
        random.random(), np.random.rand(), torch.rand(1)
    drawn = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    assert drawn == (random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert module.training


def test_every_forward_of_an_evaluation_is_progress_for_the_hang_watch(tmp_path):
    """The live model as lm-eval's LM tells its progress callback (the hang watch's phase, in a run) of each forward
    and request type, so a long evaluation that progresses is never taken for a hang; results land in lm_eval/."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from scaletrain.config import HarnessArgs
    from scaletrain.harness.live_model import engine_lm
    from scaletrain.harness.scoring import score

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "data" / "tiny-llama")).train()
    notes = []
    lm = engine_lm(model, AutoTokenizer.from_pretrained(REPO / "data" / "tiny-llama"), 8, progress=notes.append)
    args = HarnessArgs(lm_eval_tasks=str(TASKS / "docstring_module.yaml"), lm_eval_limit=8)
    scores = score(lm, tasks=resolve_tasks(args.task_specs, 8), args=args, out_dir=tmp_path, name="step3", step=3)
    assert model.training  # back in training mode
    assert notes[0] == "loglikelihood, 32 requests"  # 8 items x 4 choices
    assert sum(note.startswith("forward of (") for note in notes) == 4  # 32 requests, 8 a forward
    assert set(scores.metrics) >= {"lm_eval/docstring_module/acc", "lm_eval/docstring_module/acc_norm"}
    assert json.loads((tmp_path / "lm_eval" / "step3.json").read_text())["results"]["docstring_module"]["alias"]
