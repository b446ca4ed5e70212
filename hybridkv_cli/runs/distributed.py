"""Many inputs over many processes, GPUs and machines on Ray: ``ask DIR --each --workers N`` / ``--ray ADDRESS``.

Ray **actors with a work queue** (not Ray Data): each actor builds one
:class:`~hybridkv_cli.runs.session.Session` (one model load) and answers one input at a time (or,
batching, a batch's worth decoded together); the driver keeps every actor busy with inputs from
its queue, takes the results as they arrive (:func:`ray.wait`) and writes them through the same :class:`~hybridkv_cli.runs.batch.Recorder` as the
single-process :func:`~hybridkv_cli.runs.batch.run_batch` (the same JSONL lines, fsynced one by one,
the same error records, ``--resume`` and exit codes). An actor that dies (killed, out of memory)
loses only the inputs it held: a new actor replaces it and each is tried once more, then
recorded as an error; one that dies loading the model is replaced once. Why not Ray Data: see
docs/scale-out.md.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Callable, TextIO

from hybridkv_cli.io import signals
from hybridkv_cli.io.errors import HybridKVError, ModelError, UsageError
from hybridkv_cli.io.progress import Progress
from hybridkv_cli.runs import ray_cluster
from hybridkv_cli.runs.batch import Recorder, Summary, error_kind, error_record, item_events, request_of
from hybridkv_cli.runs.inputs import Item

INSTALL = 'pip install -e ".[ray]"'
#: How many times an input is tried on a new worker after its worker died (and how many times a
#: worker that died loading the model is replaced).
RETRIES = 1


class WorkerLost(HybridKVError):
    """The worker answering an input died (killed, out of memory), on every try."""


def import_ray(option: str = "--workers"):
    """The ``ray`` module, or a one-line usage error naming the install command."""
    try:
        import ray
    except ImportError:
        raise UsageError(f"needs Ray: {INSTALL}", option) from None
    return ray


class Worker:
    """One Ray actor: one session, one model load, a share of the inputs at a time (the body of the
    actor class)."""

    def __init__(self, options, fault: Callable | None = None):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from hybridkv_cli.runs.session import Session

        self.session = Session(options)
        self.fault = fault  # tests: called with None before the model loads, then with each item (to kill the worker)

    def ready(self) -> float:
        """Load the model; the seconds it took."""
        started = time.perf_counter()
        if self.fault is not None:
            self.fault(None)
        self.session.model()
        return time.perf_counter() - started

    def answer(self, items: list[Item], question, questions=None, answered=None, debug: bool = False,
               limits=None):
        """Each item's ``("ok", records)`` or ``("error", error record, kind)``, in item order,
        decoded together under ``limits`` as one process does (:func:`item_events`); or
        ``("stop", error)`` for an error that would fail every input the same way (a usage or
        model error)."""
        from hybridkv_cli.engine import Limits

        for item in items:
            if self.fault is not None:
                self.fault(item)
        results = {}
        requests = [request_of(item, question, questions, answered) for item in items]
        try:
            for event, request, data in item_events(self.session, requests, limits or Limits(), debug):
                if event == "failed":
                    results[id(request)] = "error", error_record(request.item.key, data), error_kind(data)
                elif event == "done":
                    results[id(request)] = "ok", data
        except (UsageError, ModelError) as e:
            return "stop", (type(e).__name__, e.reason, e.source)
        return [results[id(request)] for request in requests]


def _stop_error(name: str, reason: str, source):
    return (UsageError if name == "UsageError" else ModelError)(reason, source)


def run_distributed(items: list[Item], question: str | None, options, *, workers: int | None = None,
                    address: str | None = None, gpus_per_worker: float = 0.0, console, jsonl: TextIO | None = None,
                    human=None, output=None, resume: bool = False, quiet: bool = False, debug: bool = False,
                    questions=None, fault: Callable | None = None, num_cpus: int | None = None,
                    timings: dict | None = None, limits=None) -> Summary:
    """:func:`~hybridkv_cli.runs.batch.run_batch` on Ray: ``workers`` actors (default: one per GPU of
    the cluster with ``gpus_per_worker``, else one per node), each with ``gpus_per_worker`` GPUs and one
    session built from ``options``; ``address``: an existing cluster (else a local runtime with
    ``num_cpus``, default the machine's). Records are written by this process as they arrive, in
    completion order. ``timings`` (a dict) gets ``startup_s`` (the runtime and the workers' model
    loads) and ``answer_s`` (the first input sent to the last record written). ``limits`` (an
    :class:`~hybridkv_cli.engine.Limits` that batches): each worker is handed as many inputs at a
    time as its batch holds (``--batch-size``; 16 under ``--kv-memory`` alone) and decodes them
    together, as one process does."""
    option = "--ray" if address and not workers else "--workers"
    if address:
        ray_cluster.gcs_address(address)  # a malformed address is refused before Ray is imported
    ray = import_ray(option)
    if workers is not None and workers < 1:
        raise UsageError("give 1 or more workers", "--workers")
    recorder, items, answered = Recorder.start(items, output, resume, questions, console=console, jsonl=jsonl,
                                               human=human, quiet=quiet)
    summary = recorder.summary
    progress = Progress(console, len(items), quiet=quiet)
    started, started_ray = time.perf_counter(), False
    try:
        if items:
            started_ray = ray_cluster.start(ray, address, workers, num_cpus)
            n = workers or _default_workers(ray, gpus_per_worker)
            _drive(ray, items, question, options, n, gpus_per_worker, recorder, progress, questions, answered, debug,
                   fault, quiet, console, limits)
            if timings is not None:
                timings.update(startup_s=progress.start - started, answer_s=time.perf_counter() - progress.start)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP: the completed lines are in
        try:  # Ray re-raises a signal handler's exception inside its calls as a plain KeyboardInterrupt
            signals.raise_if_stopped()
        except KeyboardInterrupt as remembered:
            e = remembered
        summary.stopped_by = signals.signal_of(e)
    finally:
        recorder.close()
        if started_ray:
            ray.shutdown()
    recorder.last_line(len(items), output, time.perf_counter() - progress.start, quiet)
    return summary


def check_gpus(ray, gpus_per_worker: float) -> None:
    """A worker that needs more GPUs than the whole cluster has would wait for them forever: refuse it."""
    have = ray.cluster_resources().get("GPU", 0)
    if gpus_per_worker and gpus_per_worker > have:
        raise HybridKVError(f"a worker needs {gpus_per_worker:g} GPUs, the Ray cluster has {have:g}",
                            "--gpus-per-worker")


def _default_workers(ray, gpus_per_worker: float) -> int:
    """Without ``--workers``: as many as the cluster's GPUs hold at ``gpus_per_worker``, else one per node."""
    if gpus_per_worker:
        return max(1, int(ray.cluster_resources().get("GPU", 0) // gpus_per_worker))
    return max(1, sum(1 for node in ray.nodes() if node.get("Alive")))


def _drive(ray, items, question, options, n, gpus, recorder: Recorder, progress: Progress, questions, answered,
           debug, fault, quiet, console, limits=None) -> None:
    """Keep ``n`` actors busy with a share of the inputs each (one, or a batch's worth with
    ``limits``) until every item has a record."""
    from ray.exceptions import RayActorError, RayTaskError

    try:
        from ray.exceptions import OutOfMemoryError as RayOOM
        from ray.exceptions import WorkerCrashedError
        lost_errors = (RayActorError, RayOOM, WorkerCrashedError)
    except ImportError:  # pragma: no cover - older Ray
        lost_errors = (RayActorError,)
    check_gpus(ray, gpus)
    Actor = ray.remote(num_cpus=1, num_gpus=gpus or 0, max_restarts=0)(Worker)

    spawned = []

    def spawn():
        spawned.append(Actor.remote(options, fault))
        return spawned[-1]

    load_started = time.perf_counter()
    actors = _ready(ray, spawn, min(n, len(items)), lost_errors, options.model)
    if not quiet:
        console.print(f"{len(actors)} worker{'s' if len(actors) > 1 else ''} ready in "
                      f"{time.perf_counter() - load_started:.1f} s", highlight=False, soft_wrap=True)
    progress.start = time.perf_counter()  # the rate and ETA count answering, not the start-up

    share = 1 if limits is None or not limits.batched else limits.batch_size or 16  # inputs a worker takes at a time
    queue = deque(enumerate(items))
    tries: dict[int, int] = {}  # index into items -> workers lost on it
    idle = list(actors)
    running: dict = {}  # object ref -> (actor, indices into items, started)
    with progress:
        try:
            while queue or running:
                signals.raise_if_stopped()
                while idle and queue:
                    actor, taken = idle.pop(), [queue.popleft() for _ in range(min(share, len(queue)))]
                    for _, item in taken:
                        progress.begin(item.key)
                    ref = actor.answer.remote([item for _, item in taken], question, questions, answered, debug, limits)
                    running[ref] = (actor, [i for i, _ in taken], time.perf_counter())
                ready, _ = ray.wait(list(running), num_returns=1, timeout=0.2)
                for ref in ready:
                    actor, indices, started = running.pop(ref)
                    try:
                        outcomes = ray.get(ref)
                    except lost_errors as e:
                        idle.append(spawn())  # a new actor in the dead one's place
                        for i in reversed(indices):
                            item = items[i]
                            tries[i] = tries.get(i, 0) + 1
                            if tries[i] <= RETRIES:
                                queue.appendleft((i, item))
                                continue
                            lost = WorkerLost(f"its worker died {tries[i]} times ({type(e).__name__})", item.key)
                            recorder.failed(item.key, error_record(item.key, lost))
                            progress.finish(item.key, False, time.perf_counter() - started)
                        continue
                    except RayTaskError as e:  # --debug: an unexpected exception, with the worker's traceback
                        raise e.as_instanceof_cause() from None
                    idle.append(actor)
                    if outcomes[0] == "stop":
                        raise _stop_error(*outcomes[1])
                    for i, outcome in zip(indices, outcomes):
                        item = items[i]
                        if outcome[0] == "error":
                            recorder.failed(item.key, outcome[1], outcome[2])
                            progress.finish(item.key, False, time.perf_counter() - started)
                        else:
                            ok = recorder.answered(item.key, outcome[1])
                            progress.finish(item.key, ok, time.perf_counter() - started)
        finally:  # stopped or failed: the inputs in flight are dropped with their workers
            for actor in spawned:
                ray.kill(actor, no_restart=True)


def _ready(ray, spawn, n: int, lost_errors, model: str) -> list:
    """``n`` actors with the model loaded. One that dies loading it (killed, out of memory) is
    replaced; a replacement that dies too ends the run (one line; the completed lines are kept)."""
    from ray.exceptions import RayTaskError

    pending = {}  # ready() ref -> (actor, how many workers died before it in its place)
    for _ in range(n):
        actor = spawn()
        pending[actor.ready.remote()] = (actor, 0)
    actors = []
    while pending:
        (ref,), _ = ray.wait(list(pending), num_returns=1)
        actor, lost = pending.pop(ref)
        try:
            ray.get(ref)
        except lost_errors as e:
            if lost >= RETRIES:
                raise ModelError(f"a worker died loading the model {lost + 1} times ({type(e).__name__}); see how "
                                 "much memory a worker needs in docs/scale-out.md", model) from None
            actor = spawn()
            pending[actor.ready.remote()] = (actor, lost + 1)
            continue
        except RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, HybridKVError):
                raise ModelError(cause.reason, cause.source) from None
            raise
        actors.append(actor)
    return actors


class BenchWorker:
    """One Ray actor of ``bench --workers``: one session, one model load, a shard of the tasks."""

    def __init__(self, options):
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from hybridkv_cli.runs.session import Session

        self.session = Session(options)

    def bench(self, tasks, methods, budgets, kwargs):
        from hybridkv_cli.runs.bench import run_bench

        return run_bench(self.session, tasks, methods, budgets, console=None, **kwargs)


def run_bench_distributed(settings, tasks, methods, budgets, *, workers: int | None = None, address: str | None = None,
                          gpus_per_worker: float = 0.0, console=None, quiet: bool = False, per_video: bool = False,
                          num_cpus: int | None = None, **kwargs) -> dict:
    """:func:`~hybridkv_cli.runs.bench.run_bench` over Ray workers: the tasks (with ``per_video``, the
    groups of tasks about one media) are dealt round-robin to the workers, each runs its shard with
    one model load (and its own warm-up), and the items are put back in task order and aggregated
    once; the result has :func:`run_bench`'s shape."""
    from hybridkv_cli.runs.bench import aggregate, group_by_media, plan_runs

    if address:
        ray_cluster.gcs_address(address)
    ray = import_ray("--ray" if address and not workers else "--workers")
    groups = group_by_media(tasks) if per_video else [[t] for t in tasks]
    started_ray = ray_cluster.start(ray, address, workers, num_cpus)
    try:
        n = min(len(groups), workers or _default_workers(ray, gpus_per_worker))
        check_gpus(ray, gpus_per_worker)
        Actor = ray.remote(num_cpus=1, num_gpus=gpus_per_worker or 0, max_restarts=0)(BenchWorker)
        shards = [[t for g in groups[i::n] for t in g] for i in range(n)]
        if console is not None and not quiet:
            console.print(f"bench: {len(tasks)} task{'s' if len(tasks) != 1 else ''} over {n} "
                          f"worker{'s' if n != 1 else ''} ...", highlight=False, soft_wrap=True)
        refs = [Actor.remote(settings).bench.remote(shard, methods, budgets, dict(kwargs, per_video=per_video))
                for shard in shards]
        try:
            results = ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
    finally:
        if started_ray:
            ray.shutdown()
    order = {t.id: i for i, t in enumerate(tasks)}
    items = sorted((item for r in results for item in r["items"]), key=lambda item: order.get(item.get("id"), 0))
    config = dict(results[0]["config"], inputs=len(tasks), workers=n)
    return {"config": config, "aggregates": aggregate(items, plan_runs(methods, budgets)), "items": items}
