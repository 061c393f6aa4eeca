"""`python -m open_diloco ...`: the `open-diloco` command without relying on an installed console script
(the cluster launcher uses it so a source checkout runs its own code)."""

from open_diloco.cli import main

main()
