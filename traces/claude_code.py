"""Claude Code session files (`~/.claude/projects/<dir>/<session>.jsonl`) to trace examples.

Each line is one JSON envelope with a `type`; only `user` and `assistant` lines of the main
thread become turns (sidechain = subagent and `isMeta` lines are skipped, other types are
ignored). Claude Code writes one API response as several lines sharing `message.id`, one
content block per line, sometimes with tool results in between: they are merged back into
one assistant turn, because that is the action the model took.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn

from meshrl.traces.errors import ErrorClassifier, mark_error_sites
from meshrl.traces.schema import ToolCall, TraceExample, Turn

OnBadLine = Literal["error", "skip"]

MAX_DEPTH = 100  # deeper JSON cannot come from Claude Code and would not serialize back out
IMAGE = "[image]"


class TraceFormatError(ValueError):
    """A line that is not a Claude Code envelope; names the file and line so it can be found."""

    def __init__(self, path: Path | str, line_no: int, reason: str) -> None:
        super().__init__(f"{path}:{line_no}: {reason}")
        self.path = Path(path)
        self.line_no = line_no
        self.reason = reason


@dataclass
class IngestResult:
    examples: list[TraceExample] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    skipped_lines: dict[Path, int] = field(default_factory=dict)  # every file read, 0 when none
    empty: list[Path] = field(default_factory=list)  # files with no main-thread turns


class _BadLine(Exception):
    """A shape problem inside one line; the reader adds file and line number."""


# --------------------------------------------------------------------------- lines


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _mend(value: Any, depth: int = 0) -> Any:
    """Lone UTF-16 surrogates (JS slicing a string mid-pair) become U+FFFD: UTF-8 cannot hold them."""
    if depth > MAX_DEPTH:
        raise _BadLine(f"JSON nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_mend(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return {_mend(key, depth + 1): _mend(item, depth + 1) for key, item in value.items()}
    return value


def _load(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise _BadLine(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        reason = exc.msg.removesuffix(" at").removesuffix(" starting")  # "Unterminated string starting at"
        raise _BadLine(f"invalid JSON at column {exc.colno}: {reason}") from None
    except ValueError as exc:  # NaN/Infinity, or an integer too long to convert
        raise _BadLine(f"invalid JSON: {exc}") from None
    except RecursionError:
        raise _BadLine("invalid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise _BadLine(f"expected a JSON object, got {_kind(value)}")
    return _mend(value)


_TYPE_NAMES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
}


def _kind(value: Any) -> str:
    return _TYPE_NAMES[type(value)]


def _get(obj: dict[str, Any], key: str, types: type | tuple[type, ...], where: str, required: bool = False) -> Any:
    """obj[key] checked against `types` (JSON null counts as absent), so bad shapes fail here, not deep inside."""
    value = obj.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, types):
        expected = " or ".join(_TYPE_NAMES[t] for t in (types if isinstance(types, tuple) else (types,)))
        raise _BadLine(f"{where}.{key}: expected {expected}, got {_kind(value) if key in obj else 'nothing'}")
    return value


def _blocks(content: str | list[Any], where: str) -> list[dict[str, Any]]:
    """Content as a list of blocks; a plain string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise _BadLine(f"{where}[{i}]: expected an object, got {_kind(block)}")
        _get(block, "type", str, f"{where}[{i}]", required=True)
    return content


def _result_text(block: dict[str, Any], where: str) -> str:
    content = _get(block, "content", (str, list), where)
    parts = []
    for i, item in enumerate(_blocks(content or [], f"{where}.content")):
        if item["type"] == "text":
            parts.append(_get(item, "text", str, f"{where}.content[{i}]", required=True))
        elif item["type"] == "image":
            parts.append(IMAGE)
    return "\n".join(parts)


def _assistant_turn(message: dict[str, Any]) -> Turn:
    texts, calls = [], []
    for i, block in enumerate(_blocks(message["content"], "message.content")):
        where = f"message.content[{i}]"
        if block["type"] == "text":
            texts.append(_get(block, "text", str, where, required=True))
        elif block["type"] == "tool_use":
            calls.append(
                ToolCall(
                    id=_get(block, "id", str, where, required=True),
                    name=_get(block, "name", str, where, required=True),
                    arguments=_get(block, "input", dict, where, required=True),
                )
            )
        elif block["type"] == "image":
            texts.append(IMAGE)
    return Turn(role="assistant", content="\n".join(texts), tool_calls=calls or None)


