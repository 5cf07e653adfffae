import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# shared test helpers (tests/loopback_s3.py) importable from any test folder
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Most tests start Ray without Ray's token auth (no token file under ~/.ray); the quick-start run
# (integration/test_console_run.py) and the S3 run (integration/test_s3_run.py) run with it on.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
