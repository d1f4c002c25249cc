# Data rows -> ChatML messages (docs/method.md §1 trains on chat data): plain chat ("messages"), ShareGPT,
# Alpaca, and Dolci-Instruct-SFT's schema with tool use, rendered in Qwen2.5's tool-call format. A row
# that cannot be used raises RowError, which data.py counts and skips: one row never aborts a load.
import ast
import io
import json
import keyword
import tokenize

from mars.tokenizer import DEFAULT_SYSTEM, ROLES

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant"}
TOOL_ROLES = ("environment", "tool")  # tool output: Dolci says environment, OpenAI-style data says tool
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


def parse_function_calls(text: str) -> list[dict]:
    # Dolci's `function_calls`: Python-style calls, one per line or in a list,
    # `get_weather(city="Paris", days=3)`; JSON ({"name", "arguments"} or a list of them) is also
    # accepted. -> [{"name", "arguments"}]; raises ValueError when it is neither.
    try:
        data = json.loads(text)
        calls = data if isinstance(data, list) else [data]
        if calls and all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return [{"name": c["name"], "arguments": c.get("arguments") or {}} for c in calls]
    except json.JSONDecodeError:
        pass
    # Argument names are JSON keys, and some are Python keywords (convert(amount=1, from="EUR")):
    # rename those before parsing, on the token stream, so that string values stay untouched.
    try:
        toks = [(t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(text.strip()).readline)]
        for i in range(1, len(toks) - 1):
            if keyword.iskeyword(toks[i][1]) and toks[i + 1][1] == "=" and toks[i - 1][1] in ("(", ","):
                toks[i] = (tokenize.NAME, KW_PREFIX + toks[i][1])
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


def _tools_system(system: str, tools: list) -> str:
    # Qwen2.5's chat template with tools: the function signatures go into the system turn, one JSON
    # object per line, followed by the instruction on how to call them.
    lines = "".join("\n" + json.dumps(t if "function" in t else {"type": "function", "function": t},
                                      ensure_ascii=False) for t in tools)
    return (f"{system}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>{lines}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _functions(functions, where: str) -> list[dict]:
    # A message's "functions": a JSON list of signatures (or one), as text or already parsed.
    try:
        listed = json.loads(functions) if isinstance(functions, str) else functions
    except json.JSONDecodeError as e:
        raise RowError(f"{where} functions is not valid JSON ({e.msg})", "functions not JSON") from e
    listed = listed if isinstance(listed, list) else [listed]
    if not all(isinstance(t, dict) for t in listed):
        raise RowError(f"{where} functions must hold JSON objects (signatures)", "functions not objects")
    return listed


def _with_calls(content: str | None, calls, where: str) -> str:
    # An assistant turn's content with its function calls as Qwen2.5's <tool_call> blocks: "assistant" +
    # ("\n" + content if content) + calls; without content the first call's "\n" is the header's.
    try:
        parsed = parse_function_calls(calls)
    except ValueError as e:
        raise RowError(f"{where} function_calls is not parseable ({e})", "function_calls not parseable") from e
    text = "".join('\n<tool_call>\n{"name": "' + c["name"] + '", "arguments": '
                   + json.dumps(c["arguments"], ensure_ascii=False) + "}\n</tool_call>" for c in parsed)
    return (content + text) if content else text[1:]


def _chat_messages(messages, where: str) -> tuple[list[dict], str]:
    # Chat rows, plain or in Dolci's schema (content, role, function_calls, functions), rendered the
    # way Qwen2.5's template renders tool use. -> (messages, "chat" or "tools"). Messages carry a
    # "tool_markup" flag where <tool_call> and </tool_call> are Qwen2.5's own tokens.
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects",
                       "empty messages")
    out, tools, kind = [], [], "chat"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in (*ROLES, *TOOL_ROLES):
            role = m.get("role") if isinstance(m, dict) else m
            raise RowError(f"{where}: messages[{i}] has role {role!r}; expected system, user, assistant "
                           f"or a tool role ({', '.join(TOOL_ROLES)})", f"role {role!r}")
        role, content, calls = m["role"], m.get("content"), m.get("function_calls")
        if m.get("functions"):  # a JSON list of signatures, on the system (or a user) message
            tools += _functions(m["functions"], f"{where}: messages[{i}]")
        if calls and role == "assistant":
            out.append({"role": "assistant", "content": _with_calls(content, calls, f"{where}: messages[{i}]"),
                        "tool_markup": True})
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
                out.append({"role": "user", "content": response, "tool_response": True})
            continue
        out.append({"role": role, "content": content})
    if tools:
        kind = "tools"
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": _tools_system(out[0]["content"], tools), "tool_markup": True}
        else:
            out.insert(0, {"role": "system", "content": _tools_system(DEFAULT_SYSTEM, tools), "tool_markup": True})
    for m in out:
        m.pop("tool_response", None)
    return out, kind


def row_messages(row: dict, where: str) -> tuple[list[dict], str]:
    # One data row -> ([{"role", "content"}, ...], "chat" or "tools"). Accepts chat ("messages",
    # also in Dolci's schema with tool calls), ShareGPT ("conversations" of {"from", "value"}) and
    # Alpaca ("instruction", "input", "output"). Raises RowError for a row it cannot use.
    if not isinstance(row, dict):
        raise RowError(f"{where}: expected a JSON object, got {type(row).__name__}", "not an object")
    if "messages" in row:
        return _chat_messages(row["messages"], where)
    if "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise RowError(f"{where}: 'conversations' must be a list of {{'from', 'value'}} objects",
                           "bad conversations")
        for i, t in enumerate(turns):
            if t.get("from") not in SHAREGPT_ROLES:
                raise RowError(f"{where}: conversations[{i}] has from={t.get('from')!r}; expected "
                               f"one of {', '.join(SHAREGPT_ROLES)}", f"from={t.get('from')!r}")
        messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": t.get("value")} for t in turns]
        return _chat_messages(messages, where)
    if "instruction" in row and "output" in row:
        prompt, extra = row["instruction"], row.get("input") or ""
        if not isinstance(prompt, str) or not isinstance(extra, str):
            raise RowError(f"{where}: Alpaca 'instruction' and 'input' must be strings", "bad Alpaca row")
        user = f"{prompt}\n\n{extra}" if extra else prompt  # the Alpaca convention
        return _chat_messages([{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}],
                              where)
    raise RowError(f"{where}: no 'messages' (chat), 'conversations' (ShareGPT) or "
                   f"'instruction' + 'output' (Alpaca) key; keys are {sorted(row)[:8]}", "unknown format")


def to_messages(row: dict, where: str) -> list[dict]:
    return row_messages(row, where)[0]
