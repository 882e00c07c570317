"""Test-suite settings. Under CI (CI=true) hypothesis runs derandomized, so a CI run is
reproducible; random exploration happens in developers' runs (and QGRU_SWEEP_EXAMPLES=N widens
the config sweep)."""
import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _no_leaked_torch_state():
    """Every test leaves torch's global modes as it found them (grad mode, inference mode, the
    default device and dtype): a test that leaks one changes what later tests check."""
    before = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
              torch.empty(0).device)
    yield
    after = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
             torch.empty(0).device)
    if after != before:
        torch.set_grad_enabled(before[0])
        torch.set_default_dtype(before[2])
        pytest.fail(f"the test changed torch's global state (grad, inference mode, default dtype, default device) "
                    f"from {before} to {after}", pytrace=False)
