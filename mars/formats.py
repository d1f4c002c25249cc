# Data rows -> ChatML messages (docs/method.md §1 trains on chat data): plain chat ("messages"), ShareGPT,
# Alpaca, and tool use in Dolci-Instruct-SFT's schema or OpenAI's, rendered in Qwen2.5's tool-call format. A
# row that cannot be used raises RowError, which data.py counts and skips: one row never aborts a load.
import ast
import io
import json
import keyword
import tokenize

from mars.tokenizer import DEFAULT_SYSTEM, ROLES, TOOLS_HEAD, TOOLS_TAIL

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "observation": "tool", "function_call": "assistant"}
# tool output: Dolci says environment, OpenAI-style data says tool (function in its older API)
TOOL_ROLES = ("environment", "tool", "function")
# an assistant turn's calls: Dolci's function_calls, OpenAI's tool_calls (function_call in its older API)
CALL_KEYS = ("function_calls", "tool_calls", "function_call")
KW_PREFIX = "_kw_"  # stands in for a Python keyword used as an argument name while parsing calls


class RowError(ValueError):
    # A row this loader cannot use (unknown role, null content, ...): it is skipped and counted by
    # its short `reason`; it never aborts the load. A file that cannot be parsed still raises,
    # naming file:line.
    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


# ---- one row -> ChatML messages, Qwen2.5's tool-call format included ----

