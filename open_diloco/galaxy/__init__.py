"""The galaxy over hivemind: the ONLY package that imports hivemind (we override its private methods, so
pyproject pins its minor version and tests/unit/test_hivemind_pin.py checks the overrides still fit).

- ``build``: a cluster's part of the galaxy from its ``--hv.*`` configuration (averagers, status record);
- ``allreduce``: the canonical butterfly all-reduce (every peer copies one result);
- ``averager``: the hivemind averager of one shard and the adapter to the outer loop's ``Averager``;
- ``dht``: DHT start-up with one-line errors, and a bounded shutdown;
- ``lifecycle``: how hivemind's forked processes behave (own process group, exit with their parent).

Importing this package imports nothing: ``from open_diloco.galaxy.averager import ...`` pays for hivemind.
"""

import os as _os

# hivemind logs at INFO by default, and some of its INFO lines read like failures to a newcomer ("Averager
# could not load state from peers: peer dict empty or corrupted {}" at every start). Ours say what matters;
# hivemind's show from WARNING up unless the operator asks for it (LOG_LEVEL=DEBUG, as
# scripts/cluster_train.sh takes it, or hivemind's own HIVEMIND_LOGLEVEL). Set before any hivemind import:
# hivemind reads it once.
if "HIVEMIND_LOGLEVEL" not in _os.environ:
    _os.environ["HIVEMIND_LOGLEVEL"] = (
        "DEBUG" if _os.environ.get("LOG_LEVEL", "").upper() == "DEBUG" else "WARNING"
    )
