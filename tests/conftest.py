"""Test-suite settings. Under CI (CI=true) hypothesis runs derandomized, so a CI run is
reproducible; random exploration happens in developers' runs (and QGRU_SWEEP_EXAMPLES=N widens
the config sweep)."""
import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
