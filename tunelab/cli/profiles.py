"""``tunelab profiles``: look at, move and prune the tuning profiles stored on this host.

Export/import lets a profile tuned on one cluster seed the same hardware elsewhere; every failure
is one ``tunelab: error:`` line and exit 1 (bad flags: one line and exit 2, from the parser).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import TunelabError, UsageError
from ..files import read_json, write_text
from ..knobs import Knobs, knob_text
from ..units import counted
from .types import input_file, output_file, profile_id


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``profiles`` with its subcommands; they use the same parser class (one-line errors)."""
    profiles = subparsers.add_parser("profiles", help="tuning profiles stored on this host")
    psub = profiles.add_subparsers(dest="profiles_command", required=True, parser_class=type(profiles))

    psub.add_parser("list", help="one line per profile").set_defaults(func=cmd_list)
    show = psub.add_parser("show", help="a profile's hardware, best config and trials")
    show.add_argument("id", type=profile_id, metavar="ID")
    show.set_defaults(func=cmd_show)
    export = psub.add_parser("export", help="write profiles (all, or IDS) as JSON")
    export.add_argument("--out", type=output_file, default=None, metavar="FILE", help="default: stdout")
    export.add_argument("ids", type=profile_id, nargs="*", metavar="ID")
    export.set_defaults(func=cmd_export)
    import_ = psub.add_parser("import", help="merge profiles from an export file")
    import_.add_argument("file", type=input_file, metavar="FILE")
    import_.set_defaults(func=cmd_import)
    delete = psub.add_parser("delete", help="remove a profile with its trials")
    delete.add_argument("id", type=profile_id, metavar="ID")
    delete.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    delete.set_defaults(func=cmd_delete)


def _store(create: bool = False):
    """The store; commands that only read (or delete) create none where there is none."""
    from ..profiles import ProfileStore

    return ProfileStore(create=create)


def _existing(store, profile_id: int):
    summary = store.get(profile_id)
    if summary is None:
        raise TunelabError(f"no profile with id {profile_id} in {store.path}")
    return summary


def cmd_list(args: argparse.Namespace) -> int:
    from ..bench.common import format_table

    store = _store()
    rows = store.profiles(with_damaged=True)  # (a damaged row is listed as such: `show ID` says what)
    if not rows:
        print(f"# no profiles in {store.path}")
        return 0
    print(f"# {counted(len(rows), 'profile')} in {store.path}")
    table = [{**vars(r), "gain": _gain_text(store, r)} for r in rows]
    print(format_table(_left_aligned(table, ("hardware_name", "model_name")), [
        ("id", "id", "d"), ("hardware_name", "hardware", ""), ("model_name", "model", ""),
        ("framework", "framework", ""), ("world_size", "world", "d"), ("n_trials", "trials", "d"),
        ("best_score", "best_samples/s", ".2f"), ("gain", "gain", "")]))
    return 0


def _gain_text(store: Any, summary: Any) -> str | None:
    """The best's gain as ``show`` gives it: the tuner's estimate with its interval, the interval alone
    where a store from before schema 3 kept no estimate (the ratio of the two means can lie outside it),
    "default kept"; "damaged" for a profile or best that cannot be read (``show`` says what)."""
    from ..profiles import DamagedProfileError

    if summary.damage is not None:
        return "damaged"
    if summary.best_score is None:
        return None
    try:
        best = store.best_of(summary.id)
    except DamagedProfileError:
        return "damaged"
    if best is None:
        return None
    if best.gain_low is None and best.outcome is not None:
        return "default kept"
    return best.interval_text()


