import os
import sys

# Tests import the package from the checkout even when it is not installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
