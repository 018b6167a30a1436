import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
sys.path.insert(0, str(FIXTURES))


def build_fixture(name: str):
    """The model a fixture's build() returns, as `tfdoctor check fixtures/NAME.py:build` would load it."""
    return importlib.import_module(name).build()


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
