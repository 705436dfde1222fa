"""Claude Code's tools (Read, Edit, Write, Bash, Grep, Glob) over an episode's workspace.

Names and argument schemas are Claude Code's, so an RL episode and an ingested Claude Code
session (`meshrl traces ingest`) share one action space. Every call runs as one program in the
episode's sandbox workspace (`meshrl.sandbox.Workspace`), the file tools too: a path, a symlink
or a glob the policy made resolves inside the sandbox's view, never the host's. The arguments
are checked here against the schema first (a wrong type or an unknown key is a tool error that
names it) and reach the program as literals.
"""

from __future__ import annotations

from typing import Any

from meshrl.sandbox import Sandbox, Workspace
from meshrl.tasks.base import ToolResult

ROOT = "/work"  # the repository, as the policy sees it


def _schema(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },  # fmt: skip
        },
    }


def _string(description: str) -> dict[str, str]:
    return {"type": "string", "description": description}


TOOLS = [
    _schema("Read", "Reads a file from the local filesystem. Lines are numbered as cat -n prints them.", {
        "file_path": _string("The absolute path to the file to read"),
        "offset": {"type": "number", "description": "The line number to start reading from"},
        "limit": {"type": "number", "description": "The number of lines to read"},
    }, ["file_path"]),
    _schema("Edit", "Performs exact string replacements in files.", {
        "file_path": _string("The absolute path to the file to modify"),
        "old_string": _string("The text to replace"),
        "new_string": _string("The text to replace it with (must be different from old_string)"),
        "replace_all": {"type": "boolean", "default": False, "description": "Replace all occurences of old_string"},
    }, ["file_path", "old_string", "new_string"]),
    _schema("Write", "Writes a file to the local filesystem, overwriting it if it exists.", {
        "file_path": _string("The absolute path to the file to write (must be absolute, not relative)"),
        "content": _string("The content to write to the file"),
    }, ["file_path", "content"]),
    _schema("Bash", "Executes a given bash command in the repository and returns its output.", {
        "command": _string("The command to execute"),
        "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
        "description": _string("Clear, concise description of what this command does in 5-10 words"),
    }, ["command"]),
    _schema("Grep", "A search tool over file contents (Python regular expressions).", {
        "pattern": _string("The regular expression pattern to search for in file contents"),
        "path": _string("File or directory to search in. Defaults to the current working directory."),
        "glob": _string('Glob pattern to filter files (e.g. "*.js", "*.{ts,tsx}")'),
        "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"],
                        "description": 'Output mode; defaults to "files_with_matches"'},  # fmt: skip
        "-i": {"type": "boolean", "description": "Case insensitive search"},
        "-n": {"type": "boolean", "description": "Show line numbers in output (content mode)"},
        "-A": {"type": "number", "description": "Lines to show after each match (content mode)"},
        "-B": {"type": "number", "description": "Lines to show before each match (content mode)"},
        "-C": {"type": "number", "description": "Lines to show before and after each match (content mode)"},
        "head_limit": {"type": "number", "description": "Limit output to the first N lines or entries"},
    }, ["pattern"]),
    _schema("Glob", "Fast file pattern matching; returns matching paths, newest first.", {
        "pattern": _string("The glob pattern to match files against"),
        "path": _string("The directory to search in. Defaults to the current working directory."),
    }, ["pattern"]),
]  # fmt: skip
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
WRITES = ("Edit", "Write", "Bash")  # the tools that can change the workspace (what a replay re-runs)
_TYPES = {"string": (str,), "number": (int, float), "boolean": (bool,)}

