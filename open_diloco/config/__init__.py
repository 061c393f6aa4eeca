"""Typed configuration of a training run.

Every field's docstring is its ``--help`` text. Nested models become flag groups: ``HvConfig`` fields are
``--hv.*`` flags, ``CkptConfig`` fields ``--ckpt.*``. The help panels follow the comment sections of
:class:`Config` (``FLAG_PANELS`` in ``cli/app.py``): a new field goes into one there too. Checks that need
only the config live here (a ``ConfigError`` is turned into a one-line error by ``cli/app.py``); checks that
need the launched world (how many ranks) live in :func:`check_against_world`.

One module a model: ``galaxy.py`` holds :class:`HvConfig`, ``run.py`` :class:`Config` (and
:class:`CkptConfig`, :func:`check_against_world`); ``fields.py`` what every model shares (strict validation,
ranges in ``--help``).
"""

from __future__ import annotations

from open_diloco.config.galaxy import HvConfig
from open_diloco.config.run import CkptConfig, Config, check_against_world

__all__ = ["CkptConfig", "Config", "HvConfig", "check_against_world"]
