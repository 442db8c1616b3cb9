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
