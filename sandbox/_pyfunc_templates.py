"""The templates of the pyfunc family (`sandbox.pyfunc_tasks`): one Python function each, parameterised.

A template is a function's signature, a one-sentence docstring, a reference body and the parameter values
that make it a family of tasks (``$k`` in the docstring and the body, `string.Template` syntax, so that the
bodies' own braces need no escaping), with a way to draw arguments for its hidden tests. The reference body is
the only definition of what a task asks: the builder runs it to write the docstring's examples and the tests.

Difficulty 1 is one expression over one argument, 2 a filter, a fold or a lookup with a condition, 3 a few
steps (state across a loop, grouping, sorting by a key), 4 a small algorithm (runs, windows, dynamic
programming, a simulation). The entry points, and the problems, are not HumanEval's
(``tests/sandbox/test_pyfunc_tasks.py`` checks both against the pinned benchmark).
"""

from __future__ import annotations

import itertools
import math
import random
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TEMPLATES", "Template"]

Params = Mapping[str, int | str]
Draw = Callable[[random.Random, Params], tuple[Any, ...]]


@dataclass(frozen=True)
class Template:
    """One parameterised function-completion problem.

    Attributes:
        name: the entry point (the function's name), unique among templates.
        difficulty: 1 (one expression) to 4 (a small algorithm).
        args: the signature's parameters, annotated (``"items: list[int]"``).
        returns: the return annotation.
        doc: the docstring's description, with ``$param`` placeholders.
        body: the reference body without indentation, with ``$param`` placeholders.
        params: one mapping of placeholder values per task, in a fixed order (neighbours must differ in answer).
        draw: the arguments of one hidden test (a fresh draw each call) for these parameter values.
        edges: arguments every task of the template is tested on as well (an empty list, zero).
    """

    name: str
    difficulty: int
    args: str
    returns: str
    doc: str
    body: str
    params: tuple[Params, ...]
    draw: Draw
    edges: tuple[tuple[Any, ...], ...] = ()


def _grid(**values: Iterable[int | str]) -> tuple[Params, ...]:
    """Every combination of the given values, the last name varying fastest."""
    names = list(values)
    return tuple(dict(zip(names, combo, strict=True)) for combo in itertools.product(*values.values()))


_LOWER = string.ascii_lowercase
_LETTERS = _grid(c=_LOWER)
_VOCAB = ("ant", "bee", "cat", "dog", "elk", "fox", "gnu", "hen", "owl", "yak")
_NAMES = ("ada", "bea", "cy", "dan", "eli", "fay", "gil", "hal", "ida", "jon", "kim", "lou", "mia", "ned", "oli",
          "pam", "quin", "rex", "sal", "tom", "uma", "val", "wes", "xia", "yve", "zed")


def _ints(r: random.Random, lo: int = 0, hi: int = 30, size: tuple[int, int] = (0, 8)) -> list[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(*size))]


def _around(r: random.Random, k: int, spread: int = 4, size: tuple[int, int] = (1, 9)) -> list[int]:
    """Items near ``k``: a threshold at k is crossed, and met, in most lists."""
    return [r.randint(max(0, k - spread), k + spread) for _ in range(r.randint(*size))]


def _word(r: random.Random, letters: str = "abcdefgh", size: tuple[int, int] = (1, 9), extra: str = "") -> str:
    alphabet = letters + extra * 3
    return "".join(r.choice(alphabet) for _ in range(r.randint(*size)))


def _runs(r: random.Random, letters: str = "abc", size: tuple[int, int] = (1, 6)) -> str:
    """Runs of repeated letters (``aaabcc``), for the templates about runs."""
    return "".join(r.choice(letters) * r.randint(1, 5) for _ in range(r.randint(*size)))


def _sentence(r: random.Random, size: tuple[int, int] = (1, 8), extra: str = "") -> str:
    return " ".join(_word(r, size=(1, 10), extra=extra) for _ in range(r.randint(*size)))


def _vocab_sentence(r: random.Random, size: tuple[int, int] = (1, 12)) -> str:
    """Words from a small vocabulary, so that words repeat."""
    vocab = r.sample(_VOCAB, r.randint(2, 6))
    return " ".join(r.choice(vocab) for _ in range(r.randint(*size)))