# The tools as one program; `main(name, arguments, timeout_s)` prints the result and exits 0, or 3
# for a tool error (a missing file, an edit that does not match, a failing command).
PROGRAM = r"""
import fnmatch, glob as globbing, os, re, subprocess, sys

ROOT = "/work"
MAX_LINES, MAX_LINE, MAX_OUTPUT = 2000, 2000, 30000


def fail(message):
    print(message)
    raise SystemExit(3)


def where(path):
    return os.path.normpath(os.path.join(ROOT, path))


def text_of(path):
    if not os.path.exists(path):
        fail(f"File does not exist: {path}")
    if os.path.isdir(path):
        fail(f"EISDIR: illegal operation on a directory, read '{path}'")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def read(file_path, offset=1, limit=MAX_LINES):
    path = where(file_path)
    lines = text_of(path).splitlines()
    if not lines:
        return "(the file exists but is empty)"
    start = max(1, int(offset))
    chosen = lines[start - 1 : start - 1 + max(0, int(limit))]
    if not chosen:
        fail(f"offset {start} is past the end of the file ({len(lines)} lines)")
    return "\n".join(f"{n:>6}\t{line[:MAX_LINE]}" for n, line in enumerate(chosen, start))


def edit(file_path, old_string, new_string, replace_all=False):
    path = where(file_path)
    text = text_of(path)
    if old_string == new_string:
        fail("No changes to make: old_string and new_string are exactly the same.")
    count = text.count(old_string) if old_string else 0
    if count == 0:
        fail(f"String to replace not found in file.\nString: {old_string}")
    if count > 1 and not replace_all:
        fail(f"Found {count} matches of the string to replace, but replace_all is false. To replace all "
             "occurrences, set replace_all to true. To replace only one occurrence, please provide more "
             f"context to uniquely identify the instance.\nString: {old_string}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(old_string, new_string) if replace_all else text.replace(old_string, new_string, 1))
    return f"The file {path} has been updated."


def write(file_path, content):
    path = where(file_path)
    existed = os.path.exists(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(content)
    return f"The file {path} has been updated." if existed else f"File created successfully at: {path}"


def bash(command, timeout_s, description=None):
    try:
        done = subprocess.run(["/bin/bash", "-c", command], cwd=ROOT, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout_s)
    except subprocess.TimeoutExpired as stopped:
        out = (stopped.stdout or b"").decode("utf-8", "replace")
        fail(f"{out}\nCommand timed out after {timeout_s:g} s")
    out = done.stdout.decode("utf-8", "replace").rstrip("\n")
    if len(out) > MAX_OUTPUT:  # as Claude Code's Bash: the head and the tail around a marker
        half = MAX_OUTPUT // 2
        out = out[:half] + f"\n[... {len(out) - 2 * half} characters cut ...]\n" + out[-half:]
    if done.returncode:
        fail(f"{out}\nExit code {done.returncode}".lstrip("\n"))
    return out or "(no output)"


def files_under(path, pattern):
    if os.path.isfile(path):
        return [path]
    found = []
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(names):
            if pattern is None or any(fnmatch.fnmatch(name, p) for p in expand(pattern)):
                found.append(os.path.join(folder, name))
    return found


def expand(pattern):
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [p for part in match.group(1).split(",") for p in expand(pattern[: match.start()] + part + pattern[match.end():])]


def grep(pattern, path=ROOT, glob=None, output_mode="files_with_matches", head_limit=None, **flags):
    try:
        regex = re.compile(pattern, re.IGNORECASE if flags.get("-i") else 0)
    except re.error as error:
        fail(f"Invalid regular expression: {error}")
    context = int(flags.get("-C") or 0)
    before, after = int(flags.get("-B") or context), int(flags.get("-A") or context)
    out = []
    for name in files_under(where(path), glob):
        try:
            with open(name, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        hits = [i for i, line in enumerate(lines) if regex.search(line)]
        if not hits:
            continue
        if output_mode == "files_with_matches":
            out.append(name)
        elif output_mode == "count":
            out.append(f"{name}:{len(hits)}")
        else:
            shown = sorted({j for i in hits for j in range(max(0, i - before), min(len(lines), i + after + 1))})
            for j in shown:
                out.append(f"{name}:{j + 1}:{lines[j]}" if flags.get("-n") else f"{name}:{lines[j]}")
    if head_limit:
        out = out[: int(head_limit)]
    return "\n".join(out) if out else "No matches found"


def glob_(pattern, path=ROOT):
    base = where(path)
    found = [p for part in expand(pattern) for p in globbing.glob(os.path.join(base, part), recursive=True)]
    found = sorted(set(p for p in found if os.path.isfile(p)), key=lambda p: (-os.path.getmtime(p), p))
    return "\n".join(found) if found else "No files found"


def main(name, arguments, timeout_s):
    os.chdir(ROOT)
    if name == "Bash":
        timeout = arguments.pop("timeout", None)
        limit = timeout_s if timeout is None else min(timeout_s, max(0.001, timeout / 1000))
        print(bash(arguments.pop("command"), limit, **arguments))
    else:
        tool = {"Read": read, "Edit": edit, "Write": write, "Grep": grep, "Glob": glob_}[name]
        try:
            print(tool(**arguments))
        except OSError as error:
            fail(f"{type(error).__name__}: {error}")
"""
TOOL_ERROR = 3


def check_arguments(name: str, arguments: Any) -> str | None:
    """What is wrong with a call's arguments against the tool's schema, or None."""
    schema = SCHEMAS.get(name)
    if schema is None:
        return f"No such tool available: {name}. Tools: {', '.join(SCHEMAS)}"
    if not isinstance(arguments, dict):
        return f"{name}: the arguments must be an object"
    for key in schema["required"]:
        if key not in arguments:
            return f"{name}: the required parameter `{key}` is missing"
    for key, value in arguments.items():
        spec = schema["properties"].get(key)
        if spec is None:
            return f"{name}: an unexpected parameter `{key}` was provided"
        if not isinstance(value, _TYPES[spec["type"]]) or (spec["type"] == "number" and isinstance(value, bool)):
            return f"{name}: the parameter `{key}` type is expected as `{spec['type']}`"
        if "enum" in spec and value not in spec["enum"]:
            return f"{name}: `{key}` must be one of {spec['enum']}"
    return None


def call(sandbox: Sandbox, workspace: Workspace, name: str, arguments: Any) -> ToolResult:
    """Run one tool call in the workspace; every failure is a tool error the policy reads."""
    problem = check_arguments(name, arguments)
    if problem is not None:
        return ToolResult(f"<tool_use_error>{problem}</tool_use_error>", is_error=True)
    timeout_s = max(1.0, sandbox.config.wall_time_s - 1.0)  # Bash's command stops before the call is killed
    run = sandbox.run_python(PROGRAM + f"\nmain({name!r}, {dict(arguments)!r}, {timeout_s!r})\n", workspace)
    if run.limit is not None or run.exit_code not in (0, TOOL_ERROR):
        return ToolResult(run.report(), is_error=True)
    return ToolResult(run.stdout.rstrip("\n"), is_error=run.exit_code == TOOL_ERROR)
