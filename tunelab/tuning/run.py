"""``tunelab tune`` on every rank: train a workload, tune the knobs live, store and report the result.

Rank 0 prints one progress line per sample and writes every finished trial to the profile
store as soon as it is measured, so a job killed mid-tune keeps what it measured.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from ..errors import TunelabError
from ..knobs import Knobs, knob_text, stored_knobs
from .plan import Plan, Sample
from .result import record_sample, search_run_id, summarise
from .session import TuningSession


@dataclass
class Workload:
    step: Callable[[], None]
    samples_per_step: float
    signature: str
    name: str
    legacy_signature: str | None = None  # the model's key before 2026-11-28 (torch), where a profile may be


def run_rank(p: dict) -> dict:
    return run_with_workload(p, _tune)


def run_with_workload(p: dict, body: Callable[[dict, Any, Workload, dict], dict]) -> dict:
    """Start the runtime with the scenario's pinned knobs, build its workload, run ``body(p, runtime,
    workload, pinned)`` and shut down (used by ``tune`` and ``bench landscape``)."""
    from mpi4py import MPI

    from .. import runtime

    comm = MPI.COMM_WORLD
    pinned = dict(p.get("knobs", {}))
    rt = runtime.init(comm, ranks_per_node=p.get("ranks_per_node"), link_gbps=p.get("link_gbps"),
                      link_latency_us=p.get("link_latency_us"), **pinned)
    with runtime.closing():
        # pinned: the scenario's and --knob's, and those a TUNELAB_* variable sets (the engine runs them:
        # searched, the first reference block would run them under the default's label)
        pinned = {k: getattr(rt.config.knobs, k) for k in sorted(rt.config.pinned)}
        return body(p, rt, make_workload(p, rt, comm), pinned)


def _tune(p: dict, rt: Any, workload: Workload, pinned: dict) -> dict:
    from .space import search_space
    from .strategies import make_strategy

    comm = rt.sync_comm
    topo = rt.topology
    space = search_space(pinned, topo.num_nodes, base=Knobs(**pinned), device=p.get("device") == "cuda",
                         uniform_nodes=topo.homogeneous)
    recorder, stored, (first, model_path) = _prepare_on_rank0(p, rt, workload, space, comm)
    seed = p.get("seed", 0)

    def strategy(epoch: int) -> Any:
        made = make_strategy(p.get("strategy", "tunelab"), space, seed + 1000 * epoch)
        if epoch == 0 and stored:
            made.warm_start(stored)
        if epoch == 0 and first:
            from .strategies import SeededStrategy

            made = SeededStrategy(made, first)
        return made

    retune_steps = int(p.get("retune_steps") or 0)
    plan = Plan(warmup_steps=p["warmup_steps"], discard_steps=p["discard_steps"],
                measure_steps=p["measure_steps"], block_seconds=p.get("block_seconds", Plan().block_seconds),
                budget_samples=p["budget_samples"],
                time_budget_s=p.get("time_budget_s"), retune=retune_steps > 0)
    printer = _progress(p["budget_samples"], recorder, hier="hierarchical" in space.names) if comm.rank == 0 else None
    session = TuningSession(rt.coordinator, comm, workload.samples_per_step, space, strategy, plan, printer)
    t0 = time.perf_counter()
    _train_until_locked(workload, session)
    for _ in range(retune_steps):  # watch the locked configuration (the driver may re-open the search)
        workload.step()
        session.step_done()
    _train_until_locked(workload, session)
    # three blocks' worth of steps (rank 0's driver sized the blocks)
    block_steps = comm.bcast(session.driver.block_steps if comm.rank == 0 else None, root=0)
    final = _measure_locked(workload, comm, p.get("final_steps", 3 * block_steps))
    if comm.rank != 0:
        return {}
    result = summarise(session.driver, final, workload, space, time.perf_counter() - t0, topo)
    if recorder is not None and recorder.hardware:  # where it ran, with or without a store to hold it
        result["hardware_name"], result["hardware"] = recorder.hardware
    if first:  # where the search started: said in the output, not only on the terminal
        result["first_proposals"] = {"source": "scale model", "model_file": model_path,
                                     "knobs": [k.as_dict() for k in first],
                                     # ranked on a replay's default compute times (a training scenario has none)
                                     "compute_assumed": p.get("workload") != "replay"}
    if recorder is not None and recorder.write:
        recorder.finish(result)
        if recorder.failed is None:
            result["profile_id"] = recorder.profile_id
        else:
            result["store_error"] = recorder.failed
        result["store"] = str(recorder.store.path)
    return result


def _prepare_on_rank0(p: dict, rt: Any, workload: Workload, space: Any,
                      comm: Any) -> tuple[Any, list, tuple[list, str | None]]:
    """Rank 0's part before training: the profile store's record and stored trials, and the scale
    model's first proposals unless this hardware's own trials start the search.  Whether it worked is
    broadcast, so that a failure there (a damaged store, a model file that does not parse) stops every
    rank at once, with rank 0's error, rather than leaving the others training alone until they time
    out waiting for rank 0."""
    recorder, stored, first, failure = None, [], ([], None), None
    if comm.rank == 0:
        try:
            recorder = _Recorder.create(p, rt, workload, write=p.get("store", True))
            stored = recorder.warm_start_observations(space.base, space.names)
            # This hardware's own trials, when they count, start the search; otherwise (none, or only
            # another profile's: other hardware) the scale model proposes for this layout too.  (It is
            # fitted on the host path: no first proposals for a GPU job.)
            own = stored and recorder.warm_source == recorder.profile_id
            first = _model_proposals(p, rt, space) if not own and p.get("device") != "cuda" else ([], None)
        except Exception as exc:  # noqa: BLE001 - raised again below, on every rank
            failure = exc
    said = comm.bcast(None if failure is None else str(failure).splitlines()[0] if str(failure) else
                      type(failure).__name__, root=0)
    if failure is not None:
        raise failure
    if said is not None:
        raise TunelabError(f"rank 0 could not prepare the tuning run: {said}")
    return recorder, stored, first


def _model_proposals(p: dict, rt: Any, space: Any) -> tuple[list[Knobs], str | None]:
    """On a topology without stored trials: the scale model's predicted-best settings as the first
    proposals (``p["model_file"]``, else ``$TUNELAB_HOME/scale-model.json`` when it exists), and that file."""
    import os
    from pathlib import Path

    from ..lab.launch import current_lab
    from ..model.tuner import default_model_path, job_proposals

    path = Path(p["model_file"]) if p.get("model_file") else default_model_path()
    if not path.exists():
        return [], None
    topo, lab = rt.topology, current_lab()
    link_gbps = lab.spec.link_gbps if lab is not None else rt.config.link_gbps
    one_machine = lab is not None or rt.config.ranks_per_node is not None  # every rank on this host's cores
    ranks_here = topo.size if one_machine else topo.local_size
    cores = topo.host_cores or os.cpu_count() or 1  # (the cores the job's ranks may use: taskset, a cpuset)
    first, lines = job_proposals(path, p, topo.num_nodes, topo.local_size, link_gbps, ranks_here / cores, space)
    for line in lines:
        print(line, flush=True)
    return first, str(path)


def _train_until_locked(workload: Workload, session: TuningSession) -> None:
    while session.tuning:
        workload.step()
        session.step_done()


def make_workload(p: dict, rt: Any, comm: Any) -> Workload:
    """A scenario's step on this rank (``p``: ``Scenario.as_params()``), shared by ``tunelab tune`` and
    ``bench landscape`` so both time the same training step; cores are split among this host's ranks."""
    from ..bench.train import _threads_per_rank

    return _make_workload(p, rt, _threads_per_rank(comm))