def _scores(r: random.Random, lo: int = 0, hi: int = 40, size: tuple[int, int] = (0, 7),
            first: str = "", pool: int = len(_NAMES)) -> dict[str, int]:
    names = list(_NAMES[:pool])
    if first:  # some keys start with this letter
        names += [first + n[1:] for n in _NAMES[:6]]
    keys = r.sample(names, r.randint(*size))
    return {key: r.randint(lo, hi) for key in keys}


def _walk(r: random.Random, step: int, size: tuple[int, int] = (0, 9)) -> list[int]:
    """A random walk whose steps are at most ``step`` apart: neighbours' gaps straddle a bound near it."""
    out = [r.randint(0, 50)]
    for _ in range(r.randint(*size)):
        out.append(out[-1] + r.randint(-step, step))
    return out


def _with_runs(r: random.Random, k: int) -> list[int]:
    """A list holding stretches that rise by ``k`` each step, between random items."""
    out: list[int] = []
    for _ in range(r.randint(1, 4)):
        if r.random() < 0.5:
            start = r.randint(0, 20)
            out += [start + k * i for i in range(r.randint(1, 5))]
        else:
            out += _ints(r, size=(1, 3))
    return out


def _spans(r: random.Random) -> list[list[int]]:
    spans = []
    for _ in range(r.randint(0, 6)):
        start = r.randint(0, 40)
        spans.append([start, start + r.randint(0, 6)])
    return spans


def _digit_text(r: random.Random) -> str:
    return "".join(r.choice("0123456789" * 2 + "ab-") for _ in range(r.randint(0, 12)))


def _sorted_distinct(r: random.Random) -> list[int]:
    return sorted(r.sample(range(0, 25), r.randint(0, 12)))


T = Template
_D1: tuple[Template, ...] = (
    T("add_to_each", 1, "items: list[int]", "list[int]", "Return a new list holding every item of items plus $k.",
      "return [x + $k for x in items]", _grid(k=range(1, 41)), lambda r, p: (_ints(r, size=(1, 8)),), (([],),)),
    T("first_multiples", 1, "n: int", "list[int]",
      "Return the first n positive multiples of $k, smallest first (an empty list when n is 0).",
      "return [$k * i for i in range(1, n + 1)]", _grid(k=range(2, 31)), lambda r, p: (r.randint(1, 8),), ((0,),)),
    T("count_letter", 1, "text: str", "int", "Return how many times the letter '$c' occurs in text.",
      "return text.count('$c')", _LETTERS, lambda r, p: (_word(r, extra=str(p["c"])),), (("",),)),
    T("modular_sum", 1, "a: int, b: int", "int", "Return the sum of a and b, modulo $k.", "return (a + b) % $k",
      _grid(k=range(2, 41)), lambda r, p: (r.randint(0, 99), r.randint(0, 99))),
    T("repeat_with_spaces", 1, "word: str", "str", "Return word repeated $k times, with one space between copies.",
      "return ' '.join([word] * $k)", _grid(k=range(2, 10)), lambda r, p: (_word(r),)),
    T("last_items", 1, "items: list[int]", "list[int]",
      "Return the last $k items of items, in order (all of them when items is shorter).",
      "return items[-$k:]", _grid(k=range(1, 11)), lambda r, p: (_ints(r, size=(0, 14)),), (([],),)),
    T("is_multiple", 1, "n: int", "bool", "Return True if n is divisible by $k, and False otherwise.",
      "return n % $k == 0", _grid(k=range(2, 41)),
      lambda r, p: (int(p["k"]) * r.randint(-9, 9) + r.choice((0, r.randint(1, int(p["k"]) - 1))),)),
    T("scale_then_add", 1, "x: int", "int", "Return x multiplied by $k, plus $m.", "return x * $k + $m",
      _grid(k=range(2, 10), m=range(1, 10)), lambda r, p: (r.randint(-50, 50),)),
    T("remove_letter", 1, "text: str", "str", "Return text with every '$c' removed.", "return text.replace('$c', '')",
      _LETTERS, lambda r, p: (_word(r, extra=str(p["c"])),), (("",),)),
    T("double_letter", 1, "text: str", "str", "Return text with every '$c' written twice.",
      "return text.replace('$c', '$c$c')", _LETTERS, lambda r, p: (_word(r, extra=str(p["c"])),)),
    T("starts_with_letter", 1, "word: str", "bool",
      "Return True if word starts with the letter '$c', and False otherwise (also when word is empty).",
      "return word.startswith('$c')", _LETTERS,
      lambda r, p: (r.choice((str(p["c"]), r.choice(_LOWER))) + _word(r, size=(0, 6)),), (("",),)),
    T("quotient_and_remainder", 1, "n: int", "list[int]",
      "Return [q, r]: the quotient and the remainder of n (n >= 0) divided by $k.",
      "return [n // $k, n % $k]", _grid(k=range(2, 31)), lambda r, p: (r.randint(0, 300),)),
    T("items_below", 1, "items: list[int]", "list[int]", "Return the items of items that are less than $k, in order.",
      "return [x for x in items if x < $k]", _grid(k=range(1, 31)), lambda r, p: (_around(r, int(p["k"])),)),
    T("add_suffix", 1, "word: str", "str", "Return word followed by '$s'.", "return word + '$s'",
      _grid(s=("ing", "ed", "er", "ly", "ness", "ful", "less", "able", "ment", "est")),
      lambda r, p: (_word(r),)),
    T("value_or_default", 1, "table: dict[str, int], key: str", "int",
      "Return table[key], or $k when key is not in table.", "return table.get(key, $k)", _grid(k=range(-5, 21)),
      lambda r, p: (_scores(r, size=(1, 5)), r.choice(_NAMES))),
    T("count_above", 1, "items: list[int]", "int", "Return how many items of items are greater than $k.",
      "return sum(1 for x in items if x > $k)", _grid(k=range(0, 31)), lambda r, p: (_around(r, int(p["k"])),)),
    T("replace_letter", 1, "text: str", "str", "Return text with every '$c' replaced by '$d'.",
      "return text.replace('$c', '$d')", tuple({"c": c, "d": d} for c in "abcdef" for d in "abcdef" if c != d),
      lambda r, p: (_word(r, extra=str(p["c"])),)),
)

