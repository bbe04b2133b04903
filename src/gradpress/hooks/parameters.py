"""Which parameter is which, across DDP's bucket rebuilds, and the rank each is compressed at.

DDP's communication hooks see buckets, not parameters by name, and DDP rebuilds its buckets after the first
iteration. :class:`ParameterKeys` gives every parameter a stable key (the order in which the hook first saw
it: DDP's first layout, the same in a resumed process), refuses two models trained with one state (a state
moved to a new model once its model is done starts afresh), and resolves each key's rank: by name under a
``rank_policy`` and, with an ``adaptive_rank``, the rank in force. :class:`gradpress.PowerSGDState` holds one.

>>> import torch
>>> keys = ParameterKeys(rank=4, min_compression_rate=2)
>>> weight, bias = torch.zeros(8, 8), torch.zeros(8)
>>> keys.keys_for([weight, bias]), keys.keys_for([bias])
((0, 1), (1,))
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..adaptive import AdaptiveRank
from ..diagnostics import named_pairs
from ..powersgd.linalg import as_matrix_shape
from ..policy import RankPolicy, RankRules
from ..powersgd.plan import should_compress
from ..powersgd.store import SegmentStore
from ..powersgd.transport import Communicator

__all__ = ["ParameterKeys"]

_TWO_MODELS = ("this PowerSGDState is registered on two DDP models ({}): give each model its own "
               "PowerSGDState (its error memory, factors and iteration count belong to one model)")


class ParameterKeys:
    """Stable per-parameter keys, names, and per-parameter ranks (policy, adaptive) of one model.

    Args:
        rank: the rank of parameters the policy does not name.
        min_compression_rate: an adaptive rank is capped where compressing would not pay.
        rank_policy: see :mod:`gradpress.policy` (``None``: every matrix at ``rank``).
        adaptive_rank: see :mod:`gradpress.adaptive` (``None``: fixed ranks).
    """

    __slots__ = ("keys", "shapes", "closed", "iteration_buckets", "names", "policy", "policy_ranks",
                 "adaptive", "adaptive_ranks", "limits", "previous_norms", "min_compression_rate", "left", "loaded")

    def __init__(self, rank: int, min_compression_rate: float, rank_policy: RankRules | None = None,
                 adaptive_rank: AdaptiveRank | None = None) -> None:
        self.keys: dict[int, tuple[Tensor, int]] = {}      # id(parameter) -> (parameter, key)
        self.shapes: list[tuple[int, ...]] = []           # key -> shape (also a loaded checkpoint's)
        # One state serves one DDP model: after DDP's first iteration no unknown parameter may arrive,
        # and no bucket index may come twice in one iteration (see note_bucket).
        self.closed = False
        self.iteration_buckets: dict[int, int] = {}        # bucket index -> id of its first parameter
        self.names: dict[int, str] = {}                    # id(parameter) -> name, from name()
        self.policy = None if rank_policy is None else RankPolicy(rank_policy, rank, "PowerSGDState")
        self.policy_ranks: dict[int, int | None] = {}      # key -> its rank under the policy
        self.adaptive = adaptive_rank
        self.adaptive_ranks: dict[int, int] = {}           # key -> rank in force (adaptive)
        self.limits: dict[int, tuple[int, int]] = {}       # key -> (lowest, highest) rank it may take
        self.previous_norms: dict[int, float] = {}         # key -> last interval's mean gradient norm
        self.min_compression_rate = min_compression_rate
        # Parameters of the models this state was moved away from: id -> weak reference (see moved_to).
        self.left: dict[int, weakref.ref[Tensor]] = {}
        self.loaded = False  # a checkpoint was loaded since the last iteration

    # --- keys -----------------------------------------------------------------------------------------
    def note_bucket(self, bucket: Any) -> None:
        """Refuse a second DDP model: DDP hands every parameter over in its first iteration, once per
        bucket index, so a bucket index seen twice in one iteration (two models in one backward pass) or a
        parameter first seen after that iteration (two models in turn) means that the state was registered
        on two models. Their iterations would be counted twice and their buckets share memory slots. (A
        state moved to a new model once its model is done is not a second model: :meth:`starts_another_model`
        sees it first.) Only DDP's own buckets are checked: FSDP units leave out parameters that have no
        gradient, so a parameter may first appear there later."""
        if not isinstance(bucket, dist.GradBucket):
            return
        index, params = bucket.index(), bucket.parameters()
        first = id(params[0]) if params else 0
        seen = self.iteration_buckets.get(index)
        if seen is not None and seen != first:
            raise RuntimeError(_TWO_MODELS.format(
                f"bucket {index} arrived twice in one backward pass, with other parameters"))
        if seen is not None:  # the same bucket again: an earlier backward pass was cut short
            self.iteration_buckets.clear()
        self.iteration_buckets[index] = first
        if self.closed:
            for param in params:
                entry = self.keys.get(id(param))
                if entry is None or entry[0] is not param:
                    raise RuntimeError(_TWO_MODELS.format(
                        f"a parameter of shape {tuple(param.shape)} arrived after DDP's first iteration, "
                        "which hands over every parameter of the model"))

    def starts_another_model(self, bucket: Any) -> bool:
        """Whether ``bucket`` begins the first iteration of another DDP model, as when PyTorch's own tests
        register the state of a finished model on a new one: this state's model completed an iteration,
        no bucket of this backward pass arrived yet, and none of ``bucket``'s parameters is known. A
        parameter of a model the state was moved away from is refused (two models trained in turn)."""
        if not isinstance(bucket, dist.GradBucket):
            return False
        params = bucket.parameters()
        for param in params if self.left else ():
            ref = self.left.get(id(param))
            if ref is not None and ref() is param:
                raise RuntimeError(_TWO_MODELS.format(
                    "a parameter of the model it was moved away from arrived again: two models trained in turn"))
        if not self.closed or self.iteration_buckets:
            return False
        if not params or any(self.key_of(p) is not None for p in params):
            return False
        if self.loaded:  # starting afresh would throw the loaded memory away
            raise RuntimeError(_TWO_MODELS.format(
                "a checkpoint was loaded into it after it served another model; build a fresh PowerSGDState "
                "for the new model and load the checkpoint into that"))
        return True

    def moved_to_another_model(self) -> ParameterKeys:
        """Fresh keys for the next model (same policy and adaptive rule, no names, no memory keys),
        remembering this model's parameters so that they are refused if they come back."""
        fresh = ParameterKeys(1, self.min_compression_rate, None, self.adaptive)
        fresh.policy = self.policy
        fresh.left = dict(self.left)
        fresh.left.update((id(p), weakref.ref(p)) for p, _ in self.keys.values())
        return fresh

    def end_iteration(self) -> None:
        """The iteration's last bucket was handed over: from now on every parameter is known."""
        self.iteration_buckets.clear()
        self.loaded = False
        self.closed = bool(self.keys)

    def keys_for(self, params: Sequence[Tensor]) -> tuple[int, ...]:
        """Stable per-parameter keys: the order in which the state first saw each parameter.

        That order is DDP's initial bucket layout (the layout of every process's first iteration), so a
        resumed process assigns the same keys as the process that saved the checkpoint.
        """
        keys = []
        for param in params:
            entry = self.keys.get(id(param))
            if entry is None or entry[0] is not param:
                key = len(self.keys)
                shape = tuple(param.shape)
                if key < len(self.shapes) and self.shapes[key] != shape:
                    raise ValueError(
                        f"parameter #{key} has shape {shape} but the loaded PowerSGD checkpoint expects "
                        f"{self.shapes[key]}: the model or its DDP bucket layout differs from the "
                        "run that saved it")
                if key >= len(self.shapes):
                    self.shapes.append(shape)
                entry = (param, key)
                self.keys[id(param)] = entry
            keys.append(entry[1])
        return tuple(keys)

    def key_of(self, param: Tensor) -> int | None:
        """The key of ``param`` (``None``: not seen yet)."""
        entry = self.keys.get(id(param))
        return None if entry is None or entry[0] is not param else entry[1]

    # --- names ---------------------------------------------------------------------------------------
    def name(self, module: nn.Module | Iterable[tuple[str, Tensor]], owner: str = "PowerSGDState") -> None:
        """Learn the parameters' names (``named_parameters()``, a wrapper's ``module.`` prefix dropped)."""
        pairs = named_pairs(module, owner)
        if self.policy is not None:  # every pattern must match a parameter (a typo otherwise)
            self.policy.resolve(pairs)
        self.names = {id(param): name for name, param in pairs}
        self.policy_ranks.clear()

    def namer(self) -> Any:
        """``key -> name``: the name learnt by :meth:`name`, else ``"#key"``."""
        names = {key: self.names[id(param)] for param, key in self.keys.values() if id(param) in self.names}
        return lambda key: names.get(key, f"#{key}")

    # --- ranks ---------------------------------------------------------------------------------------
    def ranks_for(self, keys: tuple[int, ...], params: Sequence[Tensor],
                  grads: Sequence[Tensor]) -> list[int | None] | None:
        """Each parameter's rank (``None`` in the list: sent exactly); ``None``: the state's one rank."""
        ranks = None if self.policy is None else self._policy_ranks(keys, params)
        if self.adaptive is not None:
            ranks = self._adaptive_ranks(keys, grads, ranks)
        return ranks

    def _policy_ranks(self, keys: tuple[int, ...], params: Sequence[Tensor]) -> list[int | None]:
        """Each parameter's rank under the policy (by its name, resolved once per key)."""
        assert self.policy is not None
        for i, key in enumerate(keys):
            if key in self.policy_ranks:
                continue
            name = self.names.get(id(params[i]))
            if name is None:
                raise RuntimeError("PowerSGDState's rank_policy needs the parameters' names: call "
                                   "state.name_parameters(model) before training (DDP's buckets carry the "
                                   "parameters, not their names)")
            self.policy_ranks[key] = self.policy.rank_for(name, params[i])
        return [self.policy_ranks[key] for key in keys]

    def _adaptive_ranks(self, keys: tuple[int, ...], grads: Sequence[Tensor],
                        policy: list[int | None] | None) -> list[int | None]:
        """The adaptive rank in force per parameter (``None`` where the policy sends it exactly). A new
        parameter starts at ``high``, capped where compressing would not pay (``min_compression_rate``)."""
        assert self.adaptive is not None
        ranks: list[int | None] = []
        for i, key in enumerate(keys):
            if policy is not None and policy[i] is None:
                ranks.append(None)
                continue
            if key not in self.limits:
                n, m = as_matrix_shape(tuple(grads[i].shape))
                cap = min(n, m, self.adaptive.high)
                while cap > self.adaptive.low and not should_compress(n, m, cap, self.min_compression_rate):
                    cap -= 1
                self.limits[key] = (min(self.adaptive.low, cap), cap)
            ranks.append(self.adaptive_ranks.setdefault(key, self.limits[key][1]))
        return ranks

    def adapt(self, store: SegmentStore, comm: Communicator, seed: int, draw: int) -> None:
        """At the end of an adaptive interval: average every parameter's signal over the ranks (one
        all-reduce, from the hook's thread), decide its rank for the next interval (the same everywhere,
        :meth:`decide`), and resize the factors that change in ``store`` (new columns drawn from
        ``(seed, key, draw)``)."""
        assert self.adaptive is not None
        signals = store.signals()
        if not signals:
            return
        keys = sorted(signals)
        vector = torch.stack([signals[key].reshape(()).to(torch.float32) for key in keys])
        vector.div_(comm.world_size)
        comm.allreduce_sum(vector).wait()
        store.reset_signals()
        # The one host read of the interval.
        changes = self.decide({key: total / self.adaptive.every for key, total in zip(keys, vector.tolist())})
        if changes:
            store.resize(changes, seed, draw)

    def decide(self, means: dict[int, float]) -> dict[int, int]:
        """At the end of an adaptive interval: each parameter's mean gradient-norm signal over the
        interval (averaged over the ranks, hence the same everywhere) -> the ranks that change."""
        assert self.adaptive is not None
        changes = {}
        for key, mean in means.items():
            decided = self.adaptive.decide(self.previous_norms.get(key), mean)
            self.previous_norms[key] = mean
            if decided is None or key not in self.limits:
                continue
            low, high = self.limits[key]
            rank = high if decided == self.adaptive.high else low
            if rank != self.adaptive_ranks.get(key):
                self.adaptive_ranks[key] = rank
                changes[key] = rank
        return changes

    # --- checkpoints ---------------------------------------------------------------------------------
    def adaptive_state(self) -> dict[str, dict[int, Any]]:
        return {"ranks": dict(self.adaptive_ranks), "limits": dict(self.limits),
                "previous": dict(self.previous_norms)}

    def load(self, shapes: list[list[int]], adaptive: dict[str, Any]) -> None:
        """Take a checkpoint's parameter shapes (checked against the parameters seen so far) and
        adaptive decisions."""
        saved = [tuple(int(s) for s in shape) for shape in shapes]
        for key, shape in enumerate(self.shapes[: len(saved)]):
            if saved[key] != shape:
                raise ValueError(f"checkpoint parameter #{key} has shape {saved[key]}, this model's "
                                 f"has {shape}: the checkpoint belongs to a different model")
        self.shapes = saved if len(saved) >= len(self.shapes) else self.shapes
        self.iteration_buckets.clear()  # a backward pass cut short before the load is over
        self.loaded = True
        self.adaptive_ranks = {int(k): int(v) for k, v in adaptive.get("ranks", {}).items()}
        self.limits = {int(k): (int(v[0]), int(v[1])) for k, v in adaptive.get("limits", {}).items()}
        self.previous_norms = {int(k): float(v) for k, v in adaptive.get("previous", {}).items()}
