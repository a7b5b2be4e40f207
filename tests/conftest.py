import os
import sys

# Tests import the package from the checkout even when it is not installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Property tests draw new examples on every run unless CI is set: CI runs a fixed set of
# examples (a red CI run must be reproducible), local runs keep exploring.
try:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI") or os.environ.get("SP_KPOOL_CI"):
        settings.load_profile("ci")
except ImportError:  # hypothesis is a test dependency; tests that use it import it themselves
    pass