def _user_turns(message: dict[str, Any]) -> list[Turn]:
    """Tool results become tool turns; runs of text and images between them become user turns."""
    turns: list[Turn] = []
    texts: list[str] = []
    for i, block in enumerate(_blocks(message["content"], "message.content")):
        where = f"message.content[{i}]"
        if block["type"] == "tool_result":
            if texts:
                turns.append(Turn(role="user", content="\n".join(texts)))
                texts = []
            turns.append(
                Turn(
                    role="tool",
                    content=_result_text(block, where),
                    tool_call_id=_get(block, "tool_use_id", str, where, required=True),
                    is_error=_get(block, "is_error", bool, where) or None,
                )
            )
        elif block["type"] == "text":
            texts.append(_get(block, "text", str, where, required=True))
        elif block["type"] == "image":
            texts.append(IMAGE)
    if texts:
        turns.append(Turn(role="user", content="\n".join(texts)))
    return turns


@dataclass
class _Line:
    """What one line contributes: nothing (skipped types), an assistant turn, or user/tool turns."""

    session_id: str | None
    message_id: str | None = None
    turns: list[Turn] = field(default_factory=list)


def _parse(raw: bytes) -> _Line:
    env = _load(raw)
    line_type = _get(env, "type", str, "envelope", required=True)
    session_id = _get(env, "sessionId", str, "envelope")
    if line_type not in ("user", "assistant"):
        return _Line(session_id)
    sidechain = _get(env, "isSidechain", bool, "envelope")
    meta = _get(env, "isMeta", bool, "envelope")
    message = _get(env, "message", dict, "envelope", required=True)
    _get(message, "content", (str, list), "message", required=True)
    if line_type == "assistant":
        message_id, turns = _get(message, "id", str, "message"), [_assistant_turn(message)]
    else:
        message_id, turns = None, _user_turns(message)
    return _Line(session_id) if sidechain or meta else _Line(session_id, message_id, turns)


# --------------------------------------------------------------------------- sessions


def _assemble(lines: Iterable[_Line]) -> list[Turn]:
    turns: list[Turn] = []
    open_msg: tuple[str, Turn] | None = None  # the assistant turn that later lines with its message.id extend
    for line in lines:
        for turn in line.turns:
            if turn.role == "assistant" and open_msg is not None and line.message_id == open_msg[0]:
                merged = open_msg[1]
                merged.content = "\n".join(t for t in (merged.content, turn.content) if t)
                merged.tool_calls = (merged.tool_calls or []) + (turn.tool_calls or []) or None
                continue
            if turn.role == "assistant":
                open_msg = (line.message_id, turn) if line.message_id else None
            elif turn.role == "user":
                open_msg = None
            turns.append(turn)
    return [t for t in turns if t.role != "assistant" or t.content or t.tool_calls]


def _check_mode(on_bad_line: str) -> None:
    if on_bad_line not in ("error", "skip"):
        raise ValueError(f"on_bad_line must be 'error' or 'skip', got {on_bad_line!r}")


def read_session(
    path: Path | str, on_bad_line: OnBadLine = "error", classifier: ErrorClassifier | None = None
) -> tuple[TraceExample | None, int]:
    """One session file as a trace example (None when it has no main-thread turns) and its skipped-line count."""
    _check_mode(on_bad_line)
    path = Path(path)
    lines: list[_Line] = []
    skipped = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                lines.append(_parse(raw))
            except _BadLine as exc:
                if on_bad_line == "error":
                    raise TraceFormatError(path, line_no, str(exc)) from None
                skipped += 1
    turns = _assemble(lines)
    if not turns:
        return None, skipped
    mark_error_sites(turns, classifier or ErrorClassifier())
    trace_id = next((line.session_id for line in lines if line.session_id), path.stem)
    return TraceExample(trace_id=trace_id, source=str(path), turns=turns), skipped


def session_files(paths: Iterable[Path | str]) -> list[Path]:
    """Files as given, folders as all their *.jsonl files (recursively, sorted); each file once."""
    found: dict[Path, Path] = {}
    for src in map(Path, paths):
        for path in sorted(p for p in src.rglob("*.jsonl") if p.is_file()) if src.is_dir() else [src]:
            found.setdefault(path.resolve(), path)
    return list(found.values())


def ingest_claude_code(
    paths: Iterable[Path | str], on_bad_line: OnBadLine = "error", classifier: ErrorClassifier | None = None
) -> IngestResult:
    """Every session file under `paths` as trace examples; raises TraceFormatError on a bad line unless skipping."""
    _check_mode(on_bad_line)
    classifier = classifier or ErrorClassifier()
    result = IngestResult()
    for path in session_files(paths):
        example, skipped = read_session(path, on_bad_line, classifier)
        result.files.append(path)
        result.skipped_lines[path] = skipped
        if example is None:
            result.empty.append(path)
        else:
            result.examples.append(example)
    return result
