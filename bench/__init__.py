"""moegrad benchmarks: `python -m bench.run [--quick|--full]` writes bench/RESULTS.md; each module runs alone too.

The benchmarks share the test-support package (tests/support: the server launcher, the
documentation's example, the soak and the attack suite) so that a benchmark and a test drive the
server with the same code. Its folder is put on ``sys.path`` here, once, as pytest's ``pythonpath``
does for the tests: bench imports tests/support, never the reverse.
"""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
