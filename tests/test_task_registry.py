"""The task registry: a task defined outside the package, with its own options, runs end to end through the CLI and
``run_eval``; option names shared between tasks agree or are refused at registration."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from hf_kvcache.cli import build_parser, main
from hf_kvcache.eval import EvalConfig, run_eval
from hf_kvcache.eval.tasks import TASKS, Task, register_task
from hf_kvcache.eval.tasks.base import model_context

torch.set_num_threads(1)

PREFILL = 16
REF = ["--model", "reference", "--threads", "1", "--quiet"]


@dataclass
class NextTokenOptions:
    my_option: int = field(default=32, metadata={"help": "tokens predicted through the cache"})
    samples: int = field(default=2, metadata={"help": "streams per cache"})  # shared with passkey and repeat

    def validate(self) -> None:
        if not isinstance(self.my_option, int) or self.my_option < 1:
            raise ValueError(f"--my-option must be an integer >= 1, got {self.my_option!r}")


class NextTokenTask(Task):
    """Top-1 next-token accuracy, one token per forward through the cache after a short prefill."""

    name = "mytask"
    title = "Next-token accuracy through the cache"
    options = NextTokenOptions
    summary_keys = ("accuracy",)

    def units(self, config) -> int:
        return config.my_option * config.samples

    def check_model(self, config, model_config) -> None:
        limit = model_context(model_config)
        if limit and PREFILL + config.my_option > limit:
            raise ValueError(f"--my-option {config.my_option}: past the model's context ({limit} tokens)")

    def tokens_needed(self, config) -> int:
        return (PREFILL + config.my_option + 1) * config.samples

    @torch.inference_mode()
    def run(self, data, spec, config, progress=None) -> dict:
        from hf_kvcache import make_cache

        n = PREFILL + config.my_option + 1
        correct = 0
        for sample in range(config.samples):
            ids = data.ids[sample * n : (sample + 1) * n].to(data.device)[None]
            cache = make_cache(spec, data.model)
            logits = data.model(input_ids=ids[:, :PREFILL], past_key_values=cache).logits[:, -1]
            for t in range(PREFILL, n - 1):
                correct += int(logits.argmax(-1).item() == ids[0, t].item())
                logits = data.model(input_ids=ids[:, t : t + 1], past_key_values=cache).logits[:, -1]
                if progress is not None:
                    progress(1)
        accuracy = correct / (config.my_option * config.samples)
        return {"task": self.name, "correct": correct, "summary": {"accuracy": accuracy}}

    def table(self, results: dict) -> str:
        from hf_kvcache.eval.report import markdown_table

        rows = [[e["cache"], f"{100 * e[self.name]['summary']['accuracy']:.1f}%"] for e in results["results"]]
        return markdown_table(["cache", "accuracy"], rows)


@pytest.fixture
def mytask():
    register_task(NextTokenTask)
    yield TASKS["mytask"]
    del TASKS["mytask"]


def full_forward_accuracy(model, tokenizer, my_option: int, samples: int) -> float:
    from hf_kvcache.eval.data import load_text
    from hf_kvcache.eval.runner import tokenize

    n = PREFILL + my_option + 1
    ids = tokenize(tokenizer, load_text()[: 16 * n * samples])[: n * samples].view(samples, n)
    with torch.no_grad():
        predicted = model(input_ids=ids).logits.argmax(-1)
    hits = predicted[:, PREFILL - 1 : n - 2] == ids[:, PREFILL : n - 1]
    return hits.float().mean().item()


def test_an_out_of_tree_task_runs_through_the_cli(mytask, reference, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["eval", *REF, "--task", "mytask", "--my-option", "24", "--caches", "dynamic,int2:residual_length=0"]
    assert main([*argv, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "**Next-token accuracy through the cache**" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["task"] == ["mytask"] and results["config"]["my_option"] == 24
    assert "lengths" not in results["config"]  # only the options of the tasks that ran
    accuracy = {e["cache"]: e["mytask"]["summary"]["accuracy"] for e in results["results"]}
    # Through DynamicCache, token by token, it predicts what one full forward predicts.
    assert accuracy["dynamic"] == pytest.approx(full_forward_accuracy(*reference, my_option=24, samples=2))
    assert "Next-token accuracy through the cache" in (out / "report.md").read_text()


def test_an_out_of_tree_task_runs_through_run_eval_with_a_shared_option(mytask, reference):
    model, tokenizer = reference
    config = EvalConfig(task=["mytask", "passkey"], caches="dynamic", my_option=8, samples=1, lengths=[256])
    config.quiet = True
    assert config.options["mytask"].samples == config.options["passkey"].samples == 1  # one option, both tasks
    results = run_eval(config, model, tokenizer)
    entry = results["results"][0]
    assert entry["mytask"]["summary"]["accuracy"] == pytest.approx(
        full_forward_accuracy(model, tokenizer, my_option=8, samples=1)
    )
    assert sum(c["samples"] for c in entry["passkey"]["cells"]) == 2  # 1 length x 2 depths x 1 sample
    assert results["config"]["my_option"] == 8 and results["config"]["lengths"] == (256,)


def test_its_flags_are_in_the_help_and_checked_before_the_model_loads(mytask, capsys, monkeypatch):
    import hf_kvcache.eval.runner as runner

    help_text = build_parser()._subparsers._group_actions[0].choices["eval"].format_help()
    assert "mytask task options" in help_text and "--my-option N" in help_text
    assert "mytask: streams per cache" in help_text  # the shared --samples names every owner
    monkeypatch.setattr(runner, "load_configured_model", lambda config: pytest.fail("the model was loaded"))
    for argv, message in [
        (["--task", "mytask", "--my-option", "0"], "--my-option must be an integer >= 1, got 0"),
        (["--task", "mytask", "--my-option", "x"], "--my-option"),
        (["--task", "perplexity", "--my-option", "3"], "--my-option is an option of --task mytask"),
    ]:
        assert main(["eval", "--quiet", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_its_check_against_the_model_runs_before_the_first_document(mytask, capsys, monkeypatch):
    monkeypatch.setattr(NextTokenTask, "run", lambda *a, **k: pytest.fail("a document ran"))
    assert main(["eval", *REF, "--task", "mytask", "--my-option", "3000"]) == 2
    err = capsys.readouterr().err
    assert "--my-option 3000: past the model's context (2048 tokens)" in err and len(err.strip().splitlines()) == 1


def _task(name: str, options: type) -> type[Task]:
    return type(f"Task_{name}", (Task,), {"name": name, "options": options})


@pytest.mark.parametrize(
    "annotation, default, help_text, message",
    [
        ("tuple[float, ...]", (1.0,), "lengths", "also an option of task 'passkey'"),  # passkey: tuple[int, ...]
        ("tuple[int, ...]", (64,), "lengths", "also an option of task 'passkey'"),  # same type, another default
        ("int", 3, "samples", "also an option of task"),
        ("str", "x", "model", "taken by --model"),
        ("str", "x", "output", "taken by the CLI"),
        ("str", "x", "validate", "taken by EvalConfig"),
        ("dict", None, "table", "cannot be a flag"),
        ("int", 1, None, "has no metadata['help']"),
    ],
)
def test_bad_options_are_refused_at_registration(annotation, default, help_text, message):
    name = help_text or "nohelp"
    metadata = {"help": "something"} if help_text else {}
    namespace = {"__annotations__": {name: annotation}, name: field(default=default, metadata=metadata)}
    options = dataclass(type("BadOptions", (), namespace))
    before = dict(TASKS)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        register_task(_task("bad", options))
    assert TASKS == before
    assert build_parser().parse_args(["eval", "--lengths", "64", "--samples", "1"]).lengths == (64,)


def test_duplicate_names_and_non_tasks_are_refused(mytask):
    with pytest.raises(ValueError, match="already registered"):
        register_task(NextTokenTask)
    with pytest.raises(ValueError, match="Task subclass"):
        register_task(NextTokenOptions)
    with pytest.raises(ValueError, match="name without commas"):
        register_task(_task("a,b", None))


def test_the_config_reads_every_registered_task_and_refuses_unknown_keywords(mytask):
    config = EvalConfig(task="mytask", my_option=5, samples=3, lengths=[300, 600])
    assert (config.my_option, config.samples, config.lengths, config.task) == (5, 3, (300, 600), ("mytask",))
    assert config.options["repeat"].samples == 3
    config.samples = 4
    assert config.options["passkey"].samples == config.options["mytask"].samples == 4
    assert config.replace(my_option=7).my_option == 7 and config.my_option == 5
    assert EvalConfig.from_dict(config.as_dict() | {"no_such_option": 1}).as_dict() == config.as_dict()
    with pytest.raises(TypeError, match="unknown option"):
        EvalConfig(my_opton=5)


@pytest.mark.parametrize("flag", ["stepwise", "separate_prefill"])
def test_the_run_switches_refuse_anything_but_true_or_false(flag):
    for value in (True, False):
        EvalConfig(**{flag: value}).validate()
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} must be True or False, got 'yes'"):
        EvalConfig(**{flag: "yes"}).validate()
