"""Peak memory of a DDP training step (CPU, gloo) under gradpress's and PyTorch's PowerSGD hooks.

    OMP_NUM_THREADS=1 python benchmarks/peak_memory.py --ranks 1,2 --json peak-memory.json

(about 1.5 minutes on an idle 2-core VM, 3 on a busy one; ``--help`` for the options; the malloc
counter needs ``cc`` and glibc, else ``--no-malloc-counter`` gives the profiler's numbers only.)

Two local processes (``torch.multiprocessing.spawn``, gloo on 127.0.0.1, one intra-op thread each) train
ResNet-18 for CIFAR (``gradpress.tools.zoo.build_model("resnet18-cifar")``) with DDP (default buckets) and
SGD (no momentum: the optimizer holds no state) on ``--batch-size`` random 32x32 images per rank.

* ``allreduce``: DDP with no hook (its built-in allreduce), the baseline;
* ``ours``: ``gradpress.powerSGD_hook`` with ``gradpress.PowerSGDState(process_group=None,
  matrix_approximation_rank=r, start_powerSGD_iter=2)``;
* ``torch`` / ``torch_batched``: PyTorch's ``powerSGD_hook`` / ``batched_powerSGD_hook``, same settings
  (``batched_powerSGD_hook`` fails in torch 2.13 at its first compressed step: ``_orthogonalize`` asserts
  on the 2-D Q it is given; reported as failed).

Each variant runs 2 allreduce steps (``start_powerSGD_iter``) and ``--warmup`` compressed steps, so all
state exists and DDP has rebuilt its buckets, then measures ``--repeats`` steps with the malloc counter
(the largest peak is reported) and one with the profiler. A step: ``zero_grad(set_to_none=False)``,
forward, backward (it returns once DDP's reduction has finished and written the gradients),
``optimizer.step()``. Then the **reduction alone**: a fresh state of the same hook called on copies of
DDP's rebuilt buckets (``reducer._get_zeros_like_grad_buckets()``, refilled with random values), one
call per bucket then every future waited on (as ``gradpress.tools.bench.overhead``), ``--repeats-alone``
times after its own warm-up. Numbers are rank 0's.

Columns:

* ``step peak``: the step's peak above the bytes live at its start (activations and autograd's
  temporaries included, ~90 MiB at batch 16); ``step extra vs allreduce``: minus allreduce's. A hook's
  temporaries that are live while the step is below its forward peak do not show here; the reduction
  alone shows them.
* ``reduction alone: peak``: what the hook allocates on top of its inputs and persistent state while it
  reduces all buckets (the hook's per-step temporaries: PyTorch's clones each bucket).
* ``persistent hook state``: the distinct tensor storages reachable from the hook's state after the
  step (:func:`held_bytes`: walks the state's attributes, so it counts whatever the implementation keeps:
  gradpress's ``Segment.error_memory``, ``wire`` (P, uncompressed, Q), ``saved_factors``, the shared
  workspace; PyTorch's ``error_dict``, ``p_memory_dict``, ``q_memory_dict``), parameters, gradients and
  DDP's buckets excluded. Checked by ``kept by a fresh state over its warm-up`` (malloc counter: bytes
  the reduction-alone state allocated over its warm-up steps and kept).
* ``persistent + reduction peak``: the hook's footprint at its worst moment.

DDP's own bucket buffers (one more copy of the gradients) belong to no hook and are in none of these.

How peaks are measured (two methods, both validated at start-up):

* **malloc counter** (the headline numbers): a tiny ``LD_PRELOAD`` library, compiled here with ``cc``,
  adds up the usable size of every live ``malloc``/``posix_memalign``/``realloc``/... block of the
  process, on every thread, and keeps the maximum. Peak of a region = maximum during it - live bytes at
  its start. It counts whatever allocates (tensors, gloo's buffers, Python objects above 512 bytes).
* **profiler** (for comparison): ``torch.profiler.profile(activities=[CPU], profile_memory=True)``; the
  allocation records of ``prof.profiler.kineto_results.experimental_event_tree()`` (``prof.events()``
  folds the records made inside ops into the ops, so its ``[memory]`` events miss most allocations),
  sorted by time and summed; peak = max of the sum, ``end`` = the sum at the end (0 in a steady state),
  ``frees unseen`` = bytes allocated whose free was not recorded. The profiler records only on threads
  that carry its thread-local state (the main thread and autograd, which runs on it on the CPU): it
  misses allocations and frees in ``Future.then`` callbacks on gloo threads (where PyTorch's hook does
  most of its work and frees its bucket clones) and on other threads. Its numbers for PyTorch's hook
  are therefore wrong both ways (temporaries unseen, clones never freed).

Validation (``validation`` in the JSON): (a) 100 MiB allocated and freed on the main thread; (b) 64 MiB
allocated and freed inside a ``Future.then`` callback that runs on a gloo thread; (c) 64 MiB cloned on
the main thread, captured by such a callback and freed on the gloo thread when the callback is
destroyed (PyTorch's hook's pattern); (d) 32 MiB on a plain Python thread. The malloc counter must show
each expected peak and ``end`` 0; the profiler shows (a) only (b: 0, c: never freed, d: 0).

PyTorch's hooks over gloo with more than one bucket issue collectives from callbacks on gloo threads
and from the autograd thread at once, so the two ranks can issue them in different orders (observed:
"Received data size doesn't match expected size"; ``gradpress.tools.bench.overhead`` reports deadlocks with
gloo's 2 default threads). Here PyTorch's hook runs unchanged but with one ``PowerSGDState`` and one gloo group per
bucket index (iteration counters kept equal), which keeps each group's order deterministic without
serializing the buckets; its state is the sum over those states. gradpress's hook orders its
collectives itself and runs on the default group, as given.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gradpress.tools.processes import free_port

MiB = 1 << 20
START_POWERSGD_ITER = 2
VARIANTS = ("allreduce", "ours", "torch", "torch_batched")
_SHIM_ENV = "GRADPRESS_PEAK_MEMORY_SHIM"

# --------------------------------------------------------------------------------------------------
# malloc counter (LD_PRELOAD)
# --------------------------------------------------------------------------------------------------
#: The malloc counter, compiled by :func:`build_shim` and preloaded into the workers.
_SHIM_SOURCE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak_memory_shim.c")


def build_shim(directory: str) -> tuple[str | None, str]:
    """Compile the malloc counter into ``directory``: ``(path or None, why not)``. glibc only."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc/gcc) on PATH"
    if platform.system() != "Linux":
        return None, f"needs glibc (Linux), this is {platform.system()}"
    source, lib = _SHIM_SOURCE_PATH, os.path.join(directory, "libgpmem.so")
    proc = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", lib, source], capture_output=True, text=True)
    if proc.returncode != 0:
        return None, f"compiling the malloc counter failed: {proc.stderr.strip()[:500]}"
    return lib, ""


