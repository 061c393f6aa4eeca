"""Link profiles of the WAN lab, read from profiles.toml (a few editable lines each)."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

PROFILES_FILE = Path(__file__).with_name("profiles.toml")


@dataclass(frozen=True)
class Profile:
    """One link profile; every figure is between two endpoints of the lab (see profiles.toml)."""

    name: str
    up_mbit: float
    down_mbit: float
    delay_ms: float
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    @property
    def rtt_ms(self) -> float:
        """The round trip a ping between two endpoints should take."""
        return 2 * self.delay_ms

    def path_mbit(self) -> float:
        """The rate one endpoint can send to another: its uplink, then the other's downlink."""
        return min(self.up_mbit, self.down_mbit)

    def describe(self) -> str:
        rate = (
            f"{self.up_mbit:g} Mbit/s"
            if self.up_mbit == self.down_mbit
            else (f"{self.down_mbit:g} Mbit/s down / {self.up_mbit:g} up")
        )
        jitter = f" ± {self.jitter_ms:g} ms" if self.jitter_ms else ""
        loss = f", {self.loss_pct:g} % loss" if self.loss_pct else ""
        return f"{self.name}: {rate}, {self.delay_ms:g} ms one way{jitter}{loss}"


def _parse_toml(text: str) -> dict[str, dict[str, float]]:
    """The subset of TOML profiles.toml uses ([table] and `key = number`): Python 3.10 lacks tomllib."""
    tables: dict[str, dict[str, float]] = {}
    current = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if m := re.fullmatch(r"\[([A-Za-z0-9_-]+)\]", line):
            current = tables.setdefault(m.group(1), {})
        elif (m := re.fullmatch(r"([A-Za-z_]+)\s*=\s*([0-9.eE+-]+)", line)) and current is not None:
            current[m.group(1)] = float(m.group(2))
        else:
            raise ValueError(f"{PROFILES_FILE.name}:{lineno}: cannot read {raw.strip()!r}")
    return tables


def load_profiles(path: Path = PROFILES_FILE) -> dict[str, Profile]:
    """Every profile in ``path``, by name."""
    known = {f.name for f in fields(Profile)} - {"name"}
    profiles = {}
    for name, values in _parse_toml(path.read_text()).items():
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"{path.name} [{name}]: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        profiles[name] = Profile(name=name, **values)
    return profiles
