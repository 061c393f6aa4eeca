"""Entry point users run under torchrun (`torchrun --nproc_per_node=N open_diloco/train_fsdp.py ...`)."""

import os
import sys

if __package__ in (None, ""):
    # Run as a script (torchrun train_fsdp.py): make the package importable from a source checkout.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from open_diloco.cli import main

if __name__ == "__main__":
    main()
