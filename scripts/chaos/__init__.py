"""The chaos soak: a galaxy trained for hundreds of syncs over the WAN lab under a seeded schedule of faults,
judged by what a month-long run needs (one model at the end, short out-of-sync streaks, quick repairs, nothing
left running). ``python -m scripts.chaos.soak --help``; issue 34 holds the acceptance targets."""
