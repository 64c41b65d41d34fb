"""How long a test's requests to a model may take: as long as the test itself may (pytest's
`timeout` in pyproject.toml, less a margin to report the error), so that a slower CPU level
makes a test slower, never a failure. Below AVX-512 BF16 the default model's bfloat16 runs on
torch ops: measured 33 to 44 tokens/s for a batch of 8 with torch and the kernels capped at
AVX2, 187 natively on AVX-512 BF16 (Zen 4), both beside other work.
"""

from __future__ import annotations

import tomllib

from tests.helpers.paths import REPO_ROOT

_PYTEST = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
TEST_TIMEOUT_S = float(_PYTEST["ini_options"]["timeout"])
REPORT_MARGIN_S = 20.0  # for the client's error to reach the report before the test's timeout
REQUEST_TIMEOUT_S = TEST_TIMEOUT_S - REPORT_MARGIN_S
