import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Path:
    """The tiny models: the ones `tests/bridge.sh` generated, or fresh ones."""
    given = os.environ.get("PD_BRIDGE_MODELS")
    if given and (Path(given) / "tiny-v4-bf16" / "config.json").exists():
        return Path(given)
    import tiny_models

    root = tmp_path_factory.mktemp("models")
    tiny_models.make_v4(root / "tiny-v4-bf16")
    tiny_models.make_v4(root / "tiny-v4-mxfp8", attention="mxfp8")
    tiny_models.make_mla(root / "tiny-mla")
    return root


# oMLX's native run of each model's prompt (tests/native_runs.py): served once for the session
# and only read by test_blocks, test_resume and test_store_hostile.
@pytest.fixture(scope="session")
def native_v4(models, tmp_path_factory):
    import native_runs

    return native_runs.native_run("tiny-v4-bf16", models, tmp_path_factory)


@pytest.fixture(scope="session")
def native_mla(models, tmp_path_factory):
    import native_runs

    return native_runs.native_run("tiny-mla", models, tmp_path_factory)


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: starts a vLLM or oMLX engine (left out of the quick lane)")