def _left_aligned(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """Pad text columns so the (right-justifying) table shows them left-aligned (n/a: a damaged row's)."""
    for key in keys:
        for r in rows:
            r[key] = "n/a" if r[key] is None else str(r[key])
        width = max(len(r[key]) for r in rows)
        for r in rows:
            r[key] = r[key].ljust(width)
    return rows


def cmd_show(args: argparse.Namespace) -> int:
    from ..bench.common import format_table

    store = _store()
    s = _existing(store, args.id)
    best, trials = store.best_of(s.id), store.trials(s.id)  # read whole before printing: a damaged row is one line
    print(f"profile {s.id}: {s.model_name} [{s.model_signature}]  framework={s.framework}  "
          f"world_size={s.world_size}  created={s.created}  updated={s.updated}")
    print(f"hardware: {s.hardware_name} [{s.hardware_hash}]")
    from ..hardware import fact_text

    for name, value in s.hardware_facts.items():
        print(f"  {name}: {fact_text(name, value)}")
    if best is None:
        print("best: none yet")
    else:
        # (a ratio of the two configurations' mean scores, which drift moves; the tuner's gain, paired
        # with the default's blocks around each candidate, is the interval on the next line)
        print(f"best: {best.score:.2f} samples/s, {best.score / best.default_score:.3f}x the default's mean of "
              f"{best.default_score:.2f} (unpaired; spread {best.spread:.1%}, run {best.run_id}, {best.updated})")
        if best.gain_low is not None or best.steps is not None or best.outcome:
            parts = [f"gain {best.interval_text()} (90 % interval)" if best.gain_low is not None else
                     f"gain: default kept ({best.kept_reason()})"]
            if best.steps is not None:
                parts.append(f"{best.steps} steps to lock")
            if best.ended and best.ended != "every knob is pinned":
                parts.append(best.ended)
            if best.retuned:
                parts.append("in a search a retune re-opened")
            print("tuning: " + ", ".join(parts))
        for name, value in best.knobs.items():
            print(f"  {name}: {knob_text(name, value)}")
    print(f"trials: {len(trials)}")
    if trials:
        rows = [{**vars(t), "n": i, "changed": _changed_knobs(t.knobs), "spread_pct": 100 * t.spread}
                for i, t in enumerate(trials, 1)]
        print(format_table(rows, [
            ("n", "#", "d"), ("phase", "phase", ""), ("score", "samples/s", ".2f"), ("spread_pct", "spread_%", ".1f"),
            ("steps", "steps", "d"), ("seconds", "seconds", ".1f"), ("run_id", "run", ""),
            ("changed", "knobs (vs defaults)", "")]))
    return 0


def _changed_knobs(knobs: dict) -> str:
    """Only what differs from the defaults, so a trial row stays one readable line."""
    defaults = Knobs().as_dict()
    changed = [f"{k}={knob_text(k, v)}" for k, v in knobs.items() if defaults.get(k, object()) != v]
    return " ".join(changed) or "defaults"


def cmd_export(args: argparse.Namespace) -> int:
    store = _store()
    data = store.export(args.ids or None)
    text = json.dumps(data, indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
        return 0
    write_text(args.out, text)
    n_trials = sum(len(p["trials"]) for p in data["profiles"])
    print(f"# wrote {counted(len(data['profiles']), 'profile')} ({counted(n_trials, 'trial')}) to {args.out}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from ..profile_export import InvalidExport, validate_export

    try:
        data = read_json(args.file)
    except OSError as exc:
        raise UsageError(f"cannot read {args.file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{args.file} is not a tunelab profiles export (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{args.file} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except ValueError as exc:  # (nested too deeply to read, or far too long)
        raise UsageError(f"{args.file} is not a tunelab profiles export ({exc})") from None
    try:
        validate_export(data)  # (before the store is made: a file refused leaves no empty store behind)
        store = _store(create=True)
        result = store.merge(data)
    except InvalidExport as exc:
        raise UsageError(f"{args.file} is not a valid tunelab profiles export: {exc}") from None
    print(f"imported {args.file}: {counted(result.profiles_added, 'new profile')}, "
          f"{counted(result.trials_added, 'new trial')} ({counted(len(result.profile_ids), 'profile')} in the file) "
          f"into {store.path}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    from ..profiles import DamagedProfileError

    store = _store()
    try:
        s = _existing(store, args.id)
        what = f"profile {s.id} ({s.model_name}, {s.framework}, world {s.world_size}, {s.n_trials} trials)"
    except DamagedProfileError:
        what = f"profile {args.id} (damaged)"  # a damaged profile can still be deleted: that is the way out
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError(f"refusing to delete {what} without --yes (no terminal to confirm on)")
        try:
            answer = input(f"delete {what}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("not deleted")
            return 1
    if not store.delete(args.id):
        raise TunelabError(f"no profile with id {args.id} in {store.path}")
    print(f"deleted {what}")
    return 0