def built_everywhere(comm: Any, build: Callable[[], Any]) -> Any:
    """``build()`` (this rank's own work: no collective in it), then whether every rank's worked.  A
    rank whose build failed (no GPU for it, out of memory, a model that does not build) raises its own
    error and the others an error naming it, all at once; else the others would wait in the collective
    that follows (the parameters' broadcast, the tuning run) while the failed rank waited for them in
    the runtime's shutdown, for good."""
    result, failure = None, None
    try:
        result = build()
    except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
        failure = exc
    said = comm.allgather(None if failure is None else (str(failure).splitlines() or [type(failure).__name__])[0])
    if failure is not None:
        raise failure
    bad = [(r, line) for r, line in enumerate(said) if line is not None]
    if bad:
        raise TunelabError("the workload could not be built on " + "; ".join(f"rank {r}: {line}" for r, line in bad))
    return result


def _make_workload(p: dict, rt: Any, threads: int) -> Workload:
    if p["workload"] == "replay":
        from ..workloads.replay import GradientReplay

        dtype = p.get("replay_dtype", "float32")
        replay = built_everywhere(rt.sync_comm, lambda: GradientReplay(
            p["model"], forward_ms=p["replay_forward_ms"], backward_ms=p["replay_backward_ms"], dtype=dtype,
            seed=rt.topology.rank))
        suffix = "" if dtype == "float32" else f":{dtype}"
        return Workload(lambda: replay.step(rt.coordinator), p["batch_size"] * rt.topology.size,
                        f"replay:{p['model']}{suffix}", p["model"] + suffix)
    if p["framework"] == "torch":
        return _torch_workload(p, rt, threads)
    if p["framework"] == "tensorflow":
        return _tf_workload(p, rt, threads)
    raise ValueError(f"tunelab tune does not support framework {p['framework']!r} yet")


