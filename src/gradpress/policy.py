"""Which parameters PowerSGD compresses, and at what rank: a rule per parameter name.

A ``rank_policy`` (``PowerSGDState(rank_policy=...)``, ``PowerSGD(..., rank_policy=...)``) is either

* a mapping from name patterns to a rank: shell-style patterns (:func:`fnmatch.fnmatchcase`: ``*``,
  ``?``, ``[seq]``) matched against the full parameter name as ``named_parameters()`` gives it; the
  first pattern that matches decides; a rank of ``None`` sends the parameter exactly (averaged like a
  bias, no error memory); parameters that no pattern matches take the state's own rank
  (``matrix_approximation_rank`` / ``Config.rank``); or
* a function ``(name, parameter) -> rank or None`` (return the default rank yourself).

A rank is an upper bound, as the global one is: a matrix uses ``min(n, m, rank)``, and it is still sent
exactly where compressing it would not save ``min_compression_rate`` times the bytes.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 64), torch.nn.Linear(64, 100))
>>> policy = RankPolicy({"0.*": None, "2.weight": 8}, default=2, owner="PowerSGDState")
>>> policy.resolve(model.named_parameters())
{'0.weight': None, '1.weight': 2, '1.bias': 2, '2.weight': 8, '2.bias': 2}
>>> RankPolicy({"embed*": None}, default=2, owner="PowerSGDState").resolve(  # doctest: +ELLIPSIS
...     model.named_parameters())
Traceback (most recent call last):
...
ValueError: PowerSGDState's rank_policy pattern 'embed*' matches no parameter; the parameters are: 0.weight, ...
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import Union

from torch import Tensor

__all__ = ["RankPolicy", "RankRules"]

#: What ``rank_policy=`` takes: ``{pattern: rank or None}`` or ``(name, parameter) -> rank or None``.
RankRules = Union[Mapping[str, Union[int, None]], Callable[[str, Tensor], Union[int, None]]]


def _check_rank(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be an integer rank >= 1, or None to send the parameter exactly; "
                         f"got {value!r}")
    return value


class RankPolicy:
    """``rules`` (a :data:`RankRules`) with the state's ``default`` rank; ``owner`` names the state in
    errors. Validated at construction (patterns and ranks) and when names are resolved (every pattern
    must match some parameter: a pattern that matches nothing is almost always a typo)."""

    __slots__ = ("rules", "default", "owner")

    def __init__(self, rules: RankRules, default: int, owner: str) -> None:
        self.owner = owner
        self.default = default
        if isinstance(rules, Mapping):
            if not rules:
                raise ValueError(f"{owner}'s rank_policy is an empty mapping; give None for no policy")
            for pattern, rank in rules.items():
                if not isinstance(pattern, str) or not pattern:
                    raise ValueError(f"{owner}'s rank_policy keys must be non-empty name patterns such as "
                                     f"'embed.*' or '*.attn.*', got {pattern!r}")
                _check_rank(rank, f"{owner}'s rank_policy[{pattern!r}]")
            self.rules: RankRules = dict(rules)
        elif callable(rules):
            self.rules = rules
        else:
            raise TypeError(f"{owner}'s rank_policy must be a mapping {{name pattern: rank or None}} or a "
                            f"function (name, parameter) -> rank or None, got {type(rules).__name__}")

    def rank_for(self, name: str, param: Tensor) -> int | None:
        """The rank of parameter ``name`` (``None``: sent exactly)."""
        if isinstance(self.rules, Mapping):
            for pattern, rank in self.rules.items():
                if fnmatch.fnmatchcase(name, pattern):
                    return rank
            return self.default
        return _check_rank(self.rules(name, param), f"{self.owner}'s rank_policy({name!r}, ...)")

    def resolve(self, named: Iterable[tuple[str, Tensor]]) -> dict[str, int | None]:
        """``{name: rank or None}`` for every parameter; ``ValueError`` if a pattern matches none."""
        pairs = list(named)
        if isinstance(self.rules, Mapping):
            names = [name for name, _ in pairs]
            for pattern in self.rules:
                if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
                    raise ValueError(f"{self.owner}'s rank_policy pattern {pattern!r} matches no parameter; "
                                     f"the parameters are: {', '.join(names)}")
        return {name: self.rank_for(name, param) for name, param in pairs}
