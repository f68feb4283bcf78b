"""Suite-wide settings: hypothesis runs derandomized, so every run checks the same examples."""

from __future__ import annotations

import os

from hypothesis import settings

# Deterministic tests (a CI run must not find a new example a developer's run never saw);
# explore with HYPOTHESIS_PROFILE=explore.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