def _torch_workload(p: dict, rt: Any, threads: int) -> Workload:
    import torch

    import tunelab.torch as tl

    from ..workloads.torch_device import finish, gpu_slot, torch_device
    from ..workloads.torch_models import build, synthetic_batch

    torch.set_num_threads(threads)

    def local() -> tuple[Any, Any, Any, Any]:
        # cuda: this rank's GPU, by its place on the machine, as bench train picks it
        device = torch_device(p.get("device", "cpu"), gpu_slot(rt.topology.rank, rt.topology.host_rank))
        kw = {"seq_len": p.get("seq_len", 128)} if p["model"] == "bert" else {"image_size": p["image_size"]}
        x, y = synthetic_batch(p["model"], p["batch_size"], seed=1 + rt.topology.rank, **kw)
        torch.manual_seed(0)
        return device, x.to(device), y.to(device), build(p["model"]).to(device)

    device, x, y, model = built_everywhere(rt.sync_comm, local)
    tl.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                  named_parameters=model.named_parameters(), load_profile=False)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        finish(device)  # a step's time includes its device work

    return Workload(step, p["batch_size"] * rt.topology.size, tl.model_signature(model), p["model"],
                    tl.optimizer.ordered_model_signature(model))


def _tf_workload(p: dict, rt: Any, threads: int) -> Workload:
    """The Keras model in a ``tf.function`` step.  Thread counts are set before TensorFlow starts its
    runtime (it ignores later changes), so ranks sharing a host do not oversubscribe its cores."""
    from ..workloads.keras_models import build, configure_runtime, import_tensorflow, synthetic_batch

    tf = import_tensorflow()  # without its C++ start-up lines, which would bury the progress

    configure_runtime(threads)
    import keras

    import tunelab.tensorflow as tl

    seq_len = p.get("seq_len", 128)

    def local() -> tuple[Any, Any, Any]:
        x, y = synthetic_batch(p["model"], p["batch_size"], p["image_size"], seed=1 + rt.topology.rank,
                               seq_len=seq_len)
        keras.utils.set_random_seed(0)
        return tf.constant(x), tf.constant(y), build(p["model"], image_size=p["image_size"], seq_len=seq_len)

    x, y, model = built_everywhere(rt.sync_comm, local)
    tl.broadcast_variables(model.weights, root_rank=0)
    opt = keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
    opt.build(model.trainable_variables)  # its variables exist before the step is traced
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=False)
    def train_step() -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tl.DistributedGradientTape(tape, load_profile=False).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return Workload(train_step, p["batch_size"] * rt.topology.size, tl.model_signature(model),
                    p["model"])


def _measure_locked(workload: Workload, comm: Any, steps: int) -> list[float]:
    """Samples/s of the locked configuration over ``steps`` steps (after one discarded step)."""
    workload.step()
    comm.Barrier()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        workload.step()
        times.append(time.perf_counter() - t)
    return [workload.samples_per_step / t for t in times]


KNOBS_WIDTH = 56  # the column :func:`describe` fills in tune's block lines and summary