_D2: tuple[Template, ...] = (
    T("sum_of_multiples", 2, "items: list[int]", "int",
      "Return the sum of the items of items that are divisible by $k.",
      "return sum(x for x in items if x % $k == 0)", _grid(k=range(2, 21)),
      lambda r, p: (_ints(r, 0, 60, (1, 10)),), (([],),)),
    T("words_longer_than", 2, "sentence: str", "list[str]",
      "Return the words of sentence (separated by single spaces) that have more than $k letters, in order.",
      "return [w for w in sentence.split() if len(w) > $k]", _grid(k=range(1, 9)), lambda r, p: (_sentence(r),)),
    T("names_above", 2, "scores: dict[str, int]", "list[str]",
      "Return the keys of scores whose value is greater than $k, in alphabetical order.",
      "return sorted(name for name, value in scores.items() if value > $k)", _grid(k=range(0, 31)),
      lambda r, p: (_scores(r, max(0, int(p["k"]) - 3), int(p["k"]) + 3),), (({},),)),
    T("count_either", 2, "text: str", "int", "Return how many characters of text are '$c' or '$d'.",
      "return sum(1 for ch in text if ch in '$c$d')",
      tuple({"c": c, "d": d} for c, d in itertools.combinations("abcdefgh", 2)), lambda r, p: (_word(r),)),
    T("clamp_items", 2, "items: list[int]", "list[int]",
      "Return items with every item less than $lo raised to $lo and every item greater than $hi lowered to $hi.",
      "return [min(max(x, $lo), $hi) for x in items]",
      tuple({"lo": lo, "hi": lo + w} for lo in range(10) for w in (5, 10, 15, 20)),
      lambda r, p: (_ints(r, 0, 35, (1, 10)),)),
    T("first_index", 2, "items: list[int]", "int",
      "Return the index of the first item of items equal to $k, or -1 when no item is.",
      "return items.index($k) if $k in items else -1", _grid(k=range(0, 21)),
      lambda r, p: (_around(r, int(p["k"]), 2),), (([],),)),
    T("bump_values", 2, "counts: dict[str, int]", "dict[str, int]",
      "Return a new dict with the keys of counts, each mapped to its value in counts plus $k.",
      "return {key: value + $k for key, value in counts.items()}", _grid(k=range(1, 31)),
      lambda r, p: (_scores(r, size=(1, 5)),), (({},),)),
    T("digit_sum_mod", 2, "n: int", "int", "Return the sum of the decimal digits of n (n >= 0), modulo $k.",
      "return sum(int(d) for d in str(n)) % $k", _grid(k=range(2, 21)), lambda r, p: (r.randint(0, 99999),)),
    T("count_multiples", 2, "n: int", "int",
      "Return how many of the numbers 1, 2, ..., n are divisible by $a or by $b.",
      "return sum(1 for i in range(1, n + 1) if i % $a == 0 or i % $b == 0)",
      tuple({"a": a, "b": b} for a, b in itertools.combinations(range(2, 10), 2)),
      lambda r, p: (r.randint(0, 100),)),
    T("total_for_prefix", 2, "scores: dict[str, int]", "int",
      "Return the sum of the values of scores whose key starts with '$c'.",
      "return sum(value for key, value in scores.items() if key.startswith('$c'))", _LETTERS,
      lambda r, p: (_scores(r, 1, 40, (2, 7), first=str(p["c"])),)),
    T("count_words_with", 2, "sentence: str", "int",
      "Return how many words of sentence (separated by single spaces) contain the letter '$c'.",
      "return sum(1 for w in sentence.split() if '$c' in w)", _LETTERS,
      lambda r, p: (_sentence(r, extra=str(p["c"])),)),
    T("times_divisible", 2, "n: int", "int",
      "Return how many times n (n > 0) can be divided by $k with no remainder, one division after another.",
      "count = 0\nwhile n % $k == 0:\n    n //= $k\n    count += 1\nreturn count", _grid(k=range(2, 13)),
      lambda r, p: (int(p["k"]) ** r.randint(0, 4) * r.randint(1, 20),)),
    T("sum_of_powers", 2, "n: int", "int", "Return 1**$p + 2**$p + ... + n**$p (0 when n is 0).",
      "return sum(i ** $p for i in range(1, n + 1))", _grid(p=range(2, 7)), lambda r, p: (r.randint(1, 15),), ((0,),)),
    T("every_kth", 2, "items: list[int]", "list[int]",
      "Return every $k-th item of items, starting with the item at index $s.", "return items[$s::$k]",
      tuple({"k": k, "s": s} for k in range(2, 7) for s in range(k)),
      lambda r, p: (_ints(r, size=(4, 14)),), (([],),)),
    T("count_between", 2, "items: list[int]", "int", "Return how many items x of items satisfy $lo <= x <= $hi.",
      "return sum(1 for x in items if $lo <= x <= $hi)",
      tuple({"lo": lo, "hi": lo + 3 * j} for lo in range(10) for j in range(1, 6)),
      lambda r, p: (_ints(r, 0, 30, (1, 10)),)),
    T("zero_pad", 2, "items: list[int]", "list[str]",
      "Return every item of items (all >= 0) as a string of at least $k characters, zeros added on the left.",
      "return [str(x).zfill($k) for x in items]", _grid(k=range(2, 9)),
      lambda r, p: ([r.randint(0, 10 ** r.randint(1, 6)) for _ in range(r.randint(1, 5))],)),
    T("weighted_sum", 2, "items: list[int]", "int",
      "Return the sum of items[i] * (i + $k) over every index i of items.",
      "return sum(x * (i + $k) for i, x in enumerate(items))", _grid(k=range(0, 21)),
      lambda r, p: (_ints(r, -10, 20, (1, 8)),), (([],),)),
    T("column_total", 2, "rows: list[list[int]]", "int",
      "Return the sum of column $k (counting from 0) of rows; a row with no such column counts as 0.",
      "return sum(row[$k] for row in rows if len(row) > $k)", _grid(k=range(0, 6)),
      lambda r, p: ([_ints(r, 0, 9, (0, 7)) for _ in range(r.randint(1, 5))],)),
)