def _json_literal(node: ast.AST):
    # A call argument written as a Python or JSON literal (true/false/null accepted).
    consts = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    if isinstance(node, ast.List):
        return [_json_literal(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return [_json_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_json_literal(k): _json_literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def parse_function_calls(calls) -> list[dict]:
    # Dolci's `function_calls`: Python-style calls, one per line or in a list,
    # `get_weather(city="Paris", days=3)`. Also JSON, as text or already parsed: {"name", "arguments"} objects
    # or a list of them, or OpenAI's tool_calls ({"function": {...}} entries). -> [{"name", "arguments"}] with
    # JSON-object arguments, as Qwen2.5 writes them; raises ValueError when it is none of these.
    if isinstance(calls, str):
        try:
            data = json.loads(calls)
        except json.JSONDecodeError:
            parsed = python_calls(calls)
        else:
            parsed = json_calls(data)
    else:
        parsed = json_calls(calls)
    try:
        json.dumps(parsed, allow_nan=False)
    except (TypeError, ValueError) as e:  # a Python literal with no JSON form: {1, 2}, b"x", 1j, 1e999, NaN
        raise ValueError(f"an argument is not JSON ({e})") from e
    return parsed


def json_calls(data) -> list[dict]:
    # Llama-style data says "parameters" for "arguments"; OpenAI's gives the arguments as JSON text.
    calls = []
    for c in data if isinstance(data, list) else [data]:
        c = c.get("function", c) if isinstance(c, dict) else c
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise ValueError('expected {"name": ..., "arguments": {...}} objects')
        args = c.get("arguments", c.get("parameters"))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"the arguments of {c['name']} are not valid JSON ({e.msg})") from e
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ValueError(f"the arguments of {c['name']} are not a JSON object")
        calls.append({"name": c["name"], "arguments": args})
    if not calls:
        raise ValueError("no call")
    return calls


def python_calls(text: str) -> list[dict]:
    # Argument names are JSON keys, and some are Python keywords (convert(amount=1, from="EUR")):
    # rename those before parsing, on the token stream, so that string values stay untouched.
    try:
        toks = [(t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(text.strip()).readline)]
        before = ""  # the token before toks[i], past line breaks and comments (a call over several lines)
        for i in range(len(toks) - 1):
            if keyword.iskeyword(toks[i][1]) and toks[i + 1][1] == "=" and before in ("(", ","):
                toks[i] = (tokenize.NAME, KW_PREFIX + toks[i][1])
            if toks[i][0] not in (tokenize.NL, tokenize.COMMENT):
                before = toks[i][1]
        body = ast.parse(tokenize.untokenize(toks)).body
    except (SyntaxError, tokenize.TokenError) as e:
        raise ValueError(f"not Python call syntax: {e}") from e
    nodes = []
    for stmt in body:
        if not isinstance(stmt, ast.Expr):
            raise ValueError("not a call")
        nodes += stmt.value.elts if isinstance(stmt.value, (ast.List, ast.Tuple)) else [stmt.value]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            raise ValueError("expected name(key=value, ...) calls")
        try:
            args = {k.arg.removeprefix(KW_PREFIX): _json_literal(k.value) for k in node.keywords}
        except (TypeError, ValueError, RecursionError) as e:
            raise ValueError(f"an argument is not a literal: {e}") from e
        calls.append({"name": ast.unparse(node.func), "arguments": args})
    if not calls:
        raise ValueError("no call")
    return calls


def tools_system(system: str, tools: list) -> str:
    # Qwen2.5's chat template with tools: the function signatures go into the system turn, one JSON
    # object per line, between the texts that say how to call them (chat_template's twin).
    lines = "".join("\n" + json.dumps(t if "function" in t else {"type": "function", "function": t},
                                      ensure_ascii=False) for t in tools)
    return system + TOOLS_HEAD + lines + TOOLS_TAIL


def _functions(functions, field: str) -> list[dict]:
    # A message's "functions" or a row's "tools": a JSON list of signatures (or one), as text or already parsed.
    # field: where it is, "file:line: messages[0] functions".
    try:
        listed = json.loads(functions) if isinstance(functions, str) else functions
    except json.JSONDecodeError as e:
        raise RowError(f"{field} is not valid JSON ({e.msg})", "functions not JSON") from e
    listed = listed if isinstance(listed, list) else [listed]
    if not all(isinstance(t, dict) for t in listed):
        raise RowError(f"{field} must hold JSON objects (signatures)", "functions not objects")
    return listed


def _with_calls(content: str | None, calls, where: str) -> str:
    # An assistant turn's content with its function calls as Qwen2.5's <tool_call> blocks: "assistant" +
    # ("\n" + content if content) + calls; without content the first call's "\n" is the header's.
    if content is not None and not isinstance(content, str):
        raise RowError(f"{where} content is {type(content).__name__}, expected a string or null beside its calls",
                       f"assistant content {type(content).__name__}")
    try:
        parsed = parse_function_calls(calls)
    except ValueError as e:
        raise RowError(f"{where} calls are not parseable ({e})", "function_calls not parseable") from e
    text = "".join('\n<tool_call>\n{"name": "' + c["name"] + '", "arguments": '
                   + json.dumps(c["arguments"], ensure_ascii=False) + "}\n</tool_call>" for c in parsed)
    return (content + text) if content else text[1:]


def text_of(content):
    # Content as OpenAI's schema also gives it, a list of text parts [{"type": "text", "text": ...}], joined
    # with newlines (as the server takes it: tokenizer.plain_messages); anything else as it is.
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return content


def _chat_messages(messages, where: str, signatures=None) -> tuple[list[dict], str]:
    # Chat rows, plain, in Dolci's schema (content, role, function_calls, functions) or OpenAI's (tool_calls,
    # and the row's tools: `signatures`), rendered the way Qwen2.5's template renders tool use. -> (messages,
    # "chat" or "tools"). Messages carry a "tool_markup" flag where <tool_call> and </tool_call> are Qwen2.5's
    # own tokens.
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects",
                       "empty messages")
    out, kind = [], "chat"
    tools = _functions(signatures, f"{where}: tools") if signatures else []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in (*ROLES, *TOOL_ROLES):
            role = m.get("role") if isinstance(m, dict) else m
            raise RowError(f"{where}: messages[{i}] has role {role!r}; expected system, user, assistant "
                           f"or a tool role ({', '.join(TOOL_ROLES)})", f"role {role!r}")
        role, content = m["role"], text_of(m.get("content"))
        calls = next((m[k] for k in CALL_KEYS if m.get(k) and m[k] != "[]"), None)  # "[]": no call, as JSON text
        weight = m.get("weight")  # OpenAI's fine-tuning schema: 0 keeps an assistant turn as context only
        if role == "assistant" and weight is not None and (isinstance(weight, bool) or weight not in (0, 1)):
            raise RowError(f"{where}: messages[{i}] has weight {weight!r}; expected 0 (not trained) or 1",
                           "bad weight")
        if m.get("functions"):  # a JSON list of signatures, on the system (or a user) message
            tools += _functions(m["functions"], f"{where}: messages[{i}] functions")
        if calls and role == "assistant":
            out.append({"role": "assistant", "content": _with_calls(content, calls, f"{where}: messages[{i}]"),
                        "tool_markup": True, **({"train": False} if weight == 0 else {})})
            kind = "tools"
            continue
        if not isinstance(content, str):
            kind_of = "null" if content is None else type(content).__name__
            raise RowError(f"{where}: messages[{i}] content is {type(content).__name__}, expected a string"
                           + (" (or function_calls)" if role == "assistant" else ""), f"{role} content {kind_of}")
        if role in TOOL_ROLES:  # Qwen2.5: tool output is a user turn; consecutive outputs share it
            kind = "tools"
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_response"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_response": True, "tool_markup": True})
            continue
        out.append({"role": role, "content": content})
        if role == "assistant" and (weight == 0 or not content.strip()):  # an empty reply would teach <|im_end|>
            out[-1]["train"] = False  # context, not a target (tokenizer.encode_chat_with_mask)
    if tools:
        kind = "tools"
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": tools_system(out[0]["content"], tools), "tool_markup": True}
        else:
            out.insert(0, {"role": "system", "content": tools_system(DEFAULT_SYSTEM, tools), "tool_markup": True})
    for m in out:
        m.pop("tool_response", None)
    return out, kind


