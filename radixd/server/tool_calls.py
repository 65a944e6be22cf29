"""Tool calling on the chat route: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` read
from a body, the prompt (tools and a history's calls through the model's chat template), the
grammar a call is generated under, and the calls read back out of the output.

Contract
--------
* ``ToolSupport`` is made once per server (``ServerState``): the parser picked by
  ``model.tool_parser`` (``"auto"``: by the markers in the chat template; Hermes when none
  matches) and what the template renders (tools, assistant ``tool_calls``, ``tool``
  messages), found by rendering probes. A template that does not render tools gets them in a
  system message in the Hermes style, written in the parser's markup (``tools_prompt``);
  history calls it does not render are spelled in that markup inside the content, and
  ``tool`` messages it does not render become ``<tool_response>`` user turns: nothing is
  dropped.
* ``read_request(body, support)``: the request's ``ToolRequest`` (None without tools), or a
  400 naming the field.
* ``constrain(support, req, params)``: the ``SamplingParams`` with the tool grammar. With
  ``tool_choice`` ``required`` or a named function the whole output is calls in the parser's
  markup, each a listed name and arguments valid for its ``parameters`` (one call unless
  ``parallel_tool_calls``; exactly the named function when named); under ``auto`` free text
  in which each call, from the moment the model opens one (the markup's trigger), is
  generated under that grammar (a structural tag). A ``strict`` function whose schema radixd
  cannot enforce is a 400 naming the keyword; a non-strict one's arguments are only held to
  be a JSON object. ``model.tool_grammar = false``: no tool grammar.
* ``ToolOutputs``: one route's choices read by the parser (``deltas`` while streaming,
  ``message`` when not), and their ``finish_reason`` (``tool_calls`` after calls).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from radixd.core.errors import ConfigError
from radixd.core.sampling_params import SamplingParams
from radixd.grammars.json_schema import SchemaGrammar, schema_to_lark
from radixd.grammars.schema_model import SchemaError
from radixd.server.errors import ApiError
from radixd.server.tool_parsing import CallForm, CallStream, Delta, ToolParser, merge

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("auto", "none", "required")
PARSER_SETTINGS = ("auto", "none")  # besides the names of the loaded parsers
FALLBACK = "hermes"  # the format of templates that show no markup of their own

_STR = {"type": "string"}
_FUNCTION = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": FUNCTION_NAME.pattern}, "description": _STR,
    "parameters": {"type": "object"}, "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}}
_NAMED = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {"name": _STR}}}}
SCHEMAS = {  # the chat route's fields (protocol's table, /openapi.json)
    "tools": {"anyOf": [{"type": "array", "items": {"type": "object", "required": ["type", "function"],
                                                  "properties": {"type": {"const": "function"}, "function": _FUNCTION}}},
                        {"type": "null"}]},
    "tool_choice": {"anyOf": [{"enum": list(CHOICES)}, _NAMED, {"type": "null"}]},
    "parallel_tool_calls": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
}
HISTORY_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": _STR, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {"name": _STR, "arguments": _STR}}}}
_PROBE = "radixd_probe_7c1e"


def parser_table(pm) -> dict[str, type[ToolParser]]:
    from radixd.plugins.wiring import provided

    return provided(pm.hook.radixd_tool_parsers, "tool parser")


def check_parser_setting(name: str, table: dict[str, type]) -> None:
    if name not in PARSER_SETTINGS and name not in table:
        raise ConfigError("model.tool_parser", name, ", ".join([*PARSER_SETTINGS, *sorted(table)]))


def template_text(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None) or ""
    return t if isinstance(t, str) else "\n".join(t.values())  # named templates: all of them


@dataclass(frozen=True)
class ToolSupport:
    """What the served model does with tools (see the module's contract)."""

    parser: ToolParser | None  # None: model.tool_parser = "none"
    renders_tools: bool
    renders_calls: bool
    renders_tool_role: bool
    grammar: bool = True       # model.tool_grammar
    max_ws: int = 2            # grammar.max_whitespace

    @classmethod
    def load(cls, pm, setting: str, tokenizer, *, grammar: bool = True, max_ws: int = 2) -> ToolSupport:
        table = parser_table(pm)
        check_parser_setting(setting, table)
        text = template_text(tokenizer)
        parser = None
        if setting == "auto":
            found = [p for _, p in sorted(table.items()) if p.detect(text)]
            parser = (found[0] if found else table[FALLBACK])(text)
        elif setting != "none":
            parser = table[setting](text)
        tool = {"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {"type": "object"}}}
        call = {"id": "call_1234567ab", "type": "function", "function": {"name": _PROBE, "arguments": {}}}
        user = {"role": "user", "content": "x"}
        asked = [user, {"role": "assistant", "content": "", "tool_calls": [call]}]

        def shows(messages: list[dict], needle: str, **kw) -> bool:
            try:
                return needle in tokenizer.apply_chat_template(messages, tokenize=False, **kw)
            except Exception:  # a template may refuse a probe's shape: it does not render it
                return False

        return cls(parser, renders_tools=shows([user], _PROBE, tools=[tool]), renders_calls=shows(asked, _PROBE),
                   renders_tool_role=shows([*asked, {"role": "tool", "content": _PROBE + "_out",
                                                     "tool_call_id": call["id"]}], _PROBE + "_out"),
                   grammar=grammar, max_ws=max_ws)

    @property
    def form(self) -> CallForm:
        return self.parser.form

    def history(self, messages: list[dict]) -> list[dict]:
        """A history's calls and tool results in the shapes the template takes (see contract)."""
        out = []
        for i, m in enumerate(messages):
            if m.get("tool_calls"):
                if self.renders_calls:
                    calls = [{**c, "id": self._id(c["id"]), "function": {
                        "name": c["function"]["name"], "arguments": _as_object(c["function"]["arguments"])}}
                        for c in m["tool_calls"]]
                    m = {**m, "tool_calls": calls}
                elif self.parser is None:
                    raise ApiError(400, f"'messages[{i}].tool_calls': this model's template does not show tool "
                                        "calls and tool calling is off (model.tool_parser = \"none\")",
                                   param="messages", code="unsupported_parameter")
                else:
                    spelled = self.form.spell((c["function"]["name"], c["function"]["arguments"])
                                              for c in m["tool_calls"])
                    m = {"role": "assistant", "content": "\n".join(p for p in (m["content"], spelled) if p)}
            elif m["role"] == "tool":
                if self.renders_tool_role:
                    m = {**m, **({"tool_call_id": self._id(m["tool_call_id"])} if "tool_call_id" in m else {})}
                else:
                    m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            out.append(m)
        return out

    def _id(self, call_id: str) -> str:
        return self.parser.history_id(call_id) if self.parser is not None else call_id


def _as_object(arguments: str) -> Any:
    """A history call's arguments as the object templates index into (text that is no JSON
    object stays text)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def history_calls(i: int, value: Any) -> list[dict]:
    """``messages[i].tool_calls`` checked (OpenAI's shape, arguments a JSON string)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise ApiError(400, f"'{where}' must be a list", param=where)
    for j, c in enumerate(value):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(c, dict) and isinstance(c.get("id"), str) and c.get("type") == "function"
                and isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)):
            raise ApiError(400, f"'{where}[{j}]' must be {{\"id\": str, \"type\": \"function\", \"function\": "
                                "{\"name\": str, \"arguments\": str}}", param=where)
    return [{"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                             "arguments": c["function"]["arguments"]}} for c in value]


# ------------------------------------------------------------------------ the request


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools: ``functions`` (OpenAI's function objects), ``choice`` ("auto",
    "none", "required" or "named"), ``named`` (the named function), ``parallel``."""

    functions: list[dict]
    choice: str
    named: str | None
    parallel: bool

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def names(self) -> list[str]:
        return [self.named] if self.named else [f["name"] for f in self.functions]


def read_request(body: dict, support: ToolSupport) -> ToolRequest | None:
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    functions = [_function(i, t) for i, t in enumerate(tools or [])]
    names = [f["name"] for f in functions]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ApiError(400, f"'tools': two functions are named {dup!r}", param="tools")
    named = None
    if choice is None:
        choice = "auto" if functions else "none"
    elif isinstance(choice, dict):
        if isinstance(choice.get("type"), str) and choice["type"] != "function":
            raise ApiError(400, f"'tool_choice' of type {choice['type']!r} is not supported by this server",
                           param="tool_choice", code="unsupported_parameter")
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or set(choice) - {"type", "function"}:
            raise ApiError(400, "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                                "\"function\": {\"name\": ...}}", param="tool_choice")
        named, choice = fn["name"], "named"
        if named not in names:
            raise ApiError(400, f"'tool_choice' names the function {named!r}, which is not in 'tools' "
                                f"({', '.join(names) or 'none given'})", param="tool_choice")
    elif choice not in CHOICES:
        raise ApiError(400, f"'tool_choice' must be \"auto\", \"none\", \"required\" or a named function; got "
                            f"{choice!r}", param="tool_choice")
    if choice == "required" and not functions:
        raise ApiError(400, "'tool_choice': \"required\" needs 'tools'", param="tool_choice")
    if not functions:
        return None
    if support.parser is None and choice != "none":
        raise ApiError(400, "'tools' is not supported by this server (model.tool_parser = \"none\")", param="tools",
                       code="unsupported_parameter")
    return ToolRequest(functions, choice, named, True if parallel is None else parallel)


def _function(i: int, tool: Any) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
        raise ApiError(400, f"'{where}' must be an object with a 'type'", param="tools")
    if tool["type"] != "function":
        raise ApiError(400, f"'{where}.type' {tool['type']!r} is not supported by this server (only \"function\" "
                            "tools)", param="tools", code="unsupported_parameter")
    extra = set(tool) - {"type", "function"}
    if extra:
        raise ApiError(400, f"unrecognized field '{where}.{sorted(extra)[0]}'", param="tools")
    f = tool.get("function")
    if not isinstance(f, dict):
        raise ApiError(400, f"'{where}.function' must be an object", param="tools")
    extra = set(f) - {"name", "description", "parameters", "strict"}
    if extra:
        raise ApiError(400, f"unrecognized field '{where}.function.{sorted(extra)[0]}'", param="tools")
    if not (isinstance(f.get("name"), str) and FUNCTION_NAME.match(f["name"])):
        raise ApiError(400, f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-'", param="tools")
    for key, kind, what in (("description", str, "a string"), ("parameters", dict, "an object (a JSON Schema)"),
                            ("strict", bool, "a boolean")):
        if f.get(key) is not None and not isinstance(f[key], kind):
            raise ApiError(400, f"'{where}.function.{key}' must be {what}", param="tools")
    return {k: v for k, v in f.items() if v is not None}


# ------------------------------------------------------------------------ the prompt


def prompt(support: ToolSupport, req: ToolRequest | None, messages: list[dict]) -> tuple[list[dict], list | None]:
    """(messages, the template's ``tools``): the request's tools either handed to the template
    or written into the system message (the history's calls are ``chat_prompt_ids``'s, through
    ``ToolSupport.history``)."""
    if req is None or not req.active:
        return messages, None
    tools = [{"type": "function", "function": f} for f in req.functions]
    if support.renders_tools:
        return messages, tools
    text = tools_prompt(support.form, req.functions)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]], None
    return [{"role": "system", "content": text}, *messages], None


def tools_prompt(form: CallForm, functions: list[dict]) -> str:
    """The tools as Hermes-style instructions (Qwen2.5's wording), calls spelled in ``form``."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    example = form.spell([("<function-name>", "<args-json-object>")])
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>"
            f"\n\nFor each function call, return a json object with function name and arguments like this:\n{example}")


# ------------------------------------------------------------------------ the grammar


def constrain(support: ToolSupport, req: ToolRequest | None, params: SamplingParams, *,
              after: str | None = None) -> SamplingParams:
    """``params`` with the request's tool grammar (see the module's contract): under
    ``required`` / a named function the whole output (an ``ebnf`` grammar), under ``auto``
    each call from its trigger on (a ``structural_tag``; not when the request has a grammar of
    its own). ``after``: where the grammar starts (``grammar_after``): the end marker of a
    reasoning parser's thinking, so that the thinking itself is free."""
    if req is None or not req.active:
        return params
    kw: dict[str, Any] = {}
    if support.parser.special_tokens:
        kw["skip_special_tokens"] = False
    functions = [(i, f) for i, f in enumerate(req.functions) if req.named in (None, f["name"])]
    schemas = [(f["name"], args_schema(i, f, support.max_ws)) for i, f in functions]  # strict ones checked here
    if support.grammar and req.choice in ("required", "named"):
        if params.constraint is not None:
            raise ApiError(400, f"'tool_choice': {req.choice!r} makes the output tool calls; it cannot take "
                                "response_format or another constraint too", param="tool_choice")
        kw["ebnf"] = calls_grammar(support.form, schemas, many=req.parallel and not req.named, max_ws=support.max_ws)
    elif support.grammar and req.choice == "auto" and params.constraint is None:
        form = support.form
        kw["structural_tag"] = {"triggers": [form.trigger], "structures": [
            {"begin": form.prefix + form.opening(name), "schema": schema, "end": form.end + form.suffix}
            for name, schema in schemas]}
    if after is not None and ("ebnf" in kw or "structural_tag" in kw):
        kw["grammar_after"] = after
    return replace(params, **kw) if kw else params


def calls_grammar(form: CallForm, schemas: list[tuple[str, Any]], *, many: bool, max_ws: int) -> str:
    """Lark: calls in ``form``'s markup, each a (name, arguments schema) of ``schemas``; one or
    more (``many``) or exactly one."""
    g = SchemaGrammar(None, max_ws)
    alts = [" ".join(p for p in (_literal(g, form.opening(name)), g.top(schema), _literal(g, form.end)) if p)
            for name, schema in schemas]
    call = g.rule(" | ".join(alts), "call")
    sep = _literal(g, form.sep.strip())  # (whitespace between calls is the grammar's own)
    body = (f"{call} ({sep} {call})*" if sep else f"{call}+") if many else call
    return g.grammar("start: " + " ".join(p for p in (_literal(g, form.prefix), body, _literal(g, form.suffix)) if p))


def _literal(g: SchemaGrammar, text: str) -> str:
    """A terminal for exactly ``text`` (control characters escaped: Lark takes no raw ones)."""
    rx = "".join(re.escape(c) if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    return g.term(rx) if text else ""


def args_schema(i: int, function: dict, max_ws: int) -> dict:
    """The arguments' JSON Schema as enforced: the function's own, or, where radixd cannot
    enforce it, any object (a ``strict`` function: 400 naming the keyword)."""
    schema = function.get("parameters") or {"type": "object"}
    try:
        schema_to_lark(schema, max_ws)
    except SchemaError as exc:
        if function.get("strict"):
            raise ApiError(400, f"'tools[{i}].function.parameters': unsupported JSON Schema keyword "
                                f"'{exc.keyword}': {exc} (the function is strict)", param="tools",
                           code="unsupported_parameter") from None
        return {"type": "object"}
    return schema


# ------------------------------------------------------------------------ the output


class ToolOutputs:
    """The choices of one response read for calls (as plain content when the request has no
    active tools)."""

    def __init__(self, support: ToolSupport, req: ToolRequest | None, n: int):
        self.parsing = req is not None and req.active
        self.streams: list[CallStream | None] = [
            support.parser.stream(req.names) if self.parsing else None for _ in range(n)]

    def deltas(self, index: int, text: str, finished: bool) -> list[Delta]:
        s = self.streams[index]
        if s is None:
            return [{"content": text}] if text else []
        return s.feed(text) + (s.flush() if finished else [])

    def message(self, index: int, text: str) -> dict:
        content, calls = merge(self.deltas(index, text, True))
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        s = self.streams[index]
        return "tool_calls" if reason == "stop" and s is not None and s.calls else reason
