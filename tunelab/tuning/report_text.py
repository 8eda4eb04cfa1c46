"""The terminal summary of a tuning run."""

from __future__ import annotations

from ..knobs import Knobs
from .run import describe


def print_tune_summary(result: dict) -> None:
    default, best, final = result["default"], result["best"], result["locked_final"]
    print(f"# {len(result['samples'])} samples in {result['seconds']:.0f} s; stopped: {result['stop_reason']}")
    print(f"default: {describe(Knobs(**default['knobs'])):<52} {default['score']:8.2f} samples/s "
          f"(mean of {len(default['scores'])}: {', '.join(f'{s:.2f}' for s in default['scores'])})")
    print(f"tuned  : {describe(Knobs(**best['knobs'])):<52} {best['score']:8.2f} samples/s "
          f"(mean of {len(best['scores'])}: {', '.join(f'{s:.2f}' for s in best['scores'])})")
    if "runner_up" in result:
        up = result["runner_up"]
        print(f"kept   : the default: the best finalist, {describe(Knobs(**up['knobs']))} "
              f"({', '.join(f'{s:.2f}' for s in up['scores'])} samples/s), did not beat it in every re-measurement")
    print(f"gain   : {result['gain']:.3f}x over default; locked run afterwards: {final['score']:.2f} samples/s")
    if "profile_id" in result:
        print(f"stored : profile {result['profile_id']} in {result['store']} "
              "(training jobs on this hardware load it automatically)")
