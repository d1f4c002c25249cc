# The vLLM side of tools/vllm_check.py. It runs in .venv-vllm (vLLM's CPU build), so it imports vLLM and
# the standard library only, none of the project's modules. One job per process: vLLM's counters are
# process-wide, so a second engine in the same process would add its drafts to the first one's.
#
#   .venv-vllm/bin/python -m tools.vllm_engine JOB.json OUT.json
#
# JOB: {"model": DIR, "dtype": "float32", "prompts": [[ids], ...], "max_tokens": N, "max_model_len": L,
#       "speculative_config": {...} or null, "chats": [[messages], ...]}
# OUT: {"outputs": [[ids], ...], "chat_ids": [[ids], ...], "drafts": n, "accepted_per_position": [...]}
from __future__ import annotations

import json
import sys


def main(job_file: str, out_file: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.metrics.reader import Counter, Vector

    job = json.loads(open(job_file).read())
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], enforce_eager=True, seed=0,
              speculative_config=job["speculative_config"], disable_log_stats=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    outputs = []
    for ids in job["prompts"]:  # one prompt at a time: a batch of one, as our decoder runs them
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy, use_tqdm=False)[0]
        outputs.append(list(out.outputs[0].token_ids))
    # vLLM's own chat rendering of the same messages: the ids its server would feed
    tok = llm.get_tokenizer()
    chat_ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
                for m in job["chats"]]
    drafts, per_position = 0, []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts" and isinstance(m, Counter):
            drafts += m.value
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and isinstance(m, Vector):
            per_position = [a + b for a, b in zip(per_position, m.values)] if per_position else list(m.values)
    result = {"outputs": outputs, "chat_ids": [list(c) for c in chat_ids], "drafts": drafts,
              "accepted_per_position": per_position}
    open(out_file, "w").write(json.dumps(result) + "\n")


USAGE = "usage: .venv-vllm/bin/python -m tools.vllm_engine JOB.json OUT.json  (run by tools/vllm_check.py)"

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    main(*sys.argv[1:])
