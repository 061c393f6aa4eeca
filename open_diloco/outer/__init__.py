"""DiLoCo's outer loop in pure torch: no hivemind import here, so every piece is unit-testable with an
in-process averager. ``protocols`` says what the loop needs from a galaxy, ``state`` owns θ_outer and the
outer optimizer, ``policy`` decides what a round's outcome means, ``diloco`` runs rounds as start + finish."""
