import sys

import pytest
import structlog


@pytest.fixture(autouse=True)
def _logs_to_current_stderr():
    """Tests that run `meshagent` in-process leave structlog writing to a captured stream
    pytest has since closed; log to whatever stderr is current instead."""
    structlog.configure(
        cache_logger_on_first_use=False,
        logger_factory=lambda *args: structlog.PrintLogger(sys.stderr),
    )
