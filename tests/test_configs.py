"""The example configs in configs/ are valid (what a user copies must work)."""
import glob
import json
import os

import pytest

from adacheck.config import AdaCheckConfig

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.json"))))
def test_example_config_blocks_validate(path):
    with open(path) as f:
        cfg = json.load(f)
    c = AdaCheckConfig.from_dict(cfg["adacheck"])
    assert c.enabled
    if "online" in os.path.basename(path):
        assert c.online.enabled and c.save_dir
