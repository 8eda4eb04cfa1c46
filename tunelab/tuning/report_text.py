"""The terminal summary of a tuning run."""

from __future__ import annotations

from ..knobs import Knobs
from .result import gain_text
from .run import describe


def print_tune_summary(result: dict) -> None:
    default, best, final = result["default"], result["best"], result["locked_final"]
    each = f" (exploration blocks of {result['block_steps']} measured steps)" if result.get("block_steps") else ""
    print(f"# {len(result['samples'])} blocks in {result['seconds']:.0f} s{each}; locked after "
          f"{result['samples_to_lock']} blocks, {result['steps_to_lock']} steps "
          f"({result['seconds_to_lock']:.0f} s); exploration ended: {result['stop_reason']}")
    print(f"default: {describe(Knobs(**default['knobs'])):<52} {default['score']:8.2f} samples/s "
          f"(mean of its {len(default['scores'])} reference blocks)")
    print(f"locked : {describe(Knobs(**best['knobs']), exact=True):<52} {best['score']:8.2f} samples/s")
    print(f"gain   : {gain_text(result)}")
    drift = result.get("drift") or {}
    if drift.get("block_sigma_frac") is not None:
        aside = drift.get("disturbed_blocks") or 0
        print(f"drift  : the default's blocks ranged over {100 * drift['range_frac']:.1f}% of their mean; "
              f"one block's noise {100 * drift['block_sigma_frac']:.1f}%"
              + (f"; {aside} disturbed block{'s' if aside > 1 else ''} set aside" if aside else ""))
    for d in result.get("decisions", [])[:-1]:
        print(f"retune : epoch {d['epoch']} had locked {describe(Knobs(**d['knobs']))}; its step time left "
              "the locked interval, so the search re-opened")
    ratio = final["score"] / default["score"] if default["score"] else float("nan")
    same = best["knobs"] == default["knobs"]
    print(f"final  : {final['score']:.2f} samples/s, the median of {len(final['scores'])} steps of the locked "
          f"configuration after tuning: {ratio:.2f}x the default's mean while tuning"
          + ("; the same knobs, so the difference is the host's" if same and abs(ratio - 1) > 0.02 else ""))
    if "profile_id" in result:
        print(f"stored : profile {result['profile_id']} in {result['store']} "
              "(training jobs on this hardware load it automatically)")