_D3: tuple[Template, ...] = (
    T("rotate_left", 3, "items: list[int]", "list[int]",
      "Return items rotated $k places to the left: $k times, the first item moves to the back "
      "(an empty list stays empty).",
      "if not items:\n    return []\nshift = $k % len(items)\nreturn items[shift:] + items[:shift]",
      _grid(k=range(1, 10)), lambda r, p: (_ints(r, size=(2, 12)),), (([],),)),
    T("running_sums_mod", 3, "items: list[int]", "list[int]",
      "Return the running sums of items (of the first item, of the first two, and so on), each modulo $k.",
      "total = 0\nsums = []\nfor x in items:\n    total += x\n    sums.append(total % $k)\nreturn sums",
      _grid(k=range(2, 21)), lambda r, p: (_ints(r, size=(1, 8)),)),
    T("chunk_sums", 3, "items: list[int]", "list[int]",
      "Split items into consecutive chunks of $k items (the last may be shorter) and return each chunk's sum, "
      "in order.",
      "return [sum(items[i:i + $k]) for i in range(0, len(items), $k)]", _grid(k=range(2, 9)),
      lambda r, p: (_ints(r, size=(3, 16)),), (([],),)),
    T("group_by_remainder", 3, "scores: dict[str, int]", "dict[int, list[str]]",
      "Return a dict mapping each remainder of a value of scores divided by $k to the keys whose value leaves "
      "that remainder, in alphabetical order.",
      "groups = {}\nfor key in sorted(scores):\n    groups.setdefault(scores[key] % $k, []).append(key)\n"
      "return groups", _grid(k=range(2, 10)), lambda r, p: (_scores(r, size=(1, 7)),)),
    T("mask_digits", 3, "text: str", "str",
      "Return text with every digit replaced by '$c', except the last $k digits of text, which stay as they are.",
      "total = sum(ch.isdigit() for ch in text)\nseen = 0\nout = []\nfor ch in text:\n    if ch.isdigit():\n"
      "        seen += 1\n        out.append(ch if seen > total - $k else '$c')\n    else:\n        out.append(ch)\n"
      "return ''.join(out)", _grid(k=range(1, 7), c=("#", "*", "x")), lambda r, p: (_digit_text(r),)),
    T("count_pairs_with_sum", 3, "items: list[int]", "int",
      "Return how many pairs of indexes i < j have items[i] + items[j] == $k.",
      "return sum(1 for i in range(len(items)) for j in range(i + 1, len(items)) if items[i] + items[j] == $k)",
      _grid(k=range(1, 31)), lambda r, p: (_ints(r, 0, int(p["k"]) + 1, (2, 9)),)),
    T("upper_every_kth", 3, "text: str", "str",
      "Return text with the characters at indexes 0, $k, 2 * $k, ... made uppercase and the others unchanged.",
      "return ''.join(ch.upper() if i % $k == 0 else ch for i, ch in enumerate(text))", _grid(k=range(2, 8)),
      lambda r, p: (_word(r, _LOWER, (3, 16)),)),
    T("merge_counts", 3, "a: dict[str, int], b: dict[str, int]", "dict[str, int]",
      "Return a dict mapping every key of a or b whose total (its value in a plus its value in b, a missing "
      "value counting as 0) is at least $k to that total.",
      "totals = dict(a)\nfor key, value in b.items():\n    totals[key] = totals.get(key, 0) + value\n"
      "return {key: value for key, value in totals.items() if value >= $k}", _grid(k=range(1, 21)),
      lambda r, p: (_scores(r, 0, 15, (1, 5), pool=6), _scores(r, 0, 15, (1, 5), pool=6))),
    T("words_by_length", 3, "words: list[str]", "dict[int, list[str]]",
      "Return a dict mapping each length of at least $k to the words of words with that length, in their order.",
      "groups = {}\nfor w in words:\n    if len(w) >= $k:\n        groups.setdefault(len(w), []).append(w)\n"
      "return groups", _grid(k=range(1, 7)), lambda r, p: ([_word(r, size=(1, 8)) for _ in range(r.randint(1, 7))],)),
    T("digits_in_base", 3, "n: int", "list[int]",
      "Return the digits of n (n >= 0) in base $b, most significant first ([0] when n is 0).",
      "digits = []\nwhile n:\n    digits.append(n % $b)\n    n //= $b\nreturn digits[::-1] or [0]",
      _grid(b=range(2, 21)), lambda r, p: (r.randint(1, 5000),), ((0,),)),
    T("sequence_term", 3, "n: int", "int",
      "A sequence starts $a, $b, and each later term is the sum of the two before it. Return its term at "
      "index n (n >= 0; index 0 is $a).",
      "x, y = $a, $b\nfor _ in range(n):\n    x, y = y, x + y\nreturn x",
      tuple({"a": a, "b": b} for a in range(6) for b in range(1, 7) if (a, b) not in ((0, 1), (1, 1))),
      lambda r, p: (r.randint(0, 20),)),
    T("sort_by_remainder", 3, "items: list[int]", "list[int]",
      "Return items sorted by their remainder when divided by $k, smallest remainder first; items with equal "
      "remainders keep their order.",
      "return sorted(items, key=lambda x: x % $k)", _grid(k=range(2, 13)), lambda r, p: (_ints(r, size=(2, 10)),)),
    T("steps_at_most", 3, "items: list[int]", "bool",
      "Return True if every two neighbouring items of items differ by at most $k (also when items has fewer "
      "than two items), and False otherwise.",
      "return all(abs(x - y) <= $k for x, y in zip(items, items[1:]))", _grid(k=range(0, 16)),
      lambda r, p: (_walk(r, int(p["k"]) + 1, (1, 5)),)),
    T("best_window_sum", 3, "items: list[int]", "int | None",
      "Return the largest sum of $k consecutive items of items, or None when items has fewer than $k items.",
      "if len(items) < $k:\n    return None\nreturn max(sum(items[i:i + $k]) for i in range(len(items) - $k + 1))",
      _grid(k=range(1, 9)), lambda r, p: (_ints(r, -10, 20, (0, 12)),)),
    T("frequent_words", 3, "sentence: str", "dict[str, int]",
      "Return a dict mapping each word that occurs at least $k times in sentence (words are separated by "
      "single spaces) to how many times it occurs.",
      "counts = {}\nfor w in sentence.split():\n    counts[w] = counts.get(w, 0) + 1\n"
      "return {w: c for w, c in counts.items() if c >= $k}", _grid(k=range(1, 5)),
      lambda r, p: (_vocab_sentence(r),)),
    T("polygonal_number", 3, "n: int", "int",
      "Return the n-th $s-gonal number (n >= 1), ((s - 2) * n * n - (s - 4) * n) / 2 with s = $s.",
      "return (($s - 2) * n * n - ($s - 4) * n) // 2", _grid(s=range(3, 13)), lambda r, p: (r.randint(1, 30),)),
    T("collapse_runs", 3, "text: str", "str",
      "Return text with every run of more than $k equal characters in a row cut down to $k characters.",
      "out = []\nrun = 0\nfor i, ch in enumerate(text):\n    run = run + 1 if i and text[i - 1] == ch else 1\n"
      "    if run <= $k:\n        out.append(ch)\nreturn ''.join(out)", _grid(k=range(1, 6)),
      lambda r, p: (_runs(r),)),
    T("top_scorers", 3, "scores: dict[str, int]", "list[str]",
      "Return the keys of the $k highest values of scores, highest first, keys of equal values in alphabetical "
      "order (all keys when there are fewer than $k).",
      "return sorted(scores, key=lambda key: (-scores[key], key))[:$k]", _grid(k=range(1, 6)),
      lambda r, p: (_scores(r, 0, 9, (1, 8)),)),
    T("diagonal_sum", 3, "grid: list[list[int]]", "int",
      "Return the sum of the cells grid[i][j] with j - i == $k.",
      "return sum(row[i + $k] for i, row in enumerate(grid) if 0 <= i + $k < len(row))", _grid(k=range(-3, 4)),
      lambda r, p: ([_ints(r, 0, 9, (4, 4)) for _ in range(r.randint(1, 5))],)),
    T("prefix_within", 3, "items: list[int]", "list[int]",
      "Return the longest prefix of items (all >= 0) whose sum is at most $k.",
      "total = 0\nfor i, x in enumerate(items):\n    total += x\n    if total > $k:\n        return items[:i]\n"
      "return items", _grid(k=range(0, 41)), lambda r, p: (_ints(r, 0, 12, (1, 10)),)),
    T("lowest_balance", 3, "changes: list[int]", "int",
      "An account holds $k, and each item of changes is added to it in turn. Return the lowest amount it holds "
      "at any time, the start included.",
      "balance = lowest = $k\nfor change in changes:\n    balance += change\n    lowest = min(lowest, balance)\n"
      "return lowest", _grid(k=range(0, 31)), lambda r, p: (_ints(r, -15, 15, (1, 8)),)),
    T("split_on_letter", 3, "text: str", "list[str]",
      "Split text at every '$c', drop the empty pieces, and return the pieces sorted by length, pieces of "
      "equal length in alphabetical order.",
      "return sorted((piece for piece in text.split('$c') if piece), key=lambda piece: (len(piece), piece))",
      _LETTERS, lambda r, p: (_word(r, size=(4, 16), extra=str(p["c"])),)),
    T("run_length_encode", 3, "text: str", "str",
      "Return text with every run of at least $k equal characters in a row written as the character followed "
      "by the run's length; shorter runs stay as they are.",
      "out = []\ni = 0\nwhile i < len(text):\n    j = i\n    while j < len(text) and text[j] == text[i]:\n"
      "        j += 1\n    out.append(text[i] + str(j - i) if j - i >= $k else text[i:j])\n    i = j\n"
      "return ''.join(out)", _grid(k=range(2, 6)), lambda r, p: (_runs(r),)),
    T("digit_occurrences", 3, "n: int", "int",
      "Return how many times the digit $d is written when the numbers 1, 2, ..., n are written in decimal.",
      "return sum(str(i).count('$d') for i in range(1, n + 1))", _grid(d=range(10)),
      lambda r, p: (r.randint(0, 300),)),
)

