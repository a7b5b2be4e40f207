import os
import sys

# Tests import the package from the checkout even when it is not installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# matplotlib (the parity plots) keeps its config and font cache in MPLCONFIGDIR: a
# temporary folder of this session, not ~/.config/matplotlib or ~/.cache/matplotlib.
if "MPLCONFIGDIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["MPLCONFIGDIR"] = tempfile.mkdtemp(prefix="sp_kpool_mpl_")
    atexit.register(shutil.rmtree, os.environ["MPLCONFIGDIR"], True)

# Property tests draw new examples on every run unless CI is set: CI runs a fixed set of
# examples (a red CI run must be reproducible), local runs keep exploring.
try:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI") or os.environ.get("SP_KPOOL_CI"):
        settings.load_profile("ci")
except ImportError:  # hypothesis is a test dependency; tests that use it import it themselves
    pass


try:
    import pytest
    import torch

    @pytest.fixture(scope="module")
    def one_thread():
        """One torch thread for a module of tiny-matrix tests (fastest there, and kind to a
        shared machine): ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)
except ImportError:  # torch is the package's dependency; without it nothing here runs anyway
    pass
