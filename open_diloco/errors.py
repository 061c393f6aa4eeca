"""What can go wrong, sorted by who must act. The CLI turns each kind into one line and an exit code.

- :class:`ConfigError`: the user must change a flag or a file (exit 2). :class:`GalaxyMismatch` is the same
  for a galaxy-wide configuration problem only the galaxy can see (a duplicate ``--hv.world-rank``, peers that
  cannot average together): it stops the run instead of turning into a retry.
- :class:`GalaxyError`: the galaxy cannot go on as configured (e.g. a partial round under
  ``--hv.on-partial-round fail``); exit 1.
- :class:`RoundFailed`: one all-reduce round produced no usable result. The round policy handles it (retry,
  proceed alone); it never reaches the user as an error.
- :class:`Stop`: a stop signal (SIGTERM, SIGINT, the launcher gone). It derives from ``BaseException`` so no
  ``except Exception`` on the way (the round policy, hivemind's futures, a library) can turn it into a retry.
"""

from __future__ import annotations


class OpenDilocoError(Exception):
    """Base of the errors whose message is a one-line explanation for a person."""

    exit_code = 1


class ConfigError(OpenDilocoError, ValueError):
    """A configuration problem a user must fix. The message is one line naming the problem and the fix."""

    exit_code = 2


class GalaxyMismatch(ConfigError):
    """Clusters of one galaxy are configured so that they cannot train together."""


class DuplicateGalaxyRank(GalaxyMismatch):
    """Two clusters of one galaxy claim the same ``--hv.world-rank``."""


class GalaxyError(OpenDilocoError):
    """The galaxy cannot continue under the chosen policy."""


class RoundFailed(RuntimeError):
    """An all-reduce round produced no result (timed out, or hivemind raised). The round's buffer holds this
    cluster's own pseudo-gradient or garbage, never a half-applied average; the policy decides what's next."""


class Stop(BaseException):
    """A request to stop the run now (signal or launcher gone); unwinds through every ``finally``."""

    def __init__(self, reason: str, exit_code: int = 143):
        super().__init__(reason)
        self.reason, self.exit_code = reason, exit_code
