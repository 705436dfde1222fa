"""A repository's tests in the sandbox, reported as data the host judges: what each test observed.

The program (`RUNNER`) writes the repository's files, wraps every `assert*`/`fail*` method of
`unittest.TestCase` so that each outermost call records the values it was given (its `msg` left
out) in a canonical form, runs every test one by one, and prints one line: per test, its outcome
and the SHA-256 of its outcome and observations. Nothing in the sandbox knows what those digests
should be: the host compares them with the digests of the same tests on the original module,
recorded at build time (`build`). An object whose `__eq__` always agrees is canonicalised by its
exact type and its state (its `__dict__` and slots), read without calling its methods, so it
observes differently from the float or tuple the original returned; a forged report must carry
the right digests, which takes the right values.

The canonical form is exact (floats by `repr`) except where the assertion itself is approximate:
the numbers given to `assertAlmostEqual`/`assertNotAlmostEqual` are rounded to its `places` (7 by
default), so a fix that reorders a float sum still observes alike.

The host reads the report as untrusted data: at most `MAX_REPORT_BYTES`, JSON of a fixed shape
(`parse_report`); anything else is no report (`TestRun.error`), never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from meshrl.sandbox import Sandbox

RESULTS = "#meshrl-tests "
OUTCOMES = frozenset({"pass", "fail", "skip"})
MAX_REPORT_BYTES = 1 << 20
MAX_TESTS = 20_000
_TEST_ID = re.compile(r"[\w.\[\]\-<>() ,=']{1,300}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
# The runner runs in a namespace of its own, with a private copy of the builtins: nothing it holds is
# a global of `__main__` or of any module, and a patched builtin does not reach it.
PROGRAM = 'exec({source!r}, {{"__builtins__": dict(vars(__import__("builtins"))), "__name__": "meshrl-runner"}})\n'

RUNNER = r"""
def run(files, test_module, module, results):
    import collections, collections.abc, hashlib, inspect, io, itertools, json, math, os, sys, types, unittest

    try:
        import doctest
    except ImportError:  # doctest needs the module under test (string, through pdb and cmd): imported below
        doctest = None

    MAX_ITEMS, MAX_DEPTH, MAX_OBSERVATIONS = 2000, 10, 5000
    CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.BuiltinMethodType,
                 types.MethodWrapperType, types.WrapperDescriptorType)
    # Builtin types whose value lives in C: a subclass is recorded by the base type's own value, read
    # through the base's C methods (an override of __iter__ or __repr__ is never called).
    VALUES = {int: int.__repr__, float: float.__repr__, complex: complex.__repr__, str: str.__str__,
              bytes: lambda x: bytes.__getitem__(x, slice(None)), bytearray: lambda x: bytes(bytearray.copy(x)),
              tuple: lambda x: tuple.__getitem__(x, slice(None)), list: lambda x: list.__getitem__(x, slice(None)),
              dict: lambda x: dict(dict.items(x)), set: lambda x: set(set.__iter__(x)),
              frozenset: lambda x: set(frozenset.__iter__(x)),
              collections.deque: lambda x: [list(collections.deque.__iter__(x)), collections.deque.maxlen.__get__(x)]}
    mro_of, module_of = type.__dict__["__mro__"].__get__, type.__dict__["__module__"].__get__
    qualname_of = type.__dict__["__qualname__"].__get__
    HEAP = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by Python code (the module's own, a subclass)

    def name(t):
        module, qualname = module_of(t), qualname_of(t)
        return [module if type(module) is str else None, qualname if type(qualname) is str else None]

    def canon(x, places=None, depth=0):
        # A JSON-able form of `x` that calls none of its Python methods (exact types, state read directly).
        t = type(x)
        if x is None or t is bool:
            return x
        if t is int:
            return ["int", hex(x)]
        if t is float:
            if places is not None and math.isfinite(x):
                x = round(x, places) + 0.0
            return ["float", float.__repr__(x)]
        if t is complex:
            return ["complex", canon(x.real, places), canon(x.imag, places)]
        if t is str:
            return ["str", x if len(x) <= 200 else hashlib.sha256(x.encode("utf-8", "surrogatepass")).hexdigest(), len(x)]
        if t in (bytes, bytearray, memoryview):
            return [t.__name__, hashlib.sha256(bytes(x)).hexdigest(), len(x)]
        if depth >= MAX_DEPTH:
            return ["deep", name(t)]
        if t in (list, tuple, range):
            return [t.__name__, [canon(v, places, depth + 1) for v in list(x)[:MAX_ITEMS]], len(x)]
        if t in (set, frozenset):
            items = sorted(repr(canon(v, places, depth + 1)) for v in list(x)[:MAX_ITEMS])
            return [t.__name__, items, len(x)]
        if t is dict:
            items = sorted([repr(canon(k, places, depth + 1)), canon(v, places, depth + 1)]
                           for k, v in list(x.items())[:MAX_ITEMS])
            return ["dict", items, len(x)]
        if issubclass(t, type):
            return ["class", name(x)]
        if t in CALLABLES:
            qualname = getattr(x, "__qualname__", None)
            return ["callable", qualname if type(qualname) is str else None]
        mro = mro_of(t)
        base = next((k for k in mro if k in VALUES), None)
        if base is not None:
            return ["value", name(t), canon(VALUES[base](x), places, depth + 1), state(x, mro, places, depth)]
        if all(not k.__flags__ & HEAP for k in mro):  # a C type (Decimal, date): its own C reduction
            try:
                reduced = object.__reduce_ex__(x, 4)
                parts = [list(itertools.islice(v, MAX_ITEMS)) if isinstance(v, collections.abc.Iterator) else v
                         for v in reduced[1:]]
                return ["reduced", name(t), canon(parts, places, depth + 1)]
            except Exception:
                pass
        return ["object", name(t), state(x, mro, places, depth)]

    def state(x, mro, places, depth):
        found = []
        try:
            found.append(canon(object.__getattribute__(x, "__dict__"), places, depth + 1))
        except Exception:
            pass
        for klass in mro:
            slots = klass.__dict__.get("__slots__", ())
            for slot in slots if type(slots) in (tuple, list) else ():
                try:
                    found.append([slot, canon(object.__getattribute__(x, slot), places, depth + 1)])
                except Exception:
                    found.append([slot, None])
        if BaseException in mro:
            found.append(canon(BaseException.__dict__["args"].__get__(x), places, depth + 1))
        return found

    # What the run relies on, taken before the code under test is imported: the assertions it
    # records, and every class and module of unittest and doctest, compared before and after each
    # test (code that rewraps or patches them marks the run tampered, which no verdict accepts).
    case = unittest.TestCase
    originals = {n: f for n, f in vars(case).items() if n.startswith(("assert", "fail")) and type(f) is types.FunctionType}
    watched = [case, unittest.TestResult, unittest.TestSuite, unittest.TestLoader, vars(unittest.case),
               vars(unittest.suite), vars(unittest.loader)]

    def watch_doctest():
        watched.extend([doctest.DocTestCase, doctest.DocTestRunner, doctest.OutputChecker, vars(doctest)])
        return doctest.OutputChecker.check_output

    def snapshot():
        return [dict(k if type(k) is dict else vars(k)) for k in watched]

    def same(a, b):
        return all(x.keys() == y.keys() and all(x[k] is y[k] for k in x) for x, y in zip(a, b))

    observed, depth = [], [0]
    wrappers = {}

    def recording(name_, method):
        signature = inspect.signature(method)
        approximate = "AlmostEqual" in name_

        def record(self, *args, **kwargs):
            if depth[0] == 0 and len(observed) < MAX_OBSERVATIONS:
                try:
                    bound = signature.bind(self, *args, **kwargs).arguments
                except TypeError:
                    bound = {"args": args, "kwargs": kwargs}
                values = {k: v for k, v in bound.items() if k not in ("self", "msg")}
                places = None
                if approximate and values.get("delta") is None:
                    places = values.get("places") if type(values.get("places")) is int else 7
                observed.append([name_, canon(values, places)])
            depth[0] += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return record

    def checker():
        # A doctest's observation: the output each of its examples printed.
        class Checker(doctest.OutputChecker):
            def check_output(self, want, got, optionflags):
                if len(observed) < MAX_OBSERVATIONS:
                    observed.append(["doctest", canon(got)])
                return checks(self, want, got, optionflags)

        return Checker()

    def instrument(test):
        # The recording assertions on the test itself, not on its class: a rewrap of TestCase's
        # methods never sees what the test asserts.
        for name_, original in originals.items():
            found = next((original if k is case else vars(k)[name_] for k in mro_of(type(test)) if name_ in vars(k)), None)
            if type(found) is types.FunctionType:
                if found not in wrappers:
                    wrappers[found] = recording(name_, found)
                vars(test)[name_] = types.MethodType(wrappers[found], test)
        if isinstance(test, doctest.DocTestCase):
            test._dt_checker = checker()

    def tests_of(suite):
        for test in suite:
            if isinstance(test, unittest.TestSuite):
                yield from tests_of(test)
            else:
                yield test

    def outcome(result):
        if result.errors or result.failures or result.unexpectedSuccesses:
            return "fail"
        return "skip" if result.skipped else "pass"

    for path, text in files.items():
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    sys.path.insert(0, os.getcwd())
    report = {"tests": {}, "load_error": None, "module_file": None}
    real_out, real_err, sink = sys.stdout, sys.stderr, io.StringIO()
    sys.stdout = sys.stderr = sink
    pristine, run_test, result_type, dumps, sha256 = snapshot(), case.run, unittest.TestResult, json.dumps, hashlib.sha256
    try:
        if doctest is None:
            import doctest
        checks = watch_doctest()
        pristine += snapshot()[len(pristine) :]
        suite = unittest.defaultTestLoader.loadTestsFromName(test_module)
        for test in tests_of(suite):
            if not same(pristine, snapshot()):
                raise RuntimeError("tampered")
            observed.clear()
            depth[0] = 0
            instrument(test)
            result = result_type()
            run_test(test, result)
            seen = outcome(result)
            if not same(pristine, snapshot()):
                raise RuntimeError("tampered")
            record = repr([seen, observed])
            report["tests"][test.id()] = [seen, sha256(record.encode("utf-8", "surrogatepass")).hexdigest()]
            sink.seek(0)
            sink.truncate()
    except BaseException as error:
        report["load_error"] = "tampered" if error.args == ("tampered",) else type(error).__name__[:100]
    finally:
        sys.stdout, sys.stderr = real_out, real_err
    module_file = getattr(sys.modules.get(module), "__file__", None)
    report["module_file"] = module_file[:300] if type(module_file) is str else None
    print("\n" + results + dumps(report), flush=True)
"""


@dataclass(frozen=True)
class TestRun:
    """A run of a repository's tests: each test's (outcome, digest), or None when the run gave no
    report it could be judged by (`error` says why: a limit, a crash, a malformed report)."""

    tests: dict[str, tuple[str, str]] | None
    load_error: str | None = None
    error: str | None = None
    module_file: str | None = None  # where the module was imported from (as the run says: a build check)

    def outcome(self, test: str) -> str | None:
        return None if self.tests is None or test not in self.tests else self.tests[test][0]


def run_tests(
    sandbox: Sandbox, files: dict[str, str], test_module: str, module: str, hidden: Sequence[Path] = ()
) -> TestRun:
    """Run the unittest module `test_module` against `files` in a fresh sandbox call (`hidden`
    unreadable there); `module` is the dotted name of the module under test."""
    program = PROGRAM.format(source=RUNNER + f"\nrun(*{(files, test_module, module, RESULTS)!r})\n")
    run = sandbox.run_python(program, hidden=hidden)
    if run.limit is not None:
        return TestRun(None, error=f"limit {run.limit}")
    lines = run.marked(RESULTS)
    if len(lines) != 1:
        return TestRun(None, error=f"{len(lines)} report lines, exit status {run.exit_code}")
    return parse_report(lines[0])


def parse_report(text: str) -> TestRun:
    """The report line as data of the expected shape, or a `TestRun` naming why it is not: total
    (whatever `text` holds, no exception) and bounded in size, depth and counts."""
    if len(text) > MAX_REPORT_BYTES:
        return TestRun(None, error="report too large")
    try:
        report = json.loads(text)
    except (ValueError, RecursionError):
        return TestRun(None, error="report not JSON")
    if not isinstance(report, dict) or set(report) != {"tests", "load_error", "module_file"}:
        return TestRun(None, error="report of the wrong shape")
    tests, load_error, module_file = report["tests"], report["load_error"], report["module_file"]
    if not isinstance(tests, dict) or len(tests) > MAX_TESTS:
        return TestRun(None, error="report's tests of the wrong shape")
    if load_error is not None and not (isinstance(load_error, str) and len(load_error) <= 100):
        return TestRun(None, error="report's load error of the wrong shape")
    if module_file is not None and not (isinstance(module_file, str) and len(module_file) <= 300):
        return TestRun(None, error="report's module file of the wrong shape")
    out: dict[str, tuple[str, str]] = {}
    for test, value in tests.items():
        if not (
            _TEST_ID.fullmatch(test)
            and isinstance(value, list)
            and len(value) == 2
            and value[0] in OUTCOMES
            and isinstance(value[1], str)
            and _DIGEST.fullmatch(value[1])
        ):
            return TestRun(None, error="report's test entry of the wrong shape")
        out[test] = (value[0], value[1])
    return TestRun(out, load_error, module_file=module_file)
