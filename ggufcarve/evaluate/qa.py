"""Deterministic QA checks: a suite of JSONL files, greedy answers from each model, validators, agreement with the
reference.

One check per line:
    {"id": "json-person", "category": "json", "max_tokens": 96,
     "messages": [{"role": "user", "content": "..."}], "tools": [...optional, OpenAI tool schema...],
     "validator": {"type": "json", "schema": {...}}}

Validators (`validator.type`):
    exact       {"expected": "...", "strip": true}: the answer equals the text
    regex       {"pattern": "...", "flags": "is"}: the pattern is found in the answer
    json        {"schema": {...}}: the first JSON value in the answer (a ```json fence, else the
                first {...} or [...]) parses and is valid under the JSON Schema (every keyword of
                its `$schema` draft, Draft 2020-12 when it names none, `format` asserted; checked
                by the jsonschema library, the schema itself when the suite is loaded)
    expression  {"expected": 42, "tolerance": 0}: the answer's last arithmetic expression (after
                "answer:" when present, else its last line) is evaluated without eval(), over
                numbers, + - * / // % ** and parentheses, and equals the expected value
    tool_call   {"name": "...", "arguments": {schema}}: the answer holds a tool call, JSON
                {"name": ..., "arguments": {...}} (bare, fenced or inside <tool_call> tags),
                naming the tool, with arguments valid under the schema (an object schema)

Prompts are the model's chat template (`tokenizer.chat_template`, rendered with jinja2 as
llama-cpp-python does) applied to the messages, with the generation prompt; a model without a
template gets "role: content" lines and "assistant:". Decoding is greedy (temperature 0,
top-k 1: nothing random is drawn, so the seed has no effect) and stops at an end-of-generation
token or `max_tokens`.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ggufcarve.errors import BadInput

if TYPE_CHECKING:
    from ggufcarve.evaluate.engine import Engine

VALIDATOR_TYPES = ("exact", "regex", "json", "expression", "tool_call")
CHECK_KEYS = {"id", "category", "messages", "max_tokens", "validator", "tools", "description"}
DECODING = {"temperature": 0.0, "top_k": 1, "seed": 0}


@dataclass(frozen=True)
class Check:
    id: str
    category: str
    messages: list[dict]
    max_tokens: int
    validator: dict
    tools: list[dict] | None = None
    description: str = ""
    source: str = ""  # file:line

    def to_json(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# suite files


def _check_from_line(line: str, where: str) -> Check:
    try:
        doc = json.loads(line)
    except ValueError as err:
        raise BadInput(
            f"{where}: not valid JSON ({err.msg} at column {err.colno})",
            "one JSON object per line (see evaluation/qa/)",
        ) from None
    if not isinstance(doc, dict):
        raise BadInput(f"{where}: a check must be a JSON object", "see evaluation/qa/")
    unknown = set(doc) - CHECK_KEYS
    if unknown:
        raise BadInput(f"{where}: unknown key '{sorted(unknown)[0]}'", f"keys: {', '.join(sorted(CHECK_KEYS))}")
    for key in ("id", "messages", "validator"):
        if key not in doc:
            raise BadInput(f"{where}: missing '{key}'", "every check has id, messages and validator")
    messages = doc["messages"]
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise BadInput(f"{where}: messages must be a non-empty list of {{role, content}} strings", "see evaluation/qa/")
    validator = doc["validator"]
    if not isinstance(validator, dict) or validator.get("type") not in VALIDATOR_TYPES:
        raise BadInput(
            f"{where}: validator type must be one of {', '.join(VALIDATOR_TYPES)}",
            "see the ggufcarve.evaluate.qa docstring",
        )
    max_tokens = doc.get("max_tokens", 128)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 0 < max_tokens <= 4096:
        raise BadInput(f"{where}: max_tokens must be an integer in 1..4096", 'for example "max_tokens": 128')
    check = Check(
        str(doc["id"]),
        str(doc.get("category", "")),
        messages,
        max_tokens,
        validator,
        doc.get("tools"),
        str(doc.get("description", "")),
        where,
    )
    try:
        for schema, name in _schemas(validator):
            _validator(schema, name)  # an invalid schema fails here, not mid-run
        validate(check, "")  # a malformed validator (bad regex, bad expected value) fails here, not mid-run
    except ValidatorError as err:
        raise BadInput(f"{where}: {err}", "see the ggufcarve.evaluate.qa docstring") from None
    return check


def load_suite(path: Path) -> list[Check]:
    """The checks of a .jsonl file, or of every *.jsonl file of a directory in name order; ids must be unique."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise BadInput(f"{path}: no *.jsonl files", "give a QA file or directory such as evaluation/qa")
    checks: list[Check] = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as err:
            raise BadInput(
                f"{file}: cannot read the QA file ({err.strerror})", "give a QA file or directory such as evaluation/qa"
            ) from None
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                checks.append(_check_from_line(line, f"{file.name}:{number}"))
    seen: dict[str, str] = {}
    for check in checks:
        if check.id in seen:
            raise BadInput(
                f"{check.source}: id '{check.id}' is already used at {seen[check.id]}", "give every check its own id"
            )
        seen[check.id] = check.source
    return checks


