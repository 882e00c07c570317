"""Test-suite settings. Under CI (CI=true) hypothesis runs derandomized, so a CI run is
reproducible; random exploration happens in developers' runs (and QGRU_SWEEP_EXAMPLES=N widens
the config sweep)."""
import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


import faulthandler  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# A test that runs past QGRU_TEST_HANG_S seconds (setup and teardown included) is a hang: every
# thread's stack goes to stderr (the test's own frame among them) and the run ends with exit status 1, instead of a CI run that sits
# until its own time limit with nothing to read (one did, on a build lock a killed build had left).
_HANG_S = float(os.environ.get("QGRU_TEST_HANG_S", "900"))


_stderr = []  # the terminal's stderr: the tests' own is captured, and the capture dies with the run


def pytest_configure(config):
    if _HANG_S > 0 and not _stderr:
        _stderr.append(os.fdopen(os.dup(2), "w"))  # capture is suspended while plugins configure


def pytest_unconfigure(config):
    while _stderr:
        _stderr.pop().close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _HANG_S > 0:
        faulthandler.dump_traceback_later(_HANG_S, exit=True, file=_stderr[0] if _stderr else sys.stderr)
    try:
        yield
    finally:
        if _HANG_S > 0:
            faulthandler.cancel_dump_traceback_later()


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


def spawn_ranks(worker, folder, nprocs: int = 2, timeout_s: float = 120.0):
    """Run ``worker(rank, nprocs, init_method, folder)`` in ``nprocs`` spawned processes (a
    torch.distributed group over a file in ``folder``) and return what each rank saved to
    ``folder/rank<r>.pt``; a rank still running after ``timeout_s`` (a hang) fails the test."""
    import time

    import torch.distributed as dist
    import torch.multiprocessing as mp
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    ctx = mp.start_processes(worker, args=(nprocs, f"file://{folder / 'pg_init'}", str(folder)), nprocs=nprocs,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nprocs} ranks did not finish in {timeout_s:.0f} s (a hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]
