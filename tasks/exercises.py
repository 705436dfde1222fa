"""Small function-writing exercises, generated from a seed in tiers of difficulty: code tasks a
135M-parameter model can climb.

Each exercise is one function to write from its signature and docstring (with one worked
example), in HumanEval's form, and is graded the way HumanEval is (`meshrl.tasks.humaneval`):
the answer runs in the sandbox on the hidden test inputs and only its results, as literals, come
back to be compared on the host with the reference solution's. The hidden inputs are not the
docstring's example, so an answer that only echoes the example fails.

Tiers: 1, one operation (add a constant, repeat a string, test divisibility); 2, a loop or a
filter over a list or string (sum the numbers above a bound, count a letter); 3, two steps
(a digit sum, running totals, a custom FizzBuzz). Families take their constants, names and inputs
from the seed, so `count` exercises are distinct problems; every fifth is held out
(`split = "test"`), and evaluation takes those.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshrl.tasks.humaneval import FunctionTask

INPUTS = 6  # hidden test inputs per exercise
LETTERS = "abcdefghijklmnopqrstuvwxyz"
WORDS = ("apple", "river", "stone", "cloud", "garden", "tiger", "piano", "lemon", "rocket", "maple", "ocean",
         "pencil", "violet", "castle", "banana", "desert", "window", "silver", "turtle", "forest")  # fmt: skip
NUMBER_NAMES = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


@dataclass(frozen=True)
class Exercise:
    """One function to write: `signature` (`name(params) -> type`), what it does, its reference body
    (indented), and the argument tuples it is tested on (the first is the docstring's example)."""

    name: str
    signature: str
    doc: str
    body: str
    inputs: list[tuple[Any, ...]]


def _numbers(rng: random.Random, low: int = -9, high: int = 20) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(3, 7))]


def _word(rng: random.Random) -> str:
    return rng.choice(WORDS)


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))