def describe(knobs: Knobs, exact: bool = False, hier: bool = False) -> str:
    """Knobs on one line, sizes as people read them (:func:`knob_size`); ``exact``: as ``--knob`` takes
    them back (the locked line, which users copy).  ``hier=on`` whenever it is on, ``hier=off`` only
    where ``hier`` asks (a job of several nodes, where it is searched): on one node it means nothing."""
    def text(name: str) -> str:
        return knob_text(name, getattr(knobs, name), exact)

    line = (f"fusion={text('fusion_threshold_bytes')} cycle={text('cycle_time_ms')}ms "
            f"segment={text('segment_bytes')}")
    if hier or knobs.hierarchical:
        line += f" hier={text('hierarchical')}"
    if knobs.oneshot_max_bytes != Knobs().oneshot_max_bytes:  # searched on GPUs: shown where it moved
        line += f" oneshot={text('oneshot_max_bytes')}"
    return line


def _progress(budget: int, recorder: _Recorder | None, hier: bool = False) -> Callable[[Sample], None]:
    count = [0, 0]  # exploration blocks of this search, the search (a retune re-opens one)
    explored: set[Knobs] = set()
    width = max(6, 4 + len(str(budget)))  # "  7/20", "close", "r": one column whatever the budget

    def show(s: Sample) -> None:
        if recorder is not None:
            recorder.record(s)
        if s.epoch != count[1]:  # a new search counts its own budget
            count[:] = [0, s.epoch]
            explored.clear()
        count[0] = count[0] + 1 if s.phase == "explore" else count[0]
        if s.phase == "explore":  # the reference that closes a spent budget is past it: "close"
            label = f"{count[0]:>3}/{budget}" if count[0] <= budget else "close"
            explored.add(s.knobs)
        else:
            label = s.phase[:1]
        label = label.rjust(width)
        ratio = f"  {math.exp(s.told):.3f}x ref" if s.told is not None else ""
        if s.role == "candidate" and s.told is None:
            ratio = "  (after a reference set aside as disturbed: not paired)"
        steps = f", {s.steps} steps" if s.phase == "remeasure" else ""  # their length follows the noise
        why = ""
        if s.phase == "remeasure" and s.role == "candidate" and s.knobs not in explored:
            why = "  (the model's pick near the best measured: single blocks above are noisy)"
            explored.add(s.knobs)
        print(f"[{label}] {s.phase:<9} {s.role:<9} {describe(s.knobs, hier=hier):<{KNOBS_WIDTH}} {s.score:8.2f} samples/s "
              f"(spread {100 * s.spread:.1f}%{steps}){ratio}{why}", flush=True)

    return show


