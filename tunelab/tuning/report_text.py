"""The terminal summary of a tuning run."""

from __future__ import annotations

from ..knobs import Knobs
from ..units import counted
from .result import gain_text
from .run import KNOBS_WIDTH, describe


def print_tune_summary(result: dict) -> None:
    default, best, final = result["default"], result["best"], result["locked_final"]
    hier = "hierarchical" in result.get("searched", ())  # hier=off said where it was searched
    each = f" (exploration blocks of {result['block_steps']} measured steps)" if result.get("block_steps") else ""
    print(f"# {counted(len(result['samples']), 'block')} in {result['seconds']:.0f} s{each}; locked after "
          f"{counted(result['samples_to_lock'], 'block')}, {counted(result['steps_to_lock'], 'step')} "
          f"({result['seconds_to_lock']:.0f} s); exploration ended: {result['stop_reason']}")
    print(f"default: {describe(Knobs(**default['knobs']), hier=hier):<{KNOBS_WIDTH}} {default['score']:8.2f} samples/s "
          f"(mean of its {counted(len(default['scores']), 'reference block')})")
    print(f"locked : {describe(Knobs(**best['knobs']), exact=True, hier=hier):<{KNOBS_WIDTH}} {best['score']:8.2f} samples/s")
    print(f"gain   : {gain_text(result)}")
    drift = result.get("drift") or {}
    if drift.get("block_sigma_frac") is not None:
        aside = drift.get("disturbed_blocks") or 0
        ranged = (f"the default's blocks ranged over {100 * drift['range_frac']:.1f}% of their mean"
                  if len(default["scores"]) > 1 else "one reference block: no drift can be seen")
        print(f"drift  : {ranged}; "
              f"one block's noise {100 * drift['block_sigma_frac']:.1f}%"
              + (f"; {aside} disturbed block{'s' if aside > 1 else ''} set aside" if aside else ""))
    for d in result.get("decisions", [])[:-1]:
        print(f"retune : epoch {d['epoch']} had locked {describe(Knobs(**d['knobs']), hier=hier)}; its step time left "
              "the locked interval, so the search re-opened")
    print(final_text(final, default, best["knobs"] == default["knobs"]))
    if "profile_id" in result:
        print(f"stored : profile {result['profile_id']} in {result['store']} "
              "(training jobs on this hardware load it automatically)")
    elif result.get("store_error"):
        print(f"stored : not stored: {result['store_error']}")


def final_text(final: dict, default: dict, same: bool) -> str:
    """The ``final`` line: the locked configuration's steps after tuning against the default's last
    reference blocks (the nearest in time: a drifting host moves both alike) and against its mean over
    the run; the two differ by the host's drift, which the line names when they part by more than 2 %."""
    def ratio(score: float) -> float:
        return final["score"] / score if score else float("nan")

    text = (f"final  : {final['score']:.2f} samples/s, the median of {len(final['scores'])} steps of the locked "
            "configuration after tuning: ")
    recent = final.get("default_recent")
    whole = ratio(default["score"])
    if recent:
        last = ratio(recent["score"])
        n = recent["blocks"]
        text += (f"{last:.2f}x the default's last {n} reference block{'s' if n > 1 else ''} "
                 f"({recent['score']:.2f}), {whole:.2f}x its mean while tuning")
        moved = recent["score"] / default["score"] - 1.0 if default["score"] else 0.0
        if abs(moved) > 0.02:
            text += f" (the host moved by {100 * moved:+.0f}% meanwhile)"
        off = last
    else:
        text += f"{whole:.2f}x the default's mean while tuning"
        off = whole
    if same and abs(off - 1) > 0.02:
        text += "; the same knobs, so the difference is the host's"
    return text
