"""Exceptions tunelab raises.  Each carries a one-line message fit for a CLI error."""


class TunelabError(Exception):
    """Base class for tunelab errors."""


class RankMismatchError(TunelabError):
    """Ranks submitted different shapes, dtypes or ops for the same collective."""


class CollectiveTimeoutError(TunelabError):
    """A rank did not reach a collective within the timeout (dead, stalled or skipped)."""


class StallError(TunelabError):
    """Some ranks submitted a tensor that others did not submit within the stall timeout."""


class RankExitedError(TunelabError):
    """A rank shut down (its script ended, or raised) while collectives of other ranks waited for it:
    they can never complete, so they fail at once instead of waiting for the timeout."""


class StoreError(TunelabError):
    """The profile store cannot be used (corrupt, foreign, newer schema, locked); the file is left as is."""


class UsageError(TunelabError):
    """The command line asks for something that cannot work (exit status 2, like argparse's errors)."""


class TopologyError(UsageError):
    """The requested node layout or algorithm does not fit the ranks that were launched (a usage error:
    the command exits 2)."""


class ScenarioError(UsageError):
    """A scenario file is missing, unreadable or invalid; the message names the file and the key.
    A usage error: the command exits 2."""


def seen(error: BaseException) -> BaseException:
    """``error``, marked as raised to the job's own code (a wait, a submit): one it met and may have
    handled.  An error the job never met, that only the runtime's shutdown at the interpreter's exit
    finds (a collective left pending, say), fails the process instead (``runtime._shutdown_at_exit``)."""
    try:
        error.tunelab_seen = True  # type: ignore[attr-defined]
    except AttributeError:  # (an exception type without a __dict__)
        pass
    return error


class StoreLocationError(StoreError, UsageError):
    """The store's location, as ``TUNELAB_HOME`` gives it, cannot hold a store (it names a file): a
    setting to fix, so a usage error (exit 2), and still a StoreError for those that catch one."""