def default_suite_path() -> Path:
    """The QA suite shipped with the package: evaluation/qa (ggufcarve/shipped.py)."""
    from ggufcarve.shipped import shipped

    return shipped("evaluation", "qa")


# ---------------------------------------------------------------------------------------------
# validators


class ValidatorError(Exception):
    """The validator itself is malformed."""


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_value(expression: str) -> float:
    """The value of an arithmetic expression, evaluated from its syntax tree (no names, calls or attributes)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {type(node).__name__}")

    return value(ast.parse(expression.strip(), mode="eval"))


_EXPRESSION = re.compile(r"[-+(]*\d[\d.\s+\-*/%()]*")


def _final_expression(answer: str) -> str | None:
    text = answer.replace(",", "")
    marker = re.search(r"answer\s*(?:is)?\s*[:=]?\s*(.+)", text, re.IGNORECASE | re.DOTALL)
    candidates = (
        [marker.group(1).splitlines()[0]] if marker else [line for line in text.splitlines() if line.strip()][-1:]
    )
    for candidate in candidates:
        found = [m.group(0).strip() for m in _EXPRESSION.finditer(candidate.replace("×", "*").replace("÷", "/"))]
        found = [f.rstrip(".") for f in found if any(ch.isdigit() for ch in f)]
        if found:
            return found[-1]
    return None


def first_json(answer: str) -> Any:
    """The first JSON value of an answer: a ```json fence, else the first parseable {...} or [...]."""
    fence = re.search(r"```(?:json)?\s*(.*?)```", answer, re.DOTALL)
    if fence:
        try:
            return json.loads(fence.group(1))
        except ValueError:
            pass
    decoder = json.JSONDecoder()
    for match in re.finditer(r"[{\[]", answer):
        try:
            return decoder.raw_decode(answer[match.start() :])[0]
        except ValueError:
            continue
    raise ValueError("no JSON value in the answer")


def _validator(schema: Any, where: str = "$"):
    """A jsonschema validator of the schema (its `$schema` draft, else Draft 2020-12, formats asserted);
    ValidatorError when the schema is invalid."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise ValidatorError(f"schema at {where} must be an object")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as err:
        at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        raise ValidatorError(f"invalid JSON schema at {where}{at}: {' '.join(err.message.split())}") from None
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def schema_errors(value: Any, schema: Any, where: str = "$") -> list[str]:
    """Where `value` breaks the JSON Schema (every keyword of its draft, through the jsonschema library), in document
    order."""
    errors = sorted(_validator(schema, where).iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{where}{e.json_path[1:]}: {' '.join(e.message.split())}" for e in errors]


def _schemas(validator: dict) -> list[tuple[Any, str]]:
    """The JSON schemas a validator holds, with the name an error gives each."""
    if validator["type"] == "json":
        return [(validator.get("schema", {}), "schema")]
    if validator["type"] == "tool_call":
        arguments = validator.get("arguments", {})
        return [({"type": "object", **arguments} if isinstance(arguments, dict) else arguments, "arguments")]
    return []


def _tool_call(answer: str) -> Any:
    tagged = re.search(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", answer, re.DOTALL)
    return first_json(tagged.group(1) if tagged else answer)


def validate(check: Check, answer: str) -> tuple[bool, str]:
    """(passed, reason) of an answer; ValidatorError when the validator itself is malformed."""
    v = check.validator
    kind = v["type"]
    if kind == "exact":
        if not isinstance(v.get("expected"), str):
            raise ValidatorError("exact needs a string 'expected'")
        strip = v.get("strip", True)
        got = answer.strip() if strip else answer
        return (got == v["expected"], "" if got == v["expected"] else f"expected {v['expected']!r}")
    if kind == "regex":
        flags = 0
        for letter in v.get("flags", ""):
            if letter not in "imsx":
                raise ValidatorError(f"unknown regex flag {letter!r}")
            flags |= {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}[letter]
        try:
            pattern = re.compile(v.get("pattern", ""), flags)
        except re.error as err:
            raise ValidatorError(f"bad regex: {err}") from None
        found = pattern.search(answer) is not None
        return found, "" if found else f"no match for /{pattern.pattern}/"
    if kind == "json":
        schema = v.get("schema", {})
        try:
            value = first_json(answer)
        except ValueError as err:
            return False, str(err)
        errors = schema_errors(value, schema)
        return not errors, "; ".join(errors[:3])
    if kind == "expression":
        expected = v.get("expected")
        if isinstance(expected, str):
            try:
                expected = safe_value(expected)
            except (ValueError, SyntaxError, ZeroDivisionError) as err:
                raise ValidatorError(f"expected is not arithmetic: {err}") from None
        if not isinstance(expected, (int, float)) or isinstance(expected, bool):
            raise ValidatorError("expression needs a numeric 'expected'")
        expression = _final_expression(answer)
        if expression is None:
            return False, "no arithmetic expression in the answer"
        try:
            got = safe_value(expression)
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError) as err:
            return False, f"{expression!r}: {err}"
        ok = math.isclose(got, expected, rel_tol=0, abs_tol=float(v.get("tolerance", 0)) + 1e-9)
        return ok, "" if ok else f"{expression} = {got:g}, expected {expected:g}"
    if kind == "tool_call":
        if not isinstance(v.get("name"), str):
            raise ValidatorError("tool_call needs the tool 'name'")
        try:
            call = _tool_call(answer)
        except ValueError as err:
            return False, str(err)
        if not isinstance(call, dict):
            return False, "the tool call is not a JSON object"
        if "function" in call and isinstance(call["function"], dict):
            call = call["function"]
        if call.get("name") != v["name"]:
            return False, f"calls {call.get('name')!r}, expected {v['name']!r}"
        arguments = call.get("arguments", call.get("parameters"))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return False, "arguments are not JSON"
        ((schema, name),) = _schemas(v)
        errors = schema_errors(arguments, schema, name)
        return not errors, "; ".join(errors[:3])
    raise ValidatorError(f"unknown validator {kind!r}")


# ---------------------------------------------------------------------------------------------
# answering (in the evaluation child) and judging (in the parent)


def render_prompt(engine: Engine, template: str | None, check: dict) -> tuple[bytes, bool]:
    """The prompt bytes of a check and whether the template already wrote the special tokens."""
    if template:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        bos = engine.piece(engine.bos, special=True).decode("utf-8", errors="replace") if engine.bos >= 0 else ""
        eos = engine.piece(engine.eos, special=True).decode("utf-8", errors="replace") if engine.eos >= 0 else ""
        formatter = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos, add_generation_prompt=True)
        prompt = formatter(messages=check["messages"], tools=check.get("tools")).prompt
        return prompt.encode("utf-8"), bool(bos) and prompt.startswith(bos)
    lines = [f"{m['role']}: {m['content']}" for m in check["messages"]]
    return ("\n".join(lines) + "\nassistant:").encode("utf-8"), False


def run_checks(engine: Engine, checks: list[dict], progress: Callable[[int, int], None]) -> list[dict]:
    """Greedy answers of the loaded model to every check: [{id, output, prompt_tokens, output_tokens}]."""
    template = engine.chat_template()
    prompts = []
    for check in checks:
        text, has_bos = render_prompt(engine, template, check)
        prompts.append(engine.tokenize(text, add_special=not has_bos, parse_special=True))
    n_ctx = max(len(p) + c["max_tokens"] for p, c in zip(prompts, checks))
    context = engine.context(-(-n_ctx // 256) * 256)
    outputs = []
    try:
        progress(0, len(checks))
        for i, (check, prompt) in enumerate(zip(checks, prompts)):
            tokens = list(context.generate(prompt.tolist(), check["max_tokens"]))
            text = b"".join(engine.piece(t) for t in tokens).decode("utf-8", errors="replace")
            outputs.append(
                {
                    "id": check["id"],
                    "output": text,
                    "prompt_tokens": int(len(prompt)),
                    "output_tokens": len(tokens),
                    "chat_template": bool(template),
                }
            )
            progress(i + 1, len(checks))
    finally:
        context.close()
    return outputs


def summarize(checks: list[dict], outputs: list[dict], reference: list[dict] | None) -> dict:
    """Pass/total, exact agreement with the reference's outputs, and every check's output and verdict."""
    by_id = {o["id"]: o for o in outputs}
    reference_by_id = {o["id"]: o["output"] for o in reference or []}
    rows = []
    for raw in checks:
        check = Check(**raw)
        output = by_id[check.id]
        passed, reason = validate(check, output["output"])
        same = reference_by_id.get(check.id) == output["output"] if reference is not None else None
        rows.append(
            {
                "id": check.id,
                "category": check.category,
                "passed": passed,
                "reason": reason,
                "same_as_reference": same,
                **output,
            }
        )
    total = len(rows)
    exact = sum(1 for r in rows if r["same_as_reference"]) / total if reference is not None and total else None
    return {
        "passed": sum(r["passed"] for r in rows),
        "total": total,
        "exact_vs_reference": exact,
        "decoding": DECODING,
        "checks": rows,
    }
