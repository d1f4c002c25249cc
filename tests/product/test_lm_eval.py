# tools/lm_eval_mars.py: the lm-evaluation-harness model "mars", run by the harness itself on local
# YAML tasks over a local JSONL file. Generation answers must be generate.py's (cut at the task's
# stop sequences), loglikelihoods the model's own float32 log-softmax sums.
import dataclasses
import json

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import generate
from conftest import tiny_checkpoint
from tools import lm_eval_mars
from tools.lm_eval_mars import MarsLM, stop_at

QUESTIONS = ["What is 12 + 7?", "Name a colour.", "Spell cat backwards.", "Count to three."]
TEXTS = ["The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun for an hour.",
         "short one"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # A tiny random model on the byte-level tokenizer, weights spread and the embedding scaled up so
    # that some slots pass tau = 0.9: steps accept several tokens, not just one.
    root = tmp_path_factory.mktemp("lm_eval")
    model, tok = tiny_checkpoint(root / "ckpt", max_position_embeddings=256)
    return root, model, tok


def reference(ckpt, capsys, *flags) -> list[dict]:
    # generate.py's own answers to QUESTIONS, from its --json lines.
    root, _, _ = ckpt
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS))
    capsys.readouterr()
    generate.main(["--ckpt", str(root / "ckpt"), "--prompts", str(root / "prompts.jsonl"), "--json",
                   "--max-new-tokens", str(MAX_NEW), "--threshold", "0.9", "--device", "cpu", *flags])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return rows[:-1]  # the last line is the summary


