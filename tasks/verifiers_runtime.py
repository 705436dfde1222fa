"""A verifiers `Runtime` over meshrl's sandbox, for scoring signals that take a `runtime`.

A verifiers reward or metric with a `runtime` parameter writes files (the answer's code, a test)
and runs programs on them (`runtime.run(["python3", "test.py"], env)`). Here every `run` is a
fresh sandbox call (`meshrl.sandbox`): the files this runtime was given are recreated in the
call's working directory, then the program is exec'd there. So files are kept across calls only
as written through `write`: what a program writes is gone with its call, and there are no live
processes, ports or network. Paths are relative or under `/work` (the call's directory).
"""

from __future__ import annotations

import asyncio
import base64
import json
import posixpath

import verifiers.v1 as vf
from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes.base import ProgramResult

from meshrl.sandbox import Sandbox

LAUNCHER = """
import base64, json, os
spec = json.loads(base64.b64decode(SPEC))
for path, data in spec["files"].items():
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as out:
        out.write(base64.b64decode(data))
os.execvpe(spec["argv"][0], spec["argv"], {**os.environ, **spec["env"]})
"""


class SandboxRuntime(vf.Runtime):
    def __init__(self, sandbox: Sandbox) -> None:
        super().__init__(name="meshrl-sandbox")
        self.sandbox = sandbox
        self.files: dict[str, bytes] = {}

    @property
    def type(self) -> str:
        return "meshrl-sandbox"

    async def start(self) -> None:
        pass

    async def write(self, path: str, data: bytes) -> None:
        self.files[_relative(path)] = bytes(data)

    async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        try:
            data = self.files[_relative(path)]
        except KeyError:
            raise SandboxError(f"read {path!r}: only files written through this runtime can be read") from None
        return data if max_bytes is None else data[:max_bytes]  # `read` asks one byte over its cap

    async def run(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        spec = {
            "argv": list(argv),
            "env": self.process_env(env),
            "files": {path: base64.b64encode(data).decode() for path, data in self.files.items()},
        }
        encoded = base64.b64encode(json.dumps(spec).encode()).decode()
        run = await asyncio.to_thread(self.sandbox.run_python, LAUNCHER.replace("SPEC", repr(encoded), 1))
        if run.exit_code is None or run.limit is not None:  # a broken limit reads as a killed program
            return ProgramResult(
                run.exit_code or 137, run.stdout, f"{run.stderr}\n[sandbox limit reached: {run.limit}]"
            )
        return ProgramResult(run.exit_code, run.stdout, run.stderr)


def _relative(path: str) -> str:
    normal = posixpath.normpath(path)
    if normal.startswith("/work/"):
        normal = normal[len("/work/") :]
    if posixpath.isabs(normal) or normal == ".." or normal.startswith("../"):
        raise SandboxError(f"{path!r}: the sandbox runtime keeps files only in its working directory (/work)")
    return normal
