"""The galaxy over hivemind: the ONLY package that imports hivemind (we override its private methods, so
pyproject pins its minor version and tests/unit/test_hivemind_pin.py checks the overrides still fit).

- ``allreduce``: the canonical butterfly all-reduce (every peer copies one result);
- ``averager``: the hivemind averager of one shard and the adapter to the outer loop's ``Averager``;
- ``dht``: DHT start-up with one-line errors, and a bounded shutdown;
- ``lifecycle``: how hivemind's forked processes behave (own process group, exit with their parent).

Importing this package imports nothing: ``from open_diloco.galaxy.averager import ...`` pays for hivemind.
"""