def write_tasks(root, until: list[str]) -> TaskManager:
    # Three local tasks over local JSONL files: generation, multiple choice, rolling loglikelihood.
    # YAML written as JSON (a subset of YAML), so any stop string survives quoting.
    items = root / "items.jsonl"
    items.write_text("".join(json.dumps({"question": q, "answer": "x", "choices": ["yes", "no", "maybe so"],
                                         "label": i % 3}) + "\n" for i, q in enumerate(QUESTIONS)))
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    common = {"dataset_path": "json", "test_split": "test", "doc_to_text": "{{question}}"}
    configs = {
        "mars_gen": {**common, "dataset_kwargs": {"data_files": {"test": str(items)}}, "output_type": "generate_until",
                     "doc_to_target": "{{answer}}", "metric_list": [{"metric": "exact_match"}],
                     "generation_kwargs": {"until": until, "max_gen_toks": MAX_NEW, "do_sample": False}},
        "mars_mc": {**common, "dataset_kwargs": {"data_files": {"test": str(items)}}, "output_type": "multiple_choice",
                    "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]},
        "mars_ppl": {**common, "dataset_kwargs": {"data_files": {"test": str(root / "texts.jsonl")}},
                     "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                     "metric_list": [{"metric": "word_perplexity"}]},
    }
    for name, config in configs.items():
        (tasks / f"{name}.yaml").write_text(json.dumps({"task": name, **config}, indent=1))
    return TaskManager(include_path=str(tasks))


def evaluate(ckpt, tasks: TaskManager, names: list[str], chat: bool = False, **model_args) -> dict:
    root, _, _ = ckpt
    args = {"ckpt": str(root / "ckpt"), "threshold": 0.9, "block_size": 4, "device": "cpu", "dtype": "float32",
            "max_length": 64, **model_args}
    return lm_eval.simple_evaluate(model="mars", model_args=args, tasks=names, task_manager=tasks, batch_size=8,
                                   log_samples=True, apply_chat_template=chat, bootstrap_iters=0)


def own_logprob(model, context: list[int], target: list[int]) -> tuple[float, bool]:
    with torch.no_grad():
        logits = model(torch.tensor([context + target]))[0, len(context) - 1:-1].float()  # (n, V)
    t = torch.tensor(target)
    return logits.log_softmax(-1).gather(-1, t[:, None]).sum().item(), bool((logits.argmax(-1) == t).all())


def test_harness_answers_are_generate_py_answers_and_loglikelihoods_the_models(ckpt, capsys):
    root, model, tok = ckpt
    ref = reference(ckpt, capsys, "--raw")
    texts = [r["text"] for r in ref]
    assert sum(len(r["output_ids"]) for r in ref) > sum(r["forwards"] for r in ref)  # several tokens a step
    # Stop sequences: two ASCII characters from the second half of the first answer (so one cuts it
    # there, or wherever it occurs first), and one that never occurs.
    stop = next(texts[0][i:i + 2] for i in range(len(texts[0]) // 2, len(texts[0]) - 1)
                if texts[0][i:i + 2].isascii() and texts[0][i:i + 2].isprintable())
    until = ["never-in-any-answer", stop]
    out = evaluate(ckpt, write_tasks(root, until), ["mars_gen", "mars_mc", "mars_ppl"])
    samples = out["samples"]

    gen = sorted(samples["mars_gen"], key=lambda s: s["doc_id"])
    assert [s["arguments"][0][0] for s in gen] == QUESTIONS  # the prompt is the bare question
    answers = [s["resps"][0][0] for s in gen]
    assert answers == [stop_at(t, until) for t in texts]
    assert answers[0] == texts[0][:texts[0].index(stop)] and len(answers[0]) < len(texts[0])  # it did cut

    for s in samples["mars_mc"]:
        for (context, continuation), ((logp, greedy),) in zip(s["arguments"], s["resps"]):
            ctx, whole = tok.encode(context), tok.encode(context + continuation)
            want = own_logprob(model, ctx, whole[len(ctx):])
            assert logp == pytest.approx(want[0], abs=1e-4) and greedy == want[1]
    for s in samples["mars_ppl"]:
        text = s["arguments"][0][0]
        assert len(tok.encode(text)) > 64 or text == TEXTS[1]  # the long text needs two windows of 64
        want = sum(own_logprob(model, *make_disjoint_window(w))[0]
                   for w in get_rolling_token_windows(tok.encode(text), tok.eos_id, 64, 1))
        assert s["resps"][0][0] == pytest.approx(want, abs=1e-4)


def instances(gen_kwargs: dict) -> list[Instance]:
    return [Instance("generate_until", {}, (q, gen_kwargs), i, ("t", i, 1)) for i, q in enumerate(QUESTIONS)]


def test_sampling_follows_generate_py_with_the_same_seed(ckpt, capsys):
    root, _, _ = ckpt
    texts = [r["text"] for r in reference(ckpt, capsys, "--raw", "--temperature", "0.8", "--seed", "3")]
    lm = MarsLM(ckpt=str(root / "ckpt"), threshold=0.9, device="cpu", dtype="float32", seed=3, temperature=0.8)
    greedy = MarsLM(ckpt=str(root / "ckpt"), threshold=0.9, device="cpu", dtype="float32")
    assert lm.generate_until(instances({"until": [], "max_gen_toks": MAX_NEW})) == texts
    assert greedy.generate_until(instances({"until": [], "max_gen_toks": MAX_NEW})) != texts  # sampling mattered
    assert lm.stats["t"]["requests"] == 4 and lm.stats["t"]["forwards"] > 0


def test_verify_answers_are_greedy_ar_answers(ckpt):
    # docs/method.md §9: verification emits only greedy tokens, so its answers are tau = 1's, whatever the drafts.
    root, _, _ = ckpt
    kw = {"ckpt": str(root / "ckpt"), "device": "cpu", "dtype": "float32"}
    ar = MarsLM(**kw, threshold=1.0).generate_until(instances({"until": [], "max_gen_toks": MAX_NEW}))
    for layout in ("tree", "chain"):
        lm = MarsLM(**kw, verify=True, verify_layout=layout)
        assert lm.generate_until(instances({"until": [], "max_gen_toks": MAX_NEW})) == ar, layout


def test_verify_is_passed_through(ckpt, monkeypatch):
    root, _, _ = ckpt
    seen, decode = [], generate.decode

    def with_verify(model, prompts, mask_id, stop_ids, opts, *args):  # records the option, then decodes
        seen.append(opts.verify)
        return decode(model, prompts, mask_id, stop_ids, opts, *args)
    monkeypatch.setattr(generate, "decode", with_verify)
    lm = MarsLM(ckpt=str(root / "ckpt"), verify=True, device="cpu")
    lm.generate_until(instances({"until": [], "max_gen_toks": 4}))
    MarsLM(ckpt=str(root / "ckpt"), device="cpu").generate_until(instances({"until": [], "max_gen_toks": 4}))
    assert seen == [True, False]
    # a task asking for more tokens than the context holds decodes to the context's end, no position past it
    seen.clear()
    monkeypatch.setattr(generate, "decode", lambda model, prompts, m, st, opts, *a: seen.append(
        (len(prompts[0]), opts.max_new_tokens)) or decode(model, prompts, m, st, opts, *a))
    MarsLM(ckpt=str(root / "ckpt"), device="cpu").generate_until(instances({"until": [], "max_gen_toks": 300}))
    assert seen and all(p + n <= 256 for p, n in seen)
    monkeypatch.setattr(generate, "Options", dataclasses.make_dataclass("Options", [("tau", float, 0.9)]))  # no field
    with pytest.raises(ValueError, match="verify=true needs generate.Options"):
        MarsLM(ckpt=str(root / "ckpt"), verify=True, device="cpu")


@pytest.mark.parametrize("args, match", [
    ({"thresold": 0.9}, "unknown thresold; the settings are"),
    ({"threshold": 1.5}, r"threshold=1.5 must be in \[0, 1\]"),
    ({"cache": "paged"}, "cache='paged'; choose one of none, cursor, block"),
    ({"verify": True, "cache": "block"}, "verify=true needs cache=none or cache=cursor"),
    ({"block_size": 2.5}, "block_size=2.5 is not an integer"),
    ({"block_size": 64}, "block_size 1 to 32"),
    ({"batch_size": "auto"}, None),  # the harness's automatic size: ours stays a plain number
    ({"batch_size": "16"}, None),
    ({"verify": "yes"}, "verify='yes'; write true or false"),
])
def test_bad_model_args(args, match):
    if match is None:
        assert lm_eval_mars.parse_settings(args).batch_size == (16 if args["batch_size"] == "16" else 8)
        return
    with pytest.raises(ValueError, match=match):
        lm_eval_mars.parse_settings(args)


def test_unsupported_generation_setting(ckpt):
    root, _, _ = ckpt
    lm = MarsLM(ckpt=str(root / "ckpt"), device="cpu")
    with pytest.raises(ValueError, match="task t sets top_k, which generate.decode does not have"):
        lm.generate_until(instances({"until": [], "top_k": 5}))


def test_cli_with_chat_template_answers_as_generate_py_chat(ckpt, tmp_path, capsys):
    # lm-eval's own CLI through the wrapper that registers "mars", with the chat template: the answers
    # are generate.py's chat-mode answers (a rendered user message), here with no stop sequence.
    root, _, _ = ckpt
    texts = [r["text"] for r in reference(ckpt, capsys)]
    write_tasks(root, [])
    lm_eval_mars.main(["--model", "mars", "--model_args", f"ckpt={root / 'ckpt'},threshold=0.9,dtype=float32",
                       "--device", "cpu", "--batch_size", "8", "--tasks", "mars_gen", "--include_path",
                       str(root / "tasks"), "--apply_chat_template", "--log_samples", "--output_path",
                       str(tmp_path / "out")])
    result = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert "mars_gen" in result["results"] and result["config"]["model"] == "mars"
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_mars_gen_*.jsonl")).open()]
    assert [s["resps"][0][0] for s in sorted(samples, key=lambda s: s["doc_id"])] == texts
    err = capsys.readouterr().err
    assert "mars: task mars_gen: 4 requests" in err and "tokens/forward" in err and "tokens/s" in err
