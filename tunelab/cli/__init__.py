"""The ``tunelab`` command line: one registry of commands, one module each.

Errors are one line on stderr: bad usage exits 2, a failed run exits 1.

Adding a command: write ``tunelab/cli/NAME.py`` with ``register(subparsers)`` (add the command's parser,
``set_defaults(func=...)``; the function takes the parsed args and returns the exit status, usually
through :func:`tunelab.cli.finish.finish`), then add ``"NAME"`` to :data:`COMMANDS`.  Argument types
are in :mod:`tunelab.cli.types`.  Modules are imported when the parser is built, and import anything
heavy inside their functions, so that ``import tunelab.cli`` stays light.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import TunelabError, UsageError
from .types import Parser

# The registry, in --help order: modules of this package, each with register(subparsers).
COMMANDS: tuple[str, ...] = (
    "bench",
    "tune",
    "hw",
    "report",
    "profiles",
    "lab",
    "model",
)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = Parser(prog="tunelab", description="Bayesian autotuning lab for data-parallel communication.")
    parser.add_argument("--version", action="version", version=f"tunelab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    _name_the_commands(parser)
    return parser


def _name_the_commands(parser: argparse.ArgumentParser) -> None:
    """Every sub-command level names its choices in errors ("required: {allreduce,fusion,...}", not the
    internal dest), and every parser records its ``prog`` so that an unknown flag is reported by the
    command it was given to."""
    parser.set_defaults(_prog=parser.prog, _parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.metavar = "{" + ",".join(action.choices) + "}"
            for child in action.choices.values():
                _name_the_commands(child)


def main(argv: Sequence[str] | None = None) -> int:
    from ..rankmain import alone_in_a_job, end_the_job_if_alone

    try:
        status = _checked_main(argv)
    except SystemExit as exc:  # argparse's usage errors (and --help)
        end_the_job_if_alone(exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2)
        raise
    except Exception:  # a defect's traceback: said, then (alone in a job) the job ended rather than left waiting
        if alone_in_a_job():
            import traceback

            traceback.print_exc()
            end_the_job_if_alone(1)
        raise
    end_the_job_if_alone(status)
    return status


def _checked_main(argv: Sequence[str] | None) -> int:
    try:
        return _main(argv)
    except OSError as exc:  # a path no file system takes, wherever it is first looked at: a usage error
        if exc.errno not in (errno.ENAMETOOLONG, errno.ELOOP):
            raise
        name = os.fsdecode(exc.filename) if exc.filename is not None else ""
        shown = name if len(name) <= 60 else f"{name[:28]}...{name[-28:]}"
        sys.stderr.write(f"tunelab: error: {exc.strerror.lower()}: {shown!r} ({len(name)} characters)\n")
        return 2


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    flag = words[0].split("=")[0] if words else ""
    # the top level's own flags, or a prefix of one (argparse takes those); anything else before the
    # command is named as unknown rather than reported as "a command is required"
    own = flag == "-h" or (len(flag) > 2 and any(f.startswith(flag) for f in ("--help", "--version")))
    if flag.startswith("-") and not own:
        parser.error(f"unrecognized arguments: {words[0]}")
    args, extra = parser.parse_known_args(argv)
    if extra:
        extra = _intermixed(args, words, extra)
    if extra:  # reported by the (sub-)command that was given them, as argparse's parse_args would at the top
        path = args._prog.split()[1:]  # the sub-command words, e.g. ["bench", "allreduce"]
        before = path and path[0] in words and extra[0] in words and words.index(extra[0]) < words.index(path[0])
        Parser(prog=parser.prog if before else args._prog).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        _refuse_overwriting_inputs(args)
        from .types import writes_outputs

        if getattr(args, "report", False) is True and writes_outputs():  # a report under reports/: writable?
            from ..report.auto import reports_unwritable

            why = reports_unwritable()
            if why is not None:
                raise UsageError(why)
    except UsageError as exc:
        sys.stderr.write(f"tunelab: error: {exc}\n")
        return 2
    from ..launch import inside_mpi_job, job_rank

    if inside_mpi_job() and job_rank() != 0:  # under the user's mpiexec/srun: rank 0 speaks for the job
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this process
    # A SIGTERM (a scheduler's, a kill) unwinds like Ctrl-C, so that launched ranks are stopped too.
    previous = _terminate_as_interrupt() if not inside_mpi_job() else None
    sys.stdout = _GuardedOutput(sys.stdout)
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, not at exit: a reader that went away is handled below like any other
        return status
    except UsageError as exc:
        sys.stderr.write(f"tunelab: error: {exc}\n")
        return 2
    except TunelabError as exc:
        sys.stderr.write(f"tunelab: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("tunelab: interrupted\n")
        return 130
    except _Terminated as exc:
        import signal

        hangup = exc.args and exc.args[0] == signal.SIGHUP
        sys.stderr.write("tunelab: hung up\n" if hangup else "tunelab: terminated\n")
        return 129 if hangup else 143
    except BrokenPipeError as exc:
        if _reader_gone():  # the reader of our output went away (``tunelab ... | head``): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
            return 141
        sys.stderr.write(f"tunelab: error: {exc}\n")  # some other pipe broke: that is an error
        return 1
    except _OutputError as exc:  # (a full disk, a quota, an I/O error: output lost, which the status must say)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        sys.stderr.write(f"tunelab: error: cannot write standard output: {exc.strerror or exc}\n")
        return 1
    finally:
        if isinstance(sys.stdout, _GuardedOutput):
            sys.stdout = sys.stdout.stream
        if previous is not None:
            import signal

            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _refuse_overwriting_inputs(args: argparse.Namespace) -> None:
    """UsageError when a file the command would write (an ``output_file`` argument) is one it reads (any
    other path argument) or the profile store: ``--out`` naming the input by mistake must not destroy
    it.  Checked before any work."""
    from ..config import tunelab_home
    from ..errors import StoreError
    from ..profiles import FILE_NAME
    from .types import output_file

    leaf = getattr(args, "_parser", None)
    if leaf is None:
        return
    outputs: list[tuple[str, Path]] = []
    inputs: list[tuple[str, Path]] = []
    try:
        inputs.append(("the profile store", tunelab_home() / FILE_NAME))
    except StoreError:  # no place for a store (no home, a bad TUNELAB_HOME): said by the commands that use one
        pass
    for action in leaf._actions:
        value = getattr(args, action.dest, None)
        values = value if isinstance(value, list) else [value]
        resolve = getattr(action, "input_path", None)  # a name that stands for a file (:func:`.types.named_input`)
        if resolve is not None:
            default = getattr(action, "input_default", None)
            values = ([_resolved(resolve, v) for v in values if isinstance(v, (str, Path))] if value is not None
                      else _defaults(default, args))
        paths = [v for v in values if isinstance(v, Path)]
        name = action.option_strings[-1] if action.option_strings else action.metavar or action.dest
        (outputs if action.type is output_file else inputs).extend((str(name), p) for p in paths)
    for i, (flag, out) in enumerate(outputs):
        for what, given in inputs:
            if _same_file(out, given):
                role = "the profile store" if what == "the profile store" else f"an input of this command ({what})"
                raise UsageError(f"{flag} {out} is also {role}: writing it would destroy it; name another file")
        for other, given in outputs[i + 1:]:
            if _same_file(out, given):
                raise UsageError(f"{flag} and {other} name the same file {out}: one would overwrite the other")


def _resolved(resolve: Any, value: str | Path) -> Path | None:
    try:
        return resolve(str(value))
    except (TunelabError, OSError, ValueError):  # a name that names nothing is the command's to report
        return None


def _defaults(default: Any, args: argparse.Namespace) -> list[Path]:
    """The files a flag left out stands for (what the command reads instead), none when it has no default."""
    if default is None:
        return []
    try:
        return list(default(args))
    except (TunelabError, OSError, ValueError):
        return []


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name the same file (one that exists, or the same path once resolved)."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _intermixed(args: argparse.Namespace, words: list[str], extra: list[str]) -> list[str]:
    """Positionals given after options (``model fit a.json --sizes 1MiB b.json``): argparse's sub-commands
    leave them over, so the command's own words are parsed again as its parser's intermixed form would,
    and ``args`` takes the result.  What is still left over is returned (an error), as before."""
    leaf: argparse.ArgumentParser = args._parser
    listed = [a for a in leaf._actions if not a.option_strings and a.nargs in ("+", "*")]
    if not listed or any(isinstance(a, argparse._SubParsersAction) for a in leaf._actions):
        return extra
    start = 0
    for word in args._prog.split()[1:]:  # the sub-command words, in order
        start = words.index(word, start) + 1
    if any(word not in words[start:] for word in extra):
        return extra  # a word given before the command's own (``model --bogus fit ...``): an error, as ever
    again, left = leaf.parse_known_intermixed_args(words[start:])
    if not left:
        vars(args).update(vars(again))
    return left


def _reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll here, or stdout is not a file
        return False


class _OutputError(OSError):
    """Standard output did not take what was written to it (ENOSPC on /dev/full, EIO, EDQUOT)."""


class _GuardedOutput:
    """Standard output while a command runs: what fails to write or flush it is :class:`_OutputError`,
    told apart from the command's other OSErrors (a broken pipe stays BrokenPipeError: a reader gone)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputError(exc.errno, exc.strerror) from None

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputError(exc.errno, exc.strerror) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class _Terminated(BaseException):
    """SIGTERM or SIGHUP (its number the argument), raised where the main thread is, so that cleanup
    (stopping launched ranks) runs."""


def _terminate_as_interrupt() -> dict | None:
    """Make SIGTERM and SIGHUP (a closed terminal, a dropped SSH session: the launched ranks, in a
    session of their own, would not get it) raise :class:`_Terminated` in the main thread; returns the
    handlers they replaced (None when not called from the main thread, where no handler can be set)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def raise_terminated(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once
        raise _Terminated(signum)

    return {signum: signal.signal(signum, raise_terminated) for signum in (signal.SIGTERM, signal.SIGHUP)}