class _Recorder:
    """Rank 0's link to the profile store: every trial as it finishes, the best at the end."""

    def __init__(self, store: Any, profile_id: int | None, run_id: str, key: Any, seeded_from: Any,
                 write: bool = True, hardware: tuple[str, dict] | None = None) -> None:
        self.store, self.profile_id, self.run_id, self.key = store, profile_id, run_id, key
        self.seeded_from, self.write = seeded_from, write
        self.hardware = hardware  # (the profile's hardware name, its facts): what the run's output records
        self.warm_source: int | None = None  # the profile whose trials warm_start_observations read
        self.failed: str | None = None  # why the store took no more of this run's writes (None: it took them)

    @classmethod
    def create(cls, p: dict, rt: Any, workload: Workload, write: bool = True) -> _Recorder:
        from ..profiles import ProfileStore

        framework = p["framework"] if p["workload"] != "replay" else "replay"
        fp = rt.fingerprint(framework)
        legacy = workload.legacy_signature if workload.legacy_signature != workload.signature else None
        keys = rt.profile_keys(workload.signature, framework, legacy)
        key = keys[0]
        store = ProfileStore(create=write)
        existing = found = None
        for k in keys:
            if (existing := _profile_id(store, k)) is not None:
                found = k
                break
        if found is not None and found != key:
            # tuned before a key changed (the model's signature, or the hardware hash of before 2026-11-29):
            # tune on in that profile, moved to today's key (where a job that groups the parameters
            # otherwise, or has TensorFlow installed beside torch, finds it too); read where it is under
            # --no-store
            if not write:
                key = found
            elif (today := _profile_id(store, key)) is None:  # (another tune may have made today's key
                store.rekey(existing, key)                     # meanwhile: tune on in that one, and leave
            else:                                              # the earlier as it is)
                existing = today
        # a new profile is seeded from the nearest one; so is one with no trials yet (its first run was
        # killed before it measured a block: the profile is made when a run starts)
        fresh = existing is None or not store.trials(existing)
        seeded = store.nearest(key, fp.facts, also=(legacy,) if legacy else ()) if fresh else None
        pid = store.upsert_profile(key, fp.name, fp.facts, workload.name) if write else existing
        return cls(store, pid, uuid.uuid4().hex[:12], key, seeded, write, (fp.name, dict(fp.facts)))

    def warm_start_observations(self, reference: Knobs, searched: Collection[str]) -> list[Any]:
        """Stored trials of this profile (or of the nearest one, said aloud) as paired log ratios: each
        earlier run's candidates over the mean of that run's default blocks, with extra variance; only
        runs whose default was ``reference``, this run's, and candidates that vary only the ``searched``
        knobs (the others are left out, said aloud)."""
        from ..units import counted
        from .result import stored_observations, within

        source = self.profile_id
        if (source is None or not self.store.trials(source)) and self.seeded_from is not None:
            source = self.seeded_from.id
            print(f"# no trials for this hardware yet: seeding from profile {source} "
                  f"({self.seeded_from.hardware_name})", flush=True)
        if source is None:
            return []
        self.warm_source = source
        trials = self.store.trials(source)
        others = {stored_knobs(t.knobs) for t in trials if t.phase == "default"} - {reference}
        if others:  # (stored_observations leaves their runs out)
            differ = {k: v for o in others for k, v in o.as_dict().items() if getattr(reference, k) != v}
            what = ", ".join(f"{k}={knob_text(k, v)}" for k, v in differ.items())
            print(f"# warm start: earlier runs of profile {source} whose default differs from this run's "
                  f"({what}) are left out: their ratios are to another configuration", flush=True)
        pinned = [t for t in trials if t.phase == "explore" and stored_knobs(t.knobs) != reference
                  and not within(stored_knobs(t.knobs), reference, searched)]
        if pinned:
            print(f"# warm start: {counted(len(pinned), 'stored trial')} of profile {source} varied knobs this "
                  "run pins: left out", flush=True)
        observations = stored_observations(trials, Plan().warm_start_noise, reference, searched)
        if observations:
            print(f"# warm start: {counted(len(observations), 'stored trial')} from profile {source}", flush=True)
        return observations

    def record(self, s: Sample) -> None:
        self._write(lambda: record_sample(self.store, self.profile_id, self.run_id, s))

    def finish(self, result: dict) -> None:
        iv = result.get("gain_interval")
        args = (self.profile_id, result["best"]["knobs"], result["best"]["score"], result["default"]["score"],
                _mean_spread(result), search_run_id(self.run_id, result["decisions"][-1]["epoch"]))
        steps, how = result["steps_to_lock"], result["outcome"]
        self._write(lambda: self.store.set_best(
            *args, gain_interval=(iv["gain"], iv["low"], iv["high"]) if iv else None, steps=steps, outcome=how))

    def _write(self, write: Callable[[], object]) -> None:
        """A write to the store; once one fails (the profile deleted meanwhile, a full disk, a store
        locked for longer than its timeout: the store's own errors), the run goes on without writing,
        says so once, and its result says why (the command then exits 1, its result written as JSON
        and report).  Anything else is a defect, raised as such."""
        from ..errors import StoreError

        if not self.write or self.failed is not None:
            return
        try:
            write()
        except (StoreError, OSError) as exc:  # tuning goes on; the result says what was not stored
            self.failed = " ".join(str(exc).split()) or type(exc).__name__
            print(f"tunelab: warning: the profile store took no more of this run ({self.failed}); tuning goes "
                  "on, and its result is not stored", flush=True)


def _profile_id(store: Any, key: Any) -> int | None:
    return store.id_of(key)  # (by its key: no other profile's row is read, a damaged one included)


def _mean_spread(result: dict) -> float:
    spreads = [s["spread"] for s in result["samples"] if s["knobs"] == result["best"]["knobs"]]
    return sum(spreads) / len(spreads) if spreads else 0.0