def row_messages(row: dict, where: str) -> tuple[list[dict], str]:
    # One data row -> ([{"role", "content"}, ...], "chat" or "tools"). Accepts chat ("messages", also with
    # tool calls in Dolci's schema or OpenAI's), ShareGPT ("conversations" of {"from", "value"}) and Alpaca
    # ("instruction", "input", "output", and LLaMA-Factory's "history" of earlier [prompt, reply] pairs).
    # Beside the turns a row may carry its "system" prompt and its "tools" (LLaMA-Factory, OpenAI). A key
    # that is null is absent: a file that mixes the formats (pandas, parquet) has every format's keys in
    # every row. Raises RowError for a row it cannot use.
    if not isinstance(row, dict):
        hint = "; a file that is one JSON array of rows is read as one when named .json" * isinstance(row, list)
        raise RowError(f"{where}: expected a JSON object, got {type(row).__name__}{hint}", "not an object")
    if row.get("messages") is not None:
        messages = row["messages"]
    elif row.get("conversations") is not None:
        messages = _sharegpt(row["conversations"], where)
    elif row.get("instruction") is not None:
        messages = _alpaca(row, where)
    elif "messages" in row:
        messages = None  # an empty row of chat data: said so below
    else:
        raise RowError(f"{where}: no 'messages' (chat), 'conversations' (ShareGPT) or "
                       f"'instruction' + 'output' (Alpaca) key; keys are {sorted(row)[:8]}", "unknown format")
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise RowError(f"{where}: 'system' is {type(system).__name__}, expected a string", "bad system")
    if system and isinstance(messages, list):  # an empty one means the default, as LLaMA-Factory reads it
        first = messages[0] if messages and isinstance(messages[0], dict) else {}
        if first.get("role") == "system" and first.get("content") != system:
            raise RowError(f"{where}: a 'system' key and a system turn that differ; keep one", "two system prompts")
        if first.get("role") != "system":
            messages = [{"role": "system", "content": system}, *messages]
    return _chat_messages(messages, where, row.get("tools"))


def _sharegpt(turns, where: str) -> list[dict]:
    # LLaMA-Factory's tool turns: function_call (its value a JSON call) and observation (the tool's output).
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise RowError(f"{where}: 'conversations' must be a list of {{'from', 'value'}} objects", "bad conversations")
    for i, t in enumerate(turns):
        if not isinstance(t.get("from"), str) or t["from"] not in SHAREGPT_ROLES:
            raise RowError(f"{where}: conversations[{i}] has from={t.get('from')!r}; expected "
                           f"one of {', '.join(SHAREGPT_ROLES)}", f"from={t.get('from')!r}")
    return [{"role": "assistant", "content": None, "function_calls": t.get("value"), "weight": t.get("weight")}
            if t["from"] == "function_call"
            else {"role": SHAREGPT_ROLES[t["from"]], "content": t.get("value"), "weight": t.get("weight")}
            for t in turns]


def _alpaca(row: dict, where: str) -> list[dict]:
    if row.get("output") is None:  # another schema with an instruction (Dolly's "response"), or a reply missing
        raise RowError(f"{where}: an Alpaca row ('instruction') needs its 'output'; keys are {sorted(row)[:8]}",
                       "Alpaca row without output")
    prompt, extra, history = row["instruction"], row.get("input") or "", row.get("history") or []
    if not isinstance(prompt, str) or not isinstance(extra, str):
        raise RowError(f"{where}: Alpaca 'instruction' and 'input' must be strings", "bad Alpaca row")
    if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2 for h in history):
        raise RowError(f"{where}: Alpaca 'history' must be a list of [prompt, reply] pairs", "bad Alpaca row")
    earlier = [{"role": role, "content": text} for pair in history for role, text in zip(("user", "assistant"), pair)]
    user = f"{prompt}\n\n{extra}" if extra else prompt  # the Alpaca convention
    return [*earlier, {"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def to_messages(row: dict, where: str) -> list[dict]:
    return row_messages(row, where)[0]
