"""``tunelab tune``: tune the engine's knobs live, inside one training run of a scenario."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ..errors import UsageError
from ..units import counted
from .finish import add_output_flags, finish
from .lab import scenario_ranks, scenario_session
from .types import (
    add_training_flags,
    chosen_scenario,
    default_scenario_input,
    input_file,
    knob,
    named_input,
    positive_float,
    positive_int,
    scenario_input,
)
from .types import seed as seed_type


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..engine.link import add_link_flags

    tune = subparsers.add_parser("tune", help="tune the engine's knobs live, inside one training run")
    which = tune.add_mutually_exclusive_group()
    named_input(which.add_argument("--model", default=None, help="scenario name (scenarios/NAME.toml; default resnet50)"),
                scenario_input, default_scenario_input)
    which.add_argument("--scenario", type=input_file, default=None, help="a scenario file (instead of --model)")
    tune.add_argument("--framework", choices=["torch", "tensorflow"], default=None,
                      help="the training framework (default: the scenario's)")
    tune.add_argument("--np", type=positive_int, default=None, help="ranks to launch")
    tune.add_argument("--lab", action="store_true",
                      help="train on the hosts of 'tunelab lab up' (or give the scenario a [lab] table)")
    tune.add_argument("--ranks-per-node", type=positive_int, default=None,
                      help="emulate nodes of K ranks on one host (hierarchical joins the search)")
    add_link_flags(tune)
    add_training_flags(tune)
    budget = tune.add_mutually_exclusive_group()
    budget.add_argument("--budget", type=positive_int, default=None, metavar="SAMPLES",
                        help="blocks to explore, the default's reference blocks included (default: the "
                             "scenario's budget_samples; 20 where it sets none); a scenario's time budget then "
                             "does not apply")
    budget.add_argument("--time-budget", type=positive_float, default=None, metavar="SECONDS",
                        help="end the search within about this many seconds of training (warm-up and "
                             "re-measurement included): exploration stops while a round of re-measurement "
                             "still fits, if the scenario's block budget has not stopped it first")
    tune.add_argument("--seed", type=seed_type, default=0,
                      help="seeds the search strategy (default 0): the same seed proposes the same knobs for the same measurements")
    tune.add_argument("--knob", type=knob, action="append", default=[], metavar="NAME=VALUE",
                      help="pin a knob (excluded from the search); repeatable")
    tune.add_argument("--no-store", action="store_true", help="do not write the profile store")
    tune.add_argument("--retune", type=positive_int, nargs="?", const=200, default=0, metavar="STEPS",
                      help="after the lock, train STEPS more steps (default 200) and tune again if step time "
                           "leaves the locked configuration's interval")
    named_input(tune.add_argument("--model-file", type=input_file, default=None, metavar="FILE",
                                  help="a fitted scale model (tunelab model fit): its predicted best settings are "
                                       "the first proposals when this hardware has no stored trials (default: "
                                       "$TUNELAB_HOME/scale-model.json when it exists)"),
                Path, _default_model_input)
    add_output_flags(tune)
    tune.set_defaults(func=run)


def _default_model_input(args: argparse.Namespace) -> list[Path]:
    """The scale model tune reads when --model-file is not given (an output naming it is refused)."""
    from ..model.tuner import default_model_path

    path = default_model_path()
    return [path] if path.exists() else []


def run(args: argparse.Namespace) -> int:
    from ..launch import check_ranks_fit, inside_mpi_job, run_job
    from ..scenarios import load_scenario
    from ..tuning.report_text import print_tune_summary

    scenario = load_scenario(chosen_scenario(args))
    if args.link_gbps is not None and args.ranks_per_node is None and scenario.ranks_per_node is None:
        raise UsageError("--link-gbps emulates the link between emulated nodes: give --ranks-per-node too")
    scenario = scenario.with_overrides(
        framework=args.framework, np=args.np, ranks_per_node=args.ranks_per_node, link_gbps=args.link_gbps,
        link_latency_us=args.link_latency_us, image_size=args.image_size, device=args.device,
        batch_size=args.batch_size, budget_samples=args.budget, time_budget_s=args.time_budget,
        knobs={**scenario.knobs, **dict(args.knob)} if args.knob else None)
    if args.budget is not None:  # the budget asked for is the one budget: not cut short by the scenario's seconds
        scenario = dataclasses.replace(scenario, time_budget_s=None)
    if args.model_file is not None:  # named on the command line: one that cannot be read is a usage error
        if not args.model_file.exists():
            raise UsageError(f"--model-file {args.model_file}: no such file")
        from ..model.fit import ScaleModel

        ScaleModel.load(args.model_file)
    params = {**scenario.as_params(), "seed": args.seed, "store": not args.no_store, "retune_steps": args.retune,
              "model_file": str(args.model_file.resolve()) if args.model_file else None}
    with scenario_session(args.lab, scenario) as lab:
        np_ = scenario_ranks(lab, args.np, scenario)
        if np_ == 1 and scenario.workload == "train":
            raise UsageError("tune needs 2 or more ranks to train: one rank's gradients are already their own "
                             "allreduce, so tunelab sends nothing and no knob changes a step (--np 2 or more)")
        if not inside_mpi_job():
            check_ranks_fit(np_)  # before the header, which would name them
        print(f"# tuning {scenario.name}: {scenario.model} "
              f"({scenario.framework if scenario.workload == 'train' else 'replay'}) on {np_} ranks, "
              + f"budget {counted(scenario.budget_samples, 'exploration block')} (the default's included)"
              + (f" or {scenario.time_budget_s:g} s of tuning, whichever ends first" if scenario.time_budget_s else "")
              + (f", pinned {', '.join(scenario.knobs)}" if scenario.knobs else ""), flush=True)
        if lab is not None:
            print(f"# on the lab: {lab.describe()}", flush=True)
        result = run_job("tune", params, np_, lab=lab)
    print_tune_summary(result)
    # a store that failed while the run measured: the result is still written (JSON, report), then one
    # error line and exit 1, since what the command is for (the stored profile) did not happen
    return finish(args, result, "tune", "tune", bad=[result["store_error"]] if result.get("store_error") else (),
                  problem="the result was not stored in the profile store:")