class MallocCounter:
    """The LD_PRELOADed counter, seen from Python (``None`` from :meth:`load` when not preloaded)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.gpmem_current.restype = ctypes.c_longlong
        lib.gpmem_peak.restype = ctypes.c_longlong

    @classmethod
    def load(cls) -> MallocCounter | None:
        path = os.environ.get(_SHIM_ENV)
        if not path or path not in os.environ.get("LD_PRELOAD", ""):
            return None
        return cls(ctypes.CDLL(path))

    def current(self) -> int:
        """Bytes in live malloc blocks now."""
        return int(self._lib.gpmem_current())

    def measure(self, fn: Callable[[], Any]) -> dict[str, int]:
        """Run ``fn``; ``peak``: max live bytes during it above the start, ``end``: live bytes left."""
        self._lib.gpmem_reset_peak()
        start = self._lib.gpmem_current()
        fn()
        return {"peak": self._lib.gpmem_peak() - start, "end": self._lib.gpmem_current() - start}


# --------------------------------------------------------------------------------------------------
# profiler
# --------------------------------------------------------------------------------------------------
def profile_memory(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` under the profiler; the allocation timeline's ``peak``, ``end``, ``frees_unseen``.

    ``frees_unseen``: bytes allocated in the window whose free was not recorded (still live at the end,
    or freed on a thread the profiler does not see). ``threads``: distinct thread ids of the records.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    records = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                records.append((event.start_time_ns, fields.alloc_size, fields.ptr, event.start_tid))
        stack.extend(event.children)
    records.sort(key=lambda r: r[0])
    live, peak, live_by_ptr = 0, 0, {}
    for _, size, ptr, _ in records:
        live += size
        peak = max(peak, live)
        if size > 0:
            live_by_ptr[ptr] = size
        else:
            live_by_ptr.pop(ptr, None)
    return {"peak": peak, "end": live, "frees_unseen": sum(live_by_ptr.values()), "records": len(records),
            "threads": len({r[3] for r in records})}


def settle() -> None:
    """Collect garbage and let gloo's threads finish freeing (PyTorch's hook frees its bucket clones
    there when a callback is destroyed, shortly after the future the caller waited on completed)."""
    gc.collect()
    time.sleep(0.1)


def measure_both(counter: MallocCounter | None, fn: Callable[[], Any], repeats: int = 1,
                 prepare: Callable[[], Any] | None = None) -> dict[str, Any]:
    """``fn`` measured ``repeats`` times by the malloc counter (if loaded; ``peak``: the largest,
    ``peaks``: each), then once more by the profiler. ``prepare`` runs, unmeasured, before each run.
    Every rank runs the same sequence (``fn`` may hold collectives)."""
    out: dict[str, Any] = {}
    if counter is not None:
        runs = []
        for _ in range(repeats):
            if prepare is not None:
                prepare()
            settle()
            runs.append(counter.measure(fn))
        out["malloc"] = {"peak": max(r["peak"] for r in runs), "end": max(r["end"] for r in runs),
                         "peaks": [r["peak"] for r in runs], "ends": [r["end"] for r in runs]}
    if prepare is not None:
        prepare()
    settle()
    out["profiler"] = profile_memory(fn)
    return out


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------
def validate(rank: int, counter: MallocCounter | None) -> dict[str, Any]:
    """Known allocations on the main thread, in gloo future callbacks and on a Python thread (see the
    module docstring). Every rank runs it (the callbacks need collectives); rank 0's numbers count."""
    main_tid = threading.get_native_id()
    seen: dict[str, int] = {}

    def main_thread() -> None:
        x = torch.empty(100 * MiB // 4)
        x.fill_(1.0)
        del x

    def make_callback(clone: torch.Tensor | None, captured: bool) -> Callable[[Any], Any]:
        def callback(f: torch.futures.Future) -> Any:
            seen["captured" if captured else "local"] = threading.get_native_id()
            if clone is None:
                y = torch.empty(64 * MiB // 4)
                y.fill_(2.0)
                del y
            else:
                clone.add_(1.0)
            return f.value()
        return callback

    def gloo_callback(captured: bool) -> Callable[[], None]:
        def run() -> None:
            t = torch.ones(4)
            if rank != 0:
                time.sleep(0.3)  # rank 0's allreduce is still in flight when its callback is attached
            fut = dist.all_reduce(t, async_op=True).get_future()
            done = fut.then(make_callback(torch.ones(64 * MiB // 4) if captured else None, captured))
            # Only the callback's closure holds the clone now: it is freed where the callback is destroyed.
            done.wait()
            del done, fut
            time.sleep(0.05)  # the gloo thread destroys the callback after running it
        return run

    def python_thread() -> None:
        def work() -> None:
            z = torch.empty(32 * MiB // 4)
            z.fill_(3.0)
            del z
        th = threading.Thread(target=work)
        th.start()
        th.join()

    cases = {
        "main_thread_100MiB": (main_thread, 100),
        "gloo_callback_alloc_free_64MiB": (gloo_callback(False), 64),
        "gloo_callback_closure_free_64MiB": (gloo_callback(True), 64),
        "python_thread_32MiB": (python_thread, 32),
    }
    out: dict[str, Any] = {}
    for name, (fn, expected) in cases.items():
        result = measure_both(counter, fn)
        result["expected_MiB"] = expected
        out[name] = result
    out["callback_ran_off_main_thread"] = {k: v != main_tid for k, v in seen.items()}
    return out


# --------------------------------------------------------------------------------------------------
# variants
# --------------------------------------------------------------------------------------------------
class TorchPerBucket:
    """PyTorch's hook with one ``PowerSGDState`` and one gloo group per bucket index (see the docstring)."""

    def __init__(self, hook: Callable, groups: list[Any], rank: int) -> None:
        self.hook, self.groups, self.rank = hook, groups, rank
        self.states: dict[int, Any] = {}
        self.iter = 0

    @staticmethod
    def run(holder, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp

        index = bucket.index()
        if index not in holder.states:
            if index >= len(holder.groups):
                raise RuntimeError(f"bucket {index}: only {len(holder.groups)} groups made (raise --groups)")
            holder.states[index] = tp.PowerSGDState(holder.groups[index], matrix_approximation_rank=holder.rank,
                                                    start_powerSGD_iter=START_POWERSGD_ITER)
        state = holder.states[index]
        state.iter = holder.iter
        fut = holder.hook(state, bucket)
        if bucket.is_last():
            holder.iter += 1
        return fut


def make_hook(variant: str, rank: int | None, groups: list[Any], ddp_builtin: bool) -> tuple[Any, Callable | None]:
    """``(state, hook)`` of a variant; ``allreduce`` is ``(None, None)`` (DDP's built-in allreduce) when
    ``ddp_builtin``, else PyTorch's ``allreduce_hook`` on the default group (the same collective)."""
    import gradpress
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp

    if variant == "ours":
        return (gradpress.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=START_POWERSGD_ITER), gradpress.powerSGD_hook)
    if variant in ("torch", "torch_batched"):
        hook = tp.batched_powerSGD_hook if variant == "torch_batched" else tp.powerSGD_hook
        return TorchPerBucket(hook, groups, rank), TorchPerBucket.run
    return None, (None if ddp_builtin else default_hooks.allreduce_hook)


def build(variant: str, rank: int | None, model_name: str,
          groups: list[Any]) -> tuple[nn.Module, Any, dict[int, int]]:
    """``(ddp, state, buckets)``: a fresh model (same weights every time), DDP, the variant's hook
    registered; ``buckets`` maps each bucket index to the storage of the buffer the hook was last
    called with (DDP's buffers of the first iteration are freed when it rebuilds its buckets, and
    their addresses reused: only the current ones may be excluded from the state's count)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradpress.tools import zoo

    torch.manual_seed(0)
    ddp = DDP(zoo.build_model(model_name, device="cpu"))
    state, hook = make_hook(variant, rank, groups, ddp_builtin=True)
    buckets: dict[int, int] = {}
    if hook is not None:
        def recording(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
            buckets[bucket.index()] = bucket.buffer().untyped_storage().data_ptr()
            return hook(state, bucket)
        ddp.register_comm_hook(state, recording)
    return ddp, state, buckets


def replay(variant: str, rank: int | None, ddp: nn.Module, args: argparse.Namespace, groups: list[Any],
           counter: MallocCounter | None, world_rank: int) -> dict[str, Any]:
    """The reduction alone: a fresh state of the variant's hook called on DDP's (rebuilt) buckets, one
    call per bucket in bucket order, then every future waited on (as ``gradpress.tools.bench.overhead``), no
    forward or backward. Buckets are refilled with random values (unmeasured) before every step."""
    state, hook = make_hook(variant, rank, groups, ddp_builtin=False)
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    g = torch.Generator().manual_seed(1000 + world_rank)
    noise = [torch.randn(b.buffer().numel(), generator=g) for b in buckets]

    def refill() -> None:
        for bucket, values in zip(buckets, noise):
            bucket.buffer().copy_(values)

    def reduce() -> None:
        futures = [hook(state, bucket) for bucket in buckets]
        for fut in futures:
            fut.wait()
        del futures

    settle()
    live_before = counter.current() if counter is not None else None
    for _ in range(START_POWERSGD_ITER + args.warmup):
        refill()
        reduce()
    settle()
    # What the state allocated and kept over the warm-up steps (a check of held_bytes' count).
    retained = None if counter is None else counter.current() - live_before

    def prepare() -> None:
        refill()
        dist.barrier()

    out = measure_both(counter, reduce, args.repeats_alone, prepare)
    out["retained_bytes"] = retained
    params = [p for p in ddp.parameters() if p.requires_grad]
    exclude = _storages(b.buffer() for b in buckets) | _storages(params) | _storages(p.grad for p in params)
    out["state_bytes"] = held_bytes(state, exclude)
    dist.barrier()
    return out


_WALK_MODULES = ("gradpress", "torch.distributed.algorithms", __name__, "__mp_main__", "__main__")


def held_bytes(root: Any, exclude: set[int]) -> dict[str, int]:
    """Bytes of the distinct tensor storages reachable from ``root`` (a hook's state), by where they are
    held (attribute path, ``[]`` for a container element; a storage is named by the tensor that spans
    it, not by its views), and ``total``. Storages in ``exclude`` (parameters, gradients, DDP's
    buckets) are not counted.

    Walks gradpress's and PyTorch's PowerSGD objects (``__dict__`` and ``__slots__``), dicts, lists and
    tuples, nothing else (no process groups, futures, modules); so it counts whatever an implementation
    keeps (``Segment.spare``, a shared workspace, ...) without naming it.
    """
    labels: dict[int, tuple[int, set[tuple[bool, str]]]] = {}
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
            if obj.device.type != "meta" and ptr not in exclude:
                whole = obj.storage_offset() == 0 and obj.numel() * obj.element_size() == storage.nbytes()
                labels.setdefault(ptr, (storage.nbytes(), set()))[1].add((whole, path or "(state)"))
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack.extend((v, path + "[]") for v in obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend((v, path + "[]") for v in obj)
        elif type(obj).__module__.startswith(_WALK_MODULES):
            names = set(getattr(obj, "__dict__", {}))
            for klass in type(obj).__mro__:
                slots = klass.__dict__.get("__slots__", ())
                names.update([slots] if isinstance(slots, str) else slots)
            for name in sorted(names - {"__dict__", "__weakref__"}):
                if hasattr(obj, name):
                    stack.append((getattr(obj, name), f"{path}.{name}" if path else name))
    out: dict[str, int] = {}
    for nbytes, where in labels.values():
        # Named after the tensor that spans the storage (not a view into it), else the plainest path.
        key = min(where, key=lambda w: (not w[0], w[1].count("[]"), len(w[1]), w[1]))[1]
        out[key] = out.get(key, 0) + nbytes
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]))
    out["total"] = sum(nbytes for nbytes, _ in labels.values())
    return out


def _storages(tensors: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


def run_variant(variant: str, rank: int | None, args: argparse.Namespace, groups: list[Any],
                counter: MallocCounter | None, world_rank: int) -> dict[str, Any]:
    """Warm up, measure a DDP step, then the reduction alone (:func:`replay`); rank 0's numbers."""
    ddp, holder, bucket_storages = build(variant, rank, args.model, groups)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(world_rank)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()

    for _ in range(START_POWERSGD_ITER + args.warmup):
        step()
    result = measure_both(counter, step, args.repeats, dist.barrier)
    dist.barrier()
    params = [p for p in ddp.parameters() if p.requires_grad]
    exclude = _storages(params) | _storages(p.grad for p in params) | set(bucket_storages.values())
    result["state_bytes"] = held_bytes(holder, exclude)
    result["reduction_alone"] = replay(variant, rank, ddp, args, groups, counter, world_rank)
    buckets = [b.buffer().numel() * b.buffer().element_size() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    finite = all(torch.isfinite(p).all().item() for p in params)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    other = flat.clone()
    dist.broadcast(other, src=0)
    result.update({
        "variant": variant,
        "rank": rank,
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
        "bucket_bytes": buckets,
        "params_finite": finite,
        "ranks_agree": bool(torch.equal(flat, other)),
    })
    return result


def _worker(world_rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world_rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=180))
    import gradpress

    counter = MallocCounter.load()
    groups = [dist.new_group(list(range(args.world))) for _ in range(args.groups)]
    report: dict[str, Any] = {"malloc_counter": counter is not None, "gradpress_file": gradpress.__file__}
    report["validation"] = validate(world_rank, counter)
    results = []
    report["results"] = results = []

    def save() -> None:  # after every variant: a crash later (see main) keeps what was measured
        if world_rank == 0:
            with open(out + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(out + ".tmp", out)

    # PyTorch's batched hook last: after it fails, a worker has been seen to die (SIGSEGV) soon after.
    configs: list[tuple[str, int | None]] = [("allreduce", None)] if "allreduce" in args.variant_list else []
    configs += [(v, r) for r in args.rank_list for v in args.variant_list
                if v not in ("allreduce", "torch_batched")]
    configs += [("torch_batched", r) for r in args.rank_list if "torch_batched" in args.variant_list]
    report["planned"] = configs
    save()
    for variant, rank in configs:
        t0 = time.perf_counter()
        try:
            results.append(run_variant(variant, rank, args, groups, counter, world_rank))
            gc.collect()  # the variant's model, DDP and state go before the next one is built
            if world_rank == 0:
                print(f"[peak_memory] {variant} r={rank or '-'} ({time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - reported in the table (PyTorch's batched hook fails)
            where = traceback.extract_tb(exc.__traceback__)[-1]
            error = f"{type(exc).__name__}: {exc} ({os.path.basename(where.filename)}:{where.lineno} {where.name})"
            results.append({"variant": variant, "rank": rank, "error": error[:400]})
            if world_rank == 0:
                print(f"[peak_memory] {variant} r={rank} failed: {error}", file=sys.stderr, flush=True)
            gc.collect()
            # Deterministic failures (PyTorch's batched hook asserts before its first collective) hit every
            # rank at the same point; anything else ends in the process group's timeout, not a hang.
            dist.barrier()
        save()
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------
def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / MiB:.1f}"


def _peak(part: dict[str, Any] | None, method: str) -> int | None:
    return None if part is None or method not in part else part[method]["peak"]


def markdown(report: dict[str, Any]) -> str:
    """The report's tables: per variant, then where the persistent state is held, then the validation."""
    method = "malloc" if report.get("malloc_counter") else "profiler"
    results = [r for r in report["results"] if "error" not in r]
    base = next((r for r in results if r["variant"] == "allreduce"), None)
    lines = [
        f"Rank 0. Peaks: {'malloc counter' if method == 'malloc' else 'profiler (misses gloo-thread allocations)'}"
        "; persistent: tensors reachable from the hook's state.",
        "",
        "| hook | r | step peak MiB | step extra vs allreduce MiB | reduction alone: peak MiB "
        "| persistent hook state MiB | kept by a fresh state over its warm-up MiB (malloc) "
        "| persistent + reduction peak MiB "
        "| profiler: step peak / end / frees unseen MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['rank']} | failed: {r['error']} | | | | | | |")
            continue
        step = _peak(r, method)
        extra = None if base is None or step is None else step - _peak(base, method)
        alone = _peak(r["reduction_alone"], method)
        persistent = r["state_bytes"]["total"]
        retained = r["reduction_alone"].get("retained_bytes")
        p = r["profiler"]
        lines.append(
            f"| {r['variant']} | {r['rank'] or '-'} | {_mib(step)} | {_mib(extra)} | {_mib(alone)} "
            f"| {_mib(persistent)} | {_mib(retained)} | {_mib(None if alone is None else persistent + alone)} "
            f"| {_mib(p['peak'])} / {_mib(p['end'])} / {_mib(p['frees_unseen'])} |")
    lines += ["", "| hook | r | persistent state: where held, MiB |", "|---|---|---|"]
    for r in results:
        if r["variant"] != "allreduce":
            parts = "; ".join(f"{k} {v / MiB:.2f}" for k, v in r["state_bytes"].items() if k != "total")
            lines.append(f"| {r['variant']} | {r['rank']} | {parts} |")
    if results:
        lines += ["", f"Gradients: {_mib(results[0]['grad_bytes'])} MiB; DDP's buckets (after rebuild): "
                  + " + ".join(_mib(b) for b in results[0]["bucket_bytes"]) + " MiB."]
    lines += ["", "| validation case | expected MiB | malloc: peak / end MiB "
              "| profiler: peak / end / frees unseen MiB |", "|---|---|---|---|"]
    for name, v in report["validation"].items():
        if isinstance(v, dict) and "profiler" in v:
            m, p = v.get("malloc"), v["profiler"]
            lines.append(f"| {name} | {v['expected_MiB']} | {_mib(m and m['peak'])} / {_mib(m and m['end'])} "
                         f"| {_mib(p['peak'])} / {_mib(p['end'])} / {_mib(p['frees_unseen'])} |")
    off = report["validation"].get("callback_ran_off_main_thread", {})
    lines.append(f"\nValidation callbacks ran off the main thread: {off}.")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="peak_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18-cifar", choices=("resnet18-cifar", "resnet50"),
                        help="gradpress.tools.zoo model fed 32x32 images (default: %(default)s)")
    parser.add_argument("--ranks", default="1,2", help="comma-separated PowerSGD ranks (default: %(default)s)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="from %(default)s")
    parser.add_argument("--batch-size", type=int, default=16, help="images per process (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="compressed steps after the start_powerSGD_iter=2 allreduce steps, before "
                             "measuring (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="measured DDP steps per variant, the largest peak is reported (default: %(default)s)")
    parser.add_argument("--repeats-alone", type=int, default=5,
                        help="measured reductions alone per variant, the largest peak is reported "
                             "(default: %(default)s)")
    parser.add_argument("--world", type=int, default=2, help="processes (default: %(default)s)")
    parser.add_argument("--groups", type=int, default=8,
                        help="gloo groups made for PyTorch's per-bucket states (>= buckets) "
                             "(default: %(default)s)")
    parser.add_argument("--malloc-counter", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure with the LD_PRELOAD malloc counter (default: on; needs cc and glibc)")
    parser.add_argument("--json", default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    try:
        args.rank_list = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    counts = [args.batch_size, args.warmup, args.repeats, args.repeats_alone]
    if not args.rank_list or min(args.rank_list + counts) < 1 or args.world < 2:
        parser.error("need --ranks, --batch-size, --warmup, --repeats, --repeats-alone >= 1 and --world >= 2")
    return args


def _source_info(gradpress_file: str) -> dict[str, Any]:
    """Which gradpress the workers imported: its path, and the git commit + uncommitted changes there."""
    info: dict[str, Any] = {"file": gradpress_file}
    root = os.path.dirname(os.path.abspath(gradpress_file or "."))

    def git(*argv: str) -> str | None:
        proc = subprocess.run(["git", "-C", root, *argv], capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head is not None:
        import hashlib

        diff = git("diff", "HEAD", "--", ".") or ""
        changed = (git("status", "--porcelain", "--untracked-files=no", "--", ".") or "").splitlines()
        info.update(commit=head, uncommitted=[line[3:] for line in changed],
                    diff_sha1=hashlib.sha1(diff.encode()).hexdigest() if diff else None)
    return info


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/peak_memory.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradpress-peak-memory-") as tmp:
        shim, why_not = build_shim(tmp) if args.malloc_counter else (None, "--no-malloc-counter")
        saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", _SHIM_ENV)}
        if shim is not None:
            os.environ["LD_PRELOAD"] = " ".join(filter(None, [shim, os.environ.get("LD_PRELOAD")]))
            os.environ[_SHIM_ENV] = shim
        else:
            print(f"[peak_memory] malloc counter off: {why_not}; profiler numbers only", file=sys.stderr)
        out = os.path.join(tmp, "report.json")
        crash = None
        try:
            mp.spawn(_worker, args=(args, free_port(), out), nprocs=args.world)
        except mp.ProcessExitedException as exc:  # a worker died (a signal): report what was measured
            if not os.path.exists(out):
                raise
            crash = str(exc)
            print(f"[peak_memory] {crash}; reporting the variants measured before", file=sys.stderr)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        with open(out) as f:
            report = json.load(f)
    done = {(r["variant"], r["rank"]) for r in report["results"]}
    for variant, rank in report.pop("planned"):
        if (variant, rank) not in done:
            report["results"].append({"variant": variant, "rank": rank, "error": f"not run: {crash}"})
    import gradpress

    report = {
        "gradpress_source": _source_info(report.pop("gradpress_file", "")),
        "command": command.rstrip(),
        "environment": {"torch": torch.__version__, "gradpress": gradpress.__version__,
                        "python": platform.python_version(), "machine": platform.machine(),
                        "backend": "gloo", "world_size": args.world, "threads": 1},
        "settings": {"model": args.model, "ranks": args.rank_list, "batch_size": args.batch_size,
                     "start_powerSGD_iter": START_POWERSGD_ITER, "warmup": args.warmup,
                     "repeats": args.repeats, "repeats_alone": args.repeats_alone,
                     "optimizer": "SGD(lr=0.01), no momentum", "malloc_counter_note": why_not or None},
        **report,
        "total_seconds": time.perf_counter() - started,
    }
    report["markdown"] = markdown(report)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
    print(report["command"] + "\n\n" + report["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