def _inputs(rng: random.Random, draw: Callable[[], tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return [draw() for _ in range(INPUTS + 1)]


# ------------------------------------------------------------------ tier 1: one operation


def add_constant(rng: random.Random) -> Exercise:
    k = rng.randint(2, 9)
    return Exercise(f"add_{NUMBER_NAMES[k]}", "(x: int) -> int", f"Return x plus {k}.", f"    return x + {k}\n",
                    _inputs(rng, lambda: (rng.randint(-50, 50),)))  # fmt: skip


def multiply(rng: random.Random) -> Exercise:
    k = rng.randint(2, 9)
    return Exercise(f"times_{NUMBER_NAMES[k]}", "(x: int) -> int", f"Return x multiplied by {k}.",
                    f"    return x * {k}\n", _inputs(rng, lambda: (rng.randint(-30, 30),)))  # fmt: skip


def repeat(rng: random.Random) -> Exercise:
    k = rng.randint(2, 5)
    return Exercise(f"repeat_{NUMBER_NAMES[k]}_times", "(s: str) -> str", f"Return the string s repeated {k} times.",
                    f"    return s * {k}\n", _inputs(rng, lambda: (_word(rng),)))  # fmt: skip


def is_multiple(rng: random.Random) -> Exercise:
    k = rng.randint(2, 9)
    return Exercise(f"is_multiple_of_{NUMBER_NAMES[k]}", "(n: int) -> bool",
                    f"Return True if n is divisible by {k}, otherwise False.", f"    return n % {k} == 0\n",
                    _inputs(rng, lambda: (rng.randint(0, 100),)))  # fmt: skip


def first_chars(rng: random.Random) -> Exercise:
    k = rng.randint(2, 4)
    return Exercise(f"first_{NUMBER_NAMES[k]}_letters", "(s: str) -> str",
                    f"Return the first {k} characters of s.", f"    return s[:{k}]\n",
                    _inputs(rng, lambda: (_word(rng),)))  # fmt: skip


def last_item(rng: random.Random) -> Exercise:
    name = rng.choice(["last_item", "final_element", "last_number"])
    return Exercise(name, "(numbers: list) -> int", "Return the last element of the list numbers.",
                    "    return numbers[-1]\n", _inputs(rng, lambda: (_numbers(rng),)))  # fmt: skip


# ------------------------------------------------------------------ tier 2: a loop or a filter


def sum_above(rng: random.Random) -> Exercise:
    k = rng.randint(0, 9)
    return Exercise(f"sum_above_{k}", "(numbers: list) -> int", f"Return the sum of the numbers greater than {k}.",
                    f"    return sum(x for x in numbers if x > {k})\n", _inputs(rng, lambda: (_numbers(rng),)))  # fmt: skip


def count_letter(rng: random.Random) -> Exercise:
    letter = rng.choice("aeiorst")
    return Exercise(f"count_{letter}", "(s: str) -> int", f"Return how many times the letter '{letter}' appears in s.",
                    f"    return s.count({letter!r})\n", _inputs(rng, lambda: (_sentence(rng),)))  # fmt: skip


def add_to_each(rng: random.Random) -> Exercise:
    k = rng.randint(2, 9)
    return Exercise(f"add_{NUMBER_NAMES[k]}_to_each", "(numbers: list) -> list",
                    f"Return a new list with {k} added to every number.", f"    return [x + {k} for x in numbers]\n",
                    _inputs(rng, lambda: (_numbers(rng),)))  # fmt: skip


def keep_multiples(rng: random.Random) -> Exercise:
    k = rng.randint(2, 5)
    return Exercise(f"multiples_of_{NUMBER_NAMES[k]}", "(numbers: list) -> list",
                    f"Return the numbers that are divisible by {k}, in their order.",
                    f"    return [x for x in numbers if x % {k} == 0]\n",
                    _inputs(rng, lambda: (_numbers(rng, 0, 30),)))  # fmt: skip


def count_longer(rng: random.Random) -> Exercise:
    k = rng.randint(3, 6)
    return Exercise(f"count_longer_than_{NUMBER_NAMES[k]}", "(words: list) -> int",
                    f"Return how many words in the list have more than {k} letters.",
                    f"    return sum(1 for w in words if len(w) > {k})\n",
                    _inputs(rng, lambda: (_sentence(rng).split(),)))  # fmt: skip


def replace_letter(rng: random.Random) -> Exercise:
    old, new = rng.sample("aeiou", 2)
    return Exercise(f"replace_{old}_with_{new}", "(s: str) -> str",
                    f"Return s with every '{old}' replaced by '{new}'.", f"    return s.replace({old!r}, {new!r})\n",
                    _inputs(rng, lambda: (_sentence(rng),)))  # fmt: skip


# ------------------------------------------------------------------ tier 3: two steps


def digit_sum(rng: random.Random) -> Exercise:
    name = rng.choice(["digit_sum", "sum_of_digits", "add_digits"])
    return Exercise(name, "(n: int) -> int", "Return the sum of the decimal digits of the non-negative integer n.",
                    "    return sum(int(d) for d in str(n))\n", _inputs(rng, lambda: (rng.randint(0, 99999),)))  # fmt: skip


def running_totals(rng: random.Random) -> Exercise:
    name = rng.choice(["running_totals", "prefix_sums", "cumulative_sums"])
    body = "    totals, total = [], 0\n    for x in numbers:\n        total += x\n        totals.append(total)\n    return totals\n"
    return Exercise(name, "(numbers: list) -> list",
                    "Return the list of running totals: element i is the sum of numbers[0] to numbers[i].", body,
                    _inputs(rng, lambda: (_numbers(rng),)))  # fmt: skip


def custom_fizzbuzz(rng: random.Random) -> Exercise:
    a, b = rng.sample([2, 3, 5, 7], 2)
    word_a, word_b = rng.sample(["Fizz", "Buzz", "Ping", "Pong", "Zap"], 2)
    body = (f"    out = []\n    for i in range(1, n + 1):\n        word = ('{word_a}' if i % {a} == 0 else '') + "
            f"('{word_b}' if i % {b} == 0 else '')\n        out.append(word or str(i))\n    return out\n")  # fmt: skip
    doc = (f"Return a list of strings for the numbers 1 to n: '{word_a}' for multiples of {a}, '{word_b}' for "
           f"multiples of {b}, '{word_a}{word_b}' for multiples of both, else the number as a string.")  # fmt: skip
    return Exercise(f"{word_a.lower()}_{word_b.lower()}", "(n: int) -> list", doc, body,
                    _inputs(rng, lambda: (rng.randint(1, 16),)))  # fmt: skip


def count_vowels(rng: random.Random) -> Exercise:
    name = rng.choice(["count_vowels", "vowel_count", "number_of_vowels"])
    return Exercise(name, "(s: str) -> int", "Return how many vowels (a, e, i, o, u) s contains.",
                    "    return sum(1 for c in s if c in 'aeiou')\n", _inputs(rng, lambda: (_sentence(rng),)))  # fmt: skip


def spread(rng: random.Random) -> Exercise:
    name = rng.choice(["spread", "value_range", "max_minus_min"])
    return Exercise(name, "(numbers: list) -> int", "Return the largest number minus the smallest number.",
                    "    return max(numbers) - min(numbers)\n", _inputs(rng, lambda: (_numbers(rng),)))  # fmt: skip


def reverse_words(rng: random.Random) -> Exercise:
    name = rng.choice(["reverse_words", "words_backwards", "flip_word_order"])
    return Exercise(name, "(sentence: str) -> str", "Return the words of sentence in reverse order, joined by spaces.",
                    "    return ' '.join(reversed(sentence.split()))\n", _inputs(rng, lambda: (_sentence(rng),)))  # fmt: skip


FAMILIES: dict[int, tuple[Callable[[random.Random], Exercise], ...]] = {
    1: (add_constant, multiply, repeat, is_multiple, first_chars, last_item),
    2: (sum_above, count_letter, add_to_each, keep_multiples, count_longer, replace_letter),
    3: (digit_sum, running_totals, custom_fizzbuzz, count_vowels, spread, reverse_words),
}


def reference(exercise: Exercise) -> Callable[..., Any]:
    """The reference solution as a function (trusted code: this module wrote it)."""
    namespace: dict[str, Any] = {}
    exec(f"def {exercise.name}{exercise.signature}:\n{exercise.body}", namespace)
    return namespace[exercise.name]


def informative(exercise: Exercise, solve: Callable[..., Any]) -> bool:
    """Whether the hidden tests fail every answer that ignores the problem: a constant (their
    results differ) and the argument itself (some result is not it). Without this a draw can be
    passed by `return False` (six numbers none of which is a multiple of 9: 49% of draws)."""
    hidden = exercise.inputs[1:]
    results = [solve(*args) for args in hidden]
    return len({repr(r) for r in results}) > 1 and any(r != args[0] for r, args in zip(results, hidden))


def problem(task_id: str, family: str, exercise: Exercise, solve: Callable[..., Any]) -> dict[str, Any]:
    """The exercise in HumanEval's form (and its family's name, and the docstring's example call and
    result): the docstring shows the first input's result, `check` asserts the others' (the hidden
    tests), with `solve` the reference."""
    example, hidden = exercise.inputs[0], exercise.inputs[1:]
    call = f"{exercise.name}({', '.join(map(repr, example))})"
    prompt = (f'def {exercise.name}{exercise.signature}:\n    """{exercise.doc}\n    >>> {call}\n'
              f'    {solve(*example)!r}\n    """\n')  # fmt: skip
    asserts = "".join(f"    assert candidate(*{args!r}) == {solve(*args)!r}\n" for args in hidden)
    return {"task_id": task_id, "prompt": prompt, "canonical_solution": exercise.body,
            "test": f"def check(candidate):\n{asserts}", "entry_point": exercise.name, "family": family,
            "example": call, "expected": repr(solve(*example))}  # fmt: skip


def exercises(seed: int, count: int, tiers: tuple[int, ...]) -> list[dict[str, Any]]:
    """`count` exercises from `seed`, cycling through the tiers' families in a shuffled order; a draw
    that is not `informative`, or repeats an earlier one, is skipped."""
    rng = random.Random(seed)
    families = [family for tier in tiers for family in FAMILIES[tier]]
    out: list[dict[str, Any]] = []
    prompts: set[str] = set()
    while len(out) < count:
        order = rng.sample(families, len(families))
        for family in order:
            if len(out) == count:
                break
            exercise = family(rng)
            solve = reference(exercise)
            if not informative(exercise, solve):
                continue
            made = problem(f"exercises/{seed}/{len(out)}", family.__name__, exercise, solve)
            if made["prompt"] + made["test"] not in prompts:
                prompts.add(made["prompt"] + made["test"])
                out.append(made)
    return out


class ExercisesTask(FunctionTask):
    """`count` exercises of the `tiers` from `seed` (every fifth held out); one turn by default,
    `run_python = True` to let the policy test its code in the sandbox before it answers (its
    demonstrations then run the example, `recovery_rate` of them after a bugged run)."""

    def __init__(
        self,
        tiers: list[int] | tuple[int, ...] = (1, 2),
        count: int = 500,
        seed: int = 0,
        split: str = "train",
        max_turns: int = 3,
        run_python: bool = False,
        sandbox: dict[str, Any] | None = None,
        recovery_rate: float = 0.5,
    ) -> None:
        unknown = sorted(set(tiers) - set(FAMILIES))
        if unknown or not tiers:
            raise ValueError(f"task.kwargs.tiers {list(tiers)}: a non-empty list of {sorted(FAMILIES)}")
        if count < 5:
            raise ValueError(f"task.kwargs.count {count}: at least 5 (every fifth exercise is held out)")
        problems = exercises(seed, count, tuple(tiers))
        super().__init__(problems, split, max_turns, run_python, sandbox, recovery_rate)