_D4: tuple[Template, ...] = (
    T("longest_run_above", 4, "items: list[int]", "int",
      "Return the length of the longest run of consecutive items of items that are all greater than $k "
      "(0 when there is none).",
      "best = run = 0\nfor x in items:\n    run = run + 1 if x > $k else 0\n    best = max(best, run)\nreturn best",
      _grid(k=range(0, 41)), lambda r, p: (_around(r, int(p["k"]), 3, (1, 14)),), (([],),)),
    T("kth_largest_distinct", 4, "items: list[int]", "int | None",
      "Sort the distinct values of items from largest to smallest and return the one at place $k (place 1 is "
      "the largest), or None when there are fewer than $k distinct values.",
      "values = sorted(set(items), reverse=True)\nreturn values[$k - 1] if len(values) >= $k else None",
      _grid(k=range(1, 7)), lambda r, p: (_ints(r, 0, 20, (1, 12)),)),
    T("sum_primes_with_remainder", 4, "n: int", "int",
      "Return the sum of the prime numbers p <= n that leave remainder $r when divided by $m.",
      "total = 0\nfor p in range(2, n + 1):\n    if p % $m == $r and all(p % d for d in range(2, int(p ** 0.5) + 1)):\n"
      "        total += p\nreturn total",
      tuple({"m": m, "r": r} for m in range(3, 9) for r in range(1, m) if math.gcd(m, r) == 1),
      lambda r, p: (r.randint(0, 200),)),
    T("most_frequent_words", 4, "text: str", "list[str]",
      "Return the $k most frequent words of text (separated by single spaces), most frequent first, equally "
      "frequent words in alphabetical order (all words when there are fewer than $k).",
      "counts = {}\nfor w in text.split():\n    counts[w] = counts.get(w, 0) + 1\n"
      "return sorted(counts, key=lambda w: (-counts[w], w))[:$k]", _grid(k=range(1, 6)),
      lambda r, p: (_vocab_sentence(r),)),
    T("merge_intervals", 4, "spans: list[list[int]]", "list[list[int]]",
      "Each item of spans is an interval [start, end] with start <= end. Merge intervals that overlap or lie at "
      "most $k apart (the later start minus the earlier end is at most $k) and return the merged intervals "
      "sorted by start.",
      "merged = []\nfor start, end in sorted(spans):\n    if merged and start - merged[-1][1] <= $k:\n"
      "        merged[-1][1] = max(merged[-1][1], end)\n    else:\n        merged.append([start, end])\n"
      "return merged", _grid(k=range(0, 11)), lambda r, p: (_spans(r),), (([],),)),
    T("format_ranges", 4, "items: list[int]", "str",
      "items is sorted and has no repeats. Return it as comma-separated parts, no spaces: each run of at least "
      "$k consecutive numbers as 'first-last', every other number alone.",
      "parts = []\ni = 0\nwhile i < len(items):\n    j = i\n"
      "    while j + 1 < len(items) and items[j + 1] == items[j] + 1:\n        j += 1\n"
      "    if j - i + 1 >= $k:\n        parts.append(f'{items[i]}-{items[j]}')\n        i = j + 1\n"
      "    else:\n        parts.append(str(items[i]))\n        i += 1\nreturn ','.join(parts)",
      _grid(k=range(2, 6)), lambda r, p: (_sorted_distinct(r),)),
    T("pair_with_sum", 4, "items: list[int]", "list[int]",
      "Return [i, j], the indexes (i < j) of two items of items adding up to $k with the smallest j, and for "
      "that j the smallest i; return [] when no two items add up to $k.",
      "for j in range(len(items)):\n    for i in range(j):\n        if items[i] + items[j] == $k:\n"
      "            return [i, j]\nreturn []", _grid(k=range(0, 61)),
      lambda r, p: (_ints(r, 0, int(p["k"]) + 1, (2, 9)),)),
    T("repeated_digit_sum", 4, "n: int", "int",
      "Write n (n >= 0) in base $b and replace it by the sum of its digits; repeat until it is less than $b, "
      "and return it.",
      "while n >= $b:\n    total = 0\n    while n:\n        total += n % $b\n        n //= $b\n    n = total\n"
      "return n", _grid(b=range(2, 17)), lambda r, p: (r.randint(0, 100000),), ((0,),)),
    T("longest_sum_within", 4, "items: list[int]", "int",
      "items holds numbers >= 0. Return the length of the longest run of consecutive items whose sum is at "
      "most $k.",
      "best = start = total = 0\nfor end, x in enumerate(items):\n    total += x\n    while total > $k:\n"
      "        total -= items[start]\n        start += 1\n    best = max(best, end - start + 1)\nreturn best",
      _grid(k=range(0, 61, 3)), lambda r, p: (_ints(r, 0, 15, (1, 12)),)),
    T("fewest_coins", 4, "amount: int", "int",
      "Return the fewest coins worth 1, $a and $b that add up to amount (amount >= 0).",
      "best = [0] + [amount] * amount\nfor total in range(1, amount + 1):\n    for coin in (1, $a, $b):\n"
      "        if coin <= total:\n            best[total] = min(best[total], best[total - coin] + 1)\n"
      "return best[amount]", tuple({"a": a, "b": b} for a in range(2, 8) for b in range(a + 1, 13)),
      lambda r, p: (r.randint(1, 60),), ((0,),)),
    T("nth_with_digit_sum", 4, "n: int", "int",
      "Return the n-th positive integer (n >= 1; the 1st is the smallest) whose decimal digits add up to $k.",
      "found = x = 0\nwhile found < n:\n    x += 1\n    if sum(int(d) for d in str(x)) == $k:\n        found += 1\n"
      "return x", _grid(k=range(4, 31)), lambda r, p: (r.randint(1, 8),)),
    T("arithmetic_run", 4, "items: list[int]", "int",
      "Return the length of the longest run of consecutive items of items in which each item is exactly $k more "
      "than the one before it (1 for a single item, 0 for an empty list).",
      "best = run = 0\nfor i, x in enumerate(items):\n    run = run + 1 if i and x - items[i - 1] == $k else 1\n"
      "    best = max(best, run)\nreturn best", _grid(k=range(1, 11)), lambda r, p: (_with_runs(r, int(p["k"])),),
      (([],),)),
    T("last_in_circle", 4, "n: int", "int",
      "n people stand in a circle, numbered 1 to n (n >= 1). Counting from person 1, every $k-th person leaves "
      "the circle, the count going on from the next person. Return the number of the last person left.",
      "people = list(range(1, n + 1))\ni = 0\nwhile len(people) > 1:\n    i = (i + $k - 1) % len(people)\n"
      "    people.pop(i)\nreturn people[0]", _grid(k=range(2, 11)), lambda r, p: (r.randint(1, 30),)),
)

TEMPLATES: tuple[Template, ...] = (*_D1, *_D2, *_D3, *_D4)
