"""The bundled task of `zeroxla grpo`: multi-digit arithmetic word problems with a `####` answer,
generated locally and deterministically from a seed (no download).

    prompt      "    Mia has 47 pens and gets 38 more. How many? "   (left-padded to a width)
    completion  "#### 85\n"
    answer      "85"

Every prompt is left-padded with spaces to the same number of characters (`prompt_width`):
our models take no attention mask, so a batch of prompts must have one length, and a character
tokenizer turns the padded text into exactly that many tokens. The answer ends with a newline,
the end-of-answer token of the rollouts. `ALPHABET` holds every character the task writes, the
vocabulary of its character tokenizer. Train and held-out problems are disjoint by
construction (`split_problems`), so held-out accuracy measures arithmetic, not recall.
"""

from __future__ import annotations

import string

import numpy as np

NAMES = ("Mia", "Tom", "Ann", "Leo", "Ivy", "Sam", "Zoe", "Max")
ITEMS = ("pens", "cups", "eggs", "toys", "hats", "keys", "jars", "maps")
# (template, operation): the result of each is non-negative by construction (`_operands`).
TEMPLATES = (("{name} has {a} {item} and gets {b} more. How many? ", "+"),
             ("{name} has {a} {item} and gives away {b}. How many? ", "-"),
             ("{name} buys {a} {item}, then {b} more. Total? ", "+"))
ALPHABET = "".join(sorted(set(" \n#.,?-" + string.digits + "".join(NAMES) + "".join(ITEMS)
                              + "".join(t for t, _ in TEMPLATES).replace("{", "").replace(
                                  "}", ""))))
END = "\n"
MARKER = "#### "


def _operands(rng: np.random.Generator, digits: int, op: str) -> tuple[int, int]:
    low, high = 10 ** (digits - 1), 10 ** digits
    a, b = (int(x) for x in rng.integers(low, high, 2))
    return (max(a, b), min(a, b)) if op == "-" else (a, b)


def prompt_width(digits: int) -> int:
    """The characters of every prompt with `digits`-digit operands (the longest template's)."""
    longest = max(len(t.format(name="Mia", item="pens", a="0" * digits, b="0" * digits))
                  for t, _ in TEMPLATES)
    return longest


def make_problem(rng: np.random.Generator, digits: int) -> dict[str, str]:
    """One problem: {"prompt", "completion", "answer"} (see the module docstring)."""
    template, op = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    a, b = _operands(rng, digits, op)
    text = template.format(name=NAMES[int(rng.integers(len(NAMES)))],
                           item=ITEMS[int(rng.integers(len(ITEMS)))], a=a, b=b)
    answer = str(a + b if op == "+" else a - b)
    return {"prompt": text.rjust(prompt_width(digits)), "completion": f"{MARKER}{answer}{END}",
            "answer": answer}


def split_problems(n_train: int, n_test: int, *, seed: int = 0,
                   digits: int = 2) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """`n_train` and `n_test` distinct problems (no prompt in both), drawn from `seed`."""
    if digits < 1 or n_train < 0 or n_test < 0:
        raise ValueError(f"digits={digits}, n_train={n_train}, n_test={n_test}: accepted: "
                         "digits >= 1 and counts >= 0")
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    problems = []
    limit = 50 * (n_train + n_test) + 100
    while len(problems) < n_train + n_test:
        limit -= 1
        if limit < 0:
            raise ValueError(f"only {len(problems)} distinct {digits}-digit problems found for "
                             f"n_train + n_test = {n_train + n_test}; accepted: fewer problems "
                             "or more digits")
        problem = make_problem(rng, digits)
        if problem["prompt"] not in seen:
            seen.add(problem["prompt"])
            problems.append(problem)
    return problems[:n_train], problems[n_train:]


__all__ = ["ALPHABET", "END", "MARKER", "make_problem", "prompt_width", "split_problems"]
